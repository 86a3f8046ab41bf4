"""The one logging setup of every kvmesh service and tool: JSON lines for machines, one readable line for people.

`setup_logging` sends every record to stderr through one handler. With ``fmt="json"`` (``"auto"`` when stderr
is not a terminal: a pipe, a file, a container's log) each record is one JSON object on one line::

    {"ts": "2025-06-01T12:00:00.123Z", "level": "WARNING", "logger": "kvmesh.ingest", "service": "ingest",
     "msg": "worker w rank 0: sequence gap before seq 5 (last 3); replaying from 4",
     "worker_id": "w", "dp_rank": 0, "seq": 5}

``ts`` is ISO-8601 UTC with milliseconds, ``level`` Python's level name, ``msg`` the formatted message, then
the structured fields a call gave with ``extra=`` (`FIELDS` first, in that order, then any others sorted by
name), ``trace_id``/``span_id`` (lower-case hex) when the current OpenTelemetry context holds a span
(started here or propagated from a caller), and ``exc`` (``{"type", "message", "traceback"}``) when the record carries an exception. With
``fmt="text"`` (``"auto"`` on a terminal) each record is ``HH:MM:SS LEVEL service: msg key=value ...`` in local
time, an exception's traceback on the lines after it.

Secrets are kept out where they enter: `kvmesh.runtime.nats` scrubs credentials from URLs and connect errors
before anything logs them; this module adds nothing that was not in the record.
"""

from __future__ import annotations

import json
import logging
import sys
import time
import traceback
from typing import IO, Any, Final, Literal

from opentelemetry import trace

LogFormat = Literal["auto", "json", "text"]

LOG_FORMATS: Final[tuple[str, ...]] = ("auto", "json", "text")
"""The values of ``--log-format`` (``KVMESH_LOG_FORMAT``)."""

FIELDS: Final[tuple[str, ...]] = (
    "worker_id",
    "dp_rank",
    "epoch",
    "seq",
    "stream_seq",
    "request_id",
    "replica",
)
"""The structured fields of kvmesh's log calls, in the order a line shows them: the engine's worker and data
parallel rank, the index epoch, the engine sequence (``seq``), the JetStream sequence (``stream_seq``), a
route's request id and an index replica's name."""

_BARE = logging.LogRecord("", logging.INFO, "", 0, "", None, None)
_STANDARD: Final[frozenset[str]] = frozenset(_BARE.__dict__) | {"message", "asctime", "taskName"}
"""The attributes every `logging.LogRecord` has: whatever else a record carries came from ``extra=``."""


def record_fields(record: logging.LogRecord) -> dict[str, Any]:
    """The structured fields of a record (given with ``extra=``): `FIELDS` in their order, then the rest by name."""
    given = {k: v for k, v in record.__dict__.items() if k not in _STANDARD and not k.startswith("_")}
    out = {k: given.pop(k) for k in FIELDS if k in given}
    out.update(sorted(given.items()))
    return out


def span_ids() -> tuple[str, str] | None:
    """The (trace id, span id) of the OpenTelemetry span current in this context, as 32 and 16 lower-case hex
    digits; None when there is none (no span started or propagated into this context)."""
    ctx = trace.get_current_span().get_span_context()
    if not ctx.is_valid:
        return None
    return f"{ctx.trace_id:032x}", f"{ctx.span_id:016x}"


def _plain(value: Any) -> Any:
    """``value`` as JSON takes it: str, int, float, bool and None as they are, anything else as its str()."""
    if value is None or isinstance(value, str | int | float | bool):
        return value
    if isinstance(value, list | tuple):
        return [_plain(v) for v in value]
    return str(value)


class JsonFormatter(logging.Formatter):
    """One JSON object per record on one line (see the module docstring for its keys).

    Args:
        service: the ``service`` value of every line (``"ingest"``, ``"indexer"``, ``"router"``, ``"sim"``).
    """

    def __init__(self, service: str) -> None:
        super().__init__()
        self.service = service

    def format(self, record: logging.LogRecord) -> str:
        ts = time.strftime("%Y-%m-%dT%H:%M:%S", time.gmtime(record.created))
        out: dict[str, Any] = {
            "ts": f"{ts}.{int(record.msecs):03d}Z",
            "level": record.levelname,
            "logger": record.name,
            "service": self.service,
            "msg": record.getMessage(),
        }
        for key, value in record_fields(record).items():
            out.setdefault(key, _plain(value))
        ids = span_ids()
        if ids is not None:
            out["trace_id"], out["span_id"] = ids
        if record.exc_info and record.exc_info[0] is not None:
            kind, exc, tb = record.exc_info
            out["exc"] = {
                "type": kind.__name__,
                "message": str(exc),
                "traceback": "".join(traceback.format_exception(kind, exc, tb)).rstrip("\n"),
            }
        if record.stack_info:
            out["stack"] = record.stack_info
        return json.dumps(out, ensure_ascii=False, default=str)


def _text_value(value: Any) -> str:
    text = str(value)
    if not text or any(c.isspace() or c in '"=' for c in text):
        return json.dumps(text, ensure_ascii=False)
    return text


class TextFormatter(logging.Formatter):
    """``HH:MM:SS LEVEL service: msg key=value ...`` (local time), the traceback of an exception after it.

    Args:
        service: the service named on every line.
    """

    def __init__(self, service: str) -> None:
        super().__init__()
        self.service = service

    def format(self, record: logging.LogRecord) -> str:
        clock = time.strftime("%H:%M:%S", time.localtime(record.created))
        parts = [f"{clock} {record.levelname} {self.service}: {record.getMessage()}"]
        parts += [f"{k}={_text_value(v)}" for k, v in record_fields(record).items()]
        ids = span_ids()
        if ids is not None:
            parts += [f"trace_id={ids[0]}", f"span_id={ids[1]}"]
        line = " ".join(parts)
        if record.exc_info and record.exc_info[0] is not None:
            line += "\n" + self.formatException(record.exc_info)
        if record.stack_info:
            line += "\n" + self.formatStack(record.stack_info)
        return line


def resolve_format(fmt: str, stream: IO[str]) -> Literal["json", "text"]:
    """The format ``fmt`` means on ``stream``: ``"auto"`` is text on a terminal, JSON anywhere else.

    Raises:
        ValueError: ``fmt`` is not one of `LOG_FORMATS`.
    """
    if fmt == "json":
        return "json"
    if fmt == "text":
        return "text"
    if fmt != "auto":
        raise ValueError(f"log format must be one of {', '.join(LOG_FORMATS)}, got {fmt!r}")
    try:
        tty = stream.isatty()
    except (AttributeError, ValueError):  # closed or not a real file
        tty = False
    return "text" if tty else "json"


def make_formatter(fmt: str, service: str, stream: IO[str]) -> logging.Formatter:
    """The formatter of ``fmt`` (`resolve_format`) for ``service``'s lines on ``stream``."""
    if resolve_format(fmt, stream) == "json":
        return JsonFormatter(service)
    return TextFormatter(service)


def setup_logging(level: str, service: str, fmt: str = "auto", *, stream: IO[str] | None = None) -> None:
    """Send every record at ``level`` or above to ``stream`` (stderr) as ``fmt`` says, replacing any handler
    the root logger had.

    Args:
        level: a level name (``"DEBUG"``, ``"info"``, ...); an unknown one means INFO.
        service: the service every line names.
        fmt: ``"auto"``, ``"json"`` or ``"text"`` (`resolve_format`).
        stream: where lines go; None is the current ``sys.stderr``.

    Raises:
        ValueError: ``fmt`` is not one of `LOG_FORMATS`.
    """
    out = stream if stream is not None else sys.stderr
    handler = logging.StreamHandler(out)
    handler.setFormatter(make_formatter(fmt, service, out))
    root = logging.getLogger()
    for old in root.handlers[:]:
        root.removeHandler(old)
        old.close()
    root.addHandler(handler)
    root.setLevel(getattr(logging, level.upper(), logging.INFO))
