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
import re
import tomllib
from collections.abc import Mapping
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Final, TypeVar

import msgspec

from kvmesh.core.errors import ConfigError

T = TypeVar("T")


def setting(default: Any, help: str, *, flag: str | None = None, secret: bool = False) -> Any:
    """Declare a settings field with its help text (and an optional short flag)."""
    if isinstance(default, list | dict):
        return dataclasses.field(
            default_factory=lambda: type(default)(default),
            metadata={"help": help, "flag": flag, "secret": secret},
        )
    return dataclasses.field(default=default, metadata={"help": help, "flag": flag, "secret": secret})


@dataclass(frozen=True, slots=True, kw_only=True)
class NatsAuth:
    """How a process proves who it is to NATS, and how it checks the server (every service's settings and
    every operator command carry these; `kvmesh.runtime.nats.connect_options` turns them into nats-py's).

    At most one way of authenticating: user and password, a token, an NKey seed file, or a ``.creds`` file.
    """

    nats_user: str = setting("", "NATS user name (with --nats-password)")
    nats_password: str = setting("", "NATS password of --nats-user", secret=True)
    nats_token: str = setting("", "NATS authentication token", secret=True)
    nats_nkey_seed_file: str = setting("", "file holding the NKey seed (SU...) of the NATS user")
    nats_creds_file: str = setting("", "NATS .creds file (user JWT and NKey seed)")
    nats_tls_ca_file: str = setting("", "CA bundle (PEM) that verifies the NATS server's certificate")
    nats_tls_cert_file: str = setting("", "client certificate (PEM) presented to the NATS server")
    nats_tls_key_file: str = setting("", "key (PEM) of --nats-tls-cert-file (when not in the same file)")
    nats_tls_server_name: str = setting("", "name the NATS server's certificate must carry (SNI)")
    nats_inbox_prefix: str = setting(
        "",
        "subject prefix of this process's reply inboxes (default _INBOX; deploy/nats gives each role its own)",
    )


AUTH_FIELDS = frozenset(f.name for f in dataclasses.fields(NatsAuth))
"""The `NatsAuth` settings: shared by every service (``KVMESH_NATS_USER``, ``KVMESH_NATS_TLS_CA_FILE``, ...)."""

SHARED_FIELDS = (
    frozenset(
        {
            "nats_url",
            "log_level",
            "log_format",
            "route_subject",
            "match_subject",
            "stream",
            "health_file",
            "metrics_port",
            "max_blocks",
        }
    )
    | AUTH_FIELDS
)

_INBOX_PREFIX = re.compile(r"[A-Za-z0-9_-]+(?:\.[A-Za-z0-9_-]+)*")
"""A reply-inbox prefix: one or more literal subject tokens."""

_FILES = (
    "nats_nkey_seed_file",
    "nats_creds_file",
    "nats_tls_ca_file",
    "nats_tls_cert_file",
    "nats_tls_key_file",
)


def auth_environ(auth: NatsAuth) -> dict[str, str]:
    """The ``KVMESH_NATS_*`` variables that hand these settings to a child process (secrets stay off its
    command line, which anyone who lists processes can read)."""
    return {
        f"KVMESH_{name.upper()}": getattr(auth, name) for name in sorted(AUTH_FIELDS) if getattr(auth, name)
    }


def auth_problems(auth: NatsAuth) -> list[str]:
    """What is wrong with NATS credentials and TLS settings (empty when they can be used)."""
    problems: list[str] = []
    given = [
        name
        for name, on in (
            ("--nats-user/--nats-password", bool(auth.nats_user or auth.nats_password)),
            ("--nats-token", bool(auth.nats_token)),
            ("--nats-nkey-seed-file", bool(auth.nats_nkey_seed_file)),
            ("--nats-creds-file", bool(auth.nats_creds_file)),
        )
        if on
    ]
    if len(given) > 1:
        problems.append(f"give one way of authenticating to NATS, not {' and '.join(given)}")
    if auth.nats_password and not auth.nats_user:
        problems.append("--nats-password needs --nats-user")
    if auth.nats_inbox_prefix and (
        len(auth.nats_inbox_prefix) > 200 or not _INBOX_PREFIX.fullmatch(auth.nats_inbox_prefix)
    ):
        problems.append(
            f"--nats-inbox-prefix {auth.nats_inbox_prefix!r} is not a subject prefix "
            "(tokens of letters, digits, _ and - separated by dots; no wildcards; at most 200 characters)"
        )
    if auth.nats_tls_key_file and not auth.nats_tls_cert_file:
        problems.append("--nats-tls-key-file needs --nats-tls-cert-file")
    for name in _FILES:
        path = getattr(auth, name)
        if path and not Path(path).is_file():
            problems.append(f"--{name.replace('_', '-')} / {env_name('', name)}: no such file: {path}")
    return problems


def env_name(service: str, name: str) -> str:
    """Return the environment variable for a field (``KVMESH_INGEST_ZMQ_ENDPOINT``, ``KVMESH_NATS_URL``)."""
    if name in SHARED_FIELDS:
        return f"KVMESH_{name.upper()}"
    return f"KVMESH_{service.upper()}_{name.upper()}"


def _env_names(service: str, name: str) -> tuple[str, ...]:
    """The variables a field reads, weakest first: a shared field reads ``KVMESH_<FIELD>`` and then, when a
    service is named, ``KVMESH_<SERVICE>_<FIELD>`` (one service's own value over the fleet's)."""
    fleet = env_name(service, name)
    if name not in SHARED_FIELDS or not service:
        return (fleet,)
    return (fleet, f"KVMESH_{service.upper()}_{name.upper()}")


def add_arguments(parser: argparse.ArgumentParser, cls: type[Any], service: str) -> None:
    """Add one ``--flag`` per settings field, plus ``--config`` and ``--print-config``."""
    add_fields(parser, cls, service)
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


def add_fields(parser: argparse._ActionsContainer, cls: type[Any], service: str) -> None:
    """Add one ``--flag`` per settings field of ``cls`` (its value is read by `load`)."""
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
        for var in _env_names(service, name):  # a shared field's own-service variable comes last and wins
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
            problems.append(
                f"--{name.replace('_', '-')} / {env_name(service, name)}: {_type_problem(fields[name], value, exc)}"
            )
            values.pop(name)
    if problems:
        raise ConfigError(problems)
    settings = msgspec.convert(values, cls, strict=False)
    if isinstance(settings, NatsAuth):
        problems = auth_problems(settings)
    validate = getattr(settings, "validate", None)
    if validate is not None:
        problems += list(validate())
    if problems:
        raise ConfigError(problems)
    return settings


_KINDS: Final[dict[str, str]] = {
    "int": "an integer",
    "float": "a number",
    "bool": "true or false",
    "str": "text",
}


def _type_problem(f: dataclasses.Field[Any], value: Any, exc: msgspec.ValidationError) -> str:
    """What is wrong with a value of the wrong type, in the setting's words (``must be an integer (or none),
    got 'abc'``); msgspec's own message for the other types (lists, maps)."""
    kind = str(f.type)
    optional = kind.endswith(" | None")
    wanted = _KINDS.get(kind.removesuffix(" | None"))
    if wanted is None:
        return str(exc)
    return f"must be {wanted}{' (or none)' if optional else ''}, got {value!r}"


def _parse_text(text: str, f: dataclasses.Field[Any]) -> Any:
    kind = str(f.type)
    if kind.startswith(("list", "dict")) and text.strip().startswith(("[", "{")):
        return json.loads(text)
    if kind.startswith("list"):
        return [part.strip() for part in text.split(",") if part.strip()]
    if "None" in kind and (text == "" or (text.strip().lower() == "none" and not kind.startswith("str"))):
        return None  # an optional number: empty or "none" (what the help's "none: off" says) is unset
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
