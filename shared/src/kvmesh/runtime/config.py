"""Frozen service settings loaded from explicit sources: defaults < TOML file < environment < command line.

Library code never reads ``os.environ``; each ``__main__`` passes it in. Every setting is a field of a
frozen dataclass with its help text in ``metadata["help"]``; the command-line flag is ``--field-name`` and
the environment variable ``KVMESH_<SERVICE>_<FIELD>`` (or ``KVMESH_<FIELD>`` for fields shared by every
service, such as ``nats_url``). Unknown keys in the TOML file are an error. All problems are reported at
once, each naming the flag or variable at fault.
"""

from __future__ import annotations

import argparse
import dataclasses
import json
import tomllib
from collections.abc import Mapping
from pathlib import Path
from typing import Any, TypeVar

import msgspec

from kvmesh.core.errors import ConfigError

SHARED_FIELDS = frozenset({"nats_url", "log_level", "route_subject", "match_subject", "stream"})

T = TypeVar("T")


def setting(default: Any, help: str, *, flag: str | None = None, secret: bool = False) -> Any:
    """Declare a settings field with its help text (and an optional short flag)."""
    if isinstance(default, list | dict):
        return dataclasses.field(
            default_factory=lambda: type(default)(default),
            metadata={"help": help, "flag": flag, "secret": secret},
        )
    return dataclasses.field(default=default, metadata={"help": help, "flag": flag, "secret": secret})


def env_name(service: str, name: str) -> str:
    """Return the environment variable for a field (``KVMESH_INGEST_ZMQ_ENDPOINT``, ``KVMESH_NATS_URL``)."""
    if name in SHARED_FIELDS:
        return f"KVMESH_{name.upper()}"
    return f"KVMESH_{service.upper()}_{name.upper()}"


def add_arguments(parser: argparse.ArgumentParser, cls: type[Any], service: str) -> None:
    """Add one ``--flag`` per settings field, plus ``--config`` and ``--print-config``."""
    for f in dataclasses.fields(cls):
        names = [f"--{f.name.replace('_', '-')}"]
        if f.metadata.get("flag"):
            names.insert(0, f.metadata["flag"])
        default = f.default if f.default is not dataclasses.MISSING else f.default_factory()  # type: ignore[operator]
        help_text = f"{f.metadata.get('help', '')} [env {env_name(service, f.name)}; default {default!r}]"
        if f.type in ("bool", bool):
            parser.add_argument(
                *names, dest=f.name, action=argparse.BooleanOptionalAction, default=None, help=help_text
            )
        else:
            parser.add_argument(*names, dest=f.name, default=None, help=help_text, metavar=f.name.upper())
    parser.add_argument(
        "--config",
        dest="_config",
        type=Path,
        default=None,
        metavar="FILE",
        help="TOML file with settings (a [service] table or top-level keys)",
    )
    parser.add_argument(
        "--print-config",
        dest="_print_config",
        action="store_true",
        help="print the effective settings and exit",
    )


def load(
    cls: type[T],
    *,
    service: str,
    environ: Mapping[str, str],
    args: argparse.Namespace | None = None,
    config_file: Path | None = None,
) -> T:
    """Build settings from defaults, a TOML file, the environment and parsed arguments, in that order.

    Raises:
        ConfigError: a value does not convert, the file has unknown keys, or `validate()` found problems.
    """
    fields = {f.name: f for f in dataclasses.fields(cls)}  # type: ignore[arg-type]
    values: dict[str, Any] = {}
    problems: list[str] = []
    if config_file is None and args is not None:
        config_file = getattr(args, "_config", None)
    if config_file is not None:
        try:
            data = tomllib.loads(config_file.read_text())
        except (OSError, tomllib.TOMLDecodeError) as exc:
            raise ConfigError([f"{config_file}: {exc}"]) from exc
        table = data.get(service, data)
        for key, value in table.items():
            if key not in fields:
                problems.append(f"{config_file}: unknown setting {key!r}")
            else:
                values[key] = value
    for name, f in fields.items():
        var = env_name(service, name)
        if var in environ:
            values[name] = _parse_text(environ[var], f)
    if args is not None:
        for name, f in fields.items():
            value = getattr(args, name, None)
            if value is not None:
                values[name] = _parse_text(value, f) if isinstance(value, str) else value
    for name, value in list(values.items()):
        try:
            msgspec.convert({name: value}, _single(cls, name), strict=False)
        except msgspec.ValidationError as exc:
            problems.append(f"--{name.replace('_', '-')} / {env_name(service, name)}: {exc}")
            values.pop(name)
    if problems:
        raise ConfigError(problems)
    settings = msgspec.convert(values, cls, strict=False)
    validate = getattr(settings, "validate", None)
    if validate is not None:
        problems = list(validate())
        if problems:
            raise ConfigError(problems)
    return settings


def _parse_text(text: str, f: dataclasses.Field[Any]) -> Any:
    kind = str(f.type)
    if kind.startswith(("list", "dict")) and text.strip().startswith(("[", "{")):
        return json.loads(text)
    if kind.startswith("list"):
        return [part.strip() for part in text.split(",") if part.strip()]
    if text == "" and "None" in kind:
        return None
    return text


_single_cache: dict[tuple[type[Any], str], type[Any]] = {}


def _single(cls: type[Any], name: str) -> type[Any]:
    key = (cls, name)
    if key not in _single_cache:
        f = next(f for f in dataclasses.fields(cls) if f.name == name)
        _single_cache[key] = dataclasses.make_dataclass(f"{cls.__name__}_{name}", [(name, f.type)])
    return _single_cache[key]


def to_dict(settings: Any) -> dict[str, Any]:
    """Return the settings as a plain dict, secrets redacted (for ``--print-config``): secret fields read
    ``***``, and a URL's user info (``nats://user:pass@host``) reads ``nats://***@host``."""
    from kvmesh.runtime.nats import redact_url  # noqa: PLC0415 - config stays importable without nats-py

    out: dict[str, Any] = {}
    for f in dataclasses.fields(settings):
        value = getattr(settings, f.name)
        if f.metadata.get("secret") and value:
            value = "***"
        elif isinstance(value, str) and "@" in value and "://" in value:
            value = redact_url(value)
        out[f.name] = value
    return out
