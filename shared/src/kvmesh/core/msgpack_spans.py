"""Byte spans of msgpack values, without decoding them: so one bad value can be set apart from the rest.

Pure code. `kvmesh.core.wire.decode_batch` decodes a whole payload at once (fast); only when that fails on
a string that is not UTF-8 does it split the batch into its events with `array_spans` and decode each alone,
so such an event is rejected by itself instead of the batch (msgpack ``str`` must be UTF-8; msgspec refuses
the whole value otherwise).

Formats: the msgpack specification (nil, bool, ints, floats, str, bin, ext, array and map, every width).

SpanError (ValueError)   the bytes are not one well-formed msgpack value at that position
"""

from __future__ import annotations

from typing import Final

MAX_DEPTH: Final[int] = 64
"""Nesting a span walk follows (KV events nest 4 deep; deeper is refused, as the decoder does)."""

_FIXED: Final[dict[int, int]] = {
    0xC0: 0, 0xC2: 0, 0xC3: 0,  # nil, false, true
    0xCC: 1, 0xCD: 2, 0xCE: 4, 0xCF: 8,  # uint 8/16/32/64
    0xD0: 1, 0xD1: 2, 0xD2: 4, 0xD3: 8,  # int 8/16/32/64
    0xCA: 4, 0xCB: 8,  # float 32/64
    0xD4: 2, 0xD5: 3, 0xD6: 5, 0xD7: 9, 0xD8: 17,  # fixext 1/2/4/8/16 (type byte + data)
}  # fmt: skip
"""Marker → bytes after it, for values of a fixed size."""
_SIZED: Final[dict[int, tuple[int, int]]] = {
    0xD9: (1, 0), 0xDA: (2, 0), 0xDB: (4, 0),  # str 8/16/32
    0xC4: (1, 0), 0xC5: (2, 0), 0xC6: (4, 0),  # bin 8/16/32
    0xC7: (1, 1), 0xC8: (2, 1), 0xC9: (4, 1),  # ext 8/16/32 (length, then a type byte)
}  # fmt: skip
"""Marker → (bytes of its length field, extra bytes before the data)."""


class SpanError(ValueError):
    """The bytes are not a well-formed msgpack value at the position walked."""


def value_end(buf: bytes, pos: int, depth: int = 0) -> int:
    """The offset just past the msgpack value that starts at ``pos``.

    Raises:
        SpanError: truncated, an unused marker (0xC1), or nested deeper than `MAX_DEPTH`.
    """
    n, pos = _header(buf, pos)
    if n is None:
        return _check(buf, pos)
    count, is_map = n
    if depth >= MAX_DEPTH:
        raise SpanError(f"nested deeper than {MAX_DEPTH}")
    for _ in range(2 * count if is_map else count):
        pos = value_end(buf, pos, depth + 1)
    return pos


def array_spans(buf: bytes, pos: int = 0) -> tuple[list[tuple[int, int]], int]:
    """The (start, end) span of each item of the array at ``pos``, and the offset past the array.

    Raises:
        SpanError: no array at ``pos``, or an item is not well formed.
    """
    n, start = _header(buf, pos)
    if n is None or n[1]:
        raise SpanError(f"no array at offset {pos}")
    spans = []
    for _ in range(n[0]):
        end = value_end(buf, start, 1)
        spans.append((start, end))
        start = end
    return spans, start


def map_spans(buf: bytes, pos: int) -> list[tuple[tuple[int, int], tuple[int, int]]]:
    """The (key span, value span) pairs of the map at ``pos``.

    Raises:
        SpanError: no map at ``pos``, or an entry is not well formed.
    """
    n, start = _header(buf, pos)
    if n is None or not n[1]:
        raise SpanError(f"no map at offset {pos}")
    out = []
    for _ in range(n[0]):
        key_end = value_end(buf, start, 1)
        value_stop = value_end(buf, key_end, 1)
        out.append(((start, key_end), (key_end, value_stop)))
        start = value_stop
    return out


def is_array(buf: bytes, pos: int) -> bool:
    """Whether the value at ``pos`` is an array (else a map, a scalar, or nothing)."""
    return pos < len(buf) and (0x90 <= buf[pos] <= 0x9F or buf[pos] in (0xDC, 0xDD))


def _header(buf: bytes, pos: int) -> tuple[tuple[int, bool] | None, int]:
    """(None, the value's end) for a scalar; ((item count, is a map), the first item's offset) otherwise."""
    if pos >= len(buf):
        raise SpanError(f"truncated at offset {pos}")
    b = buf[pos]
    if b <= 0x7F or b >= 0xE0:  # positive / negative fixint
        return None, pos + 1
    if 0x80 <= b <= 0x8F:
        return (b & 0x0F, True), pos + 1
    if 0x90 <= b <= 0x9F:
        return (b & 0x0F, False), pos + 1
    if 0xA0 <= b <= 0xBF:  # fixstr
        return None, pos + 1 + (b & 0x1F)
    if b in (0xDC, 0xDE):
        return (_uint(buf, pos + 1, 2), b == 0xDE), pos + 3
    if b in (0xDD, 0xDF):
        return (_uint(buf, pos + 1, 4), b == 0xDF), pos + 5
    fixed = _FIXED.get(b)
    if fixed is not None:
        return None, pos + 1 + fixed
    sized = _SIZED.get(b)
    if sized is not None:
        width, extra = sized
        return None, pos + 1 + width + extra + _uint(buf, pos + 1, width)
    raise SpanError(f"unused msgpack marker 0x{b:02x} at offset {pos}")


def _uint(buf: bytes, pos: int, width: int) -> int:
    if pos + width > len(buf):
        raise SpanError(f"truncated at offset {pos}")
    return int.from_bytes(buf[pos : pos + width], "big")


def _check(buf: bytes, end: int) -> int:
    if end > len(buf):
        raise SpanError(f"truncated: a value runs to offset {end} of {len(buf)}")
    return end
