"""A route request of a later protocol version is refused, as `kvmesh.core.protocol.decode` refuses every other
message of a later version (no NATS: the pure parse the route endpoint calls)."""

from __future__ import annotations

import pytest

from kvmesh.core.errors import RequestError
from kvmesh.core.protocol import PROTOCOL_VERSION
from kvmesh.core.route import parse_route_request


def test_a_route_request_of_a_later_version_is_a_request_error_naming_version() -> None:
    """``"version": PROTOCOL_VERSION + 1`` raises RequestError with field ``version`` and both versions said."""
    later = PROTOCOL_VERSION + 1
    body = b'{"version": %d, "model": "m", "token_ids": [1, 2, 3]}' % later
    with pytest.raises(RequestError) as info:
        parse_route_request(body)
    assert info.value.field == "version"
    assert str(info.value) == (
        f"RouteRequest of version {later}: this kvmesh reads up to version {PROTOCOL_VERSION}"
    )


def test_a_route_request_of_this_version_or_none_is_parsed() -> None:
    """``"version": PROTOCOL_VERSION`` and no version at all both parse to the same tokens."""
    with_version = parse_route_request(b'{"version": %d, "model": "m", "token_ids": [7]}' % PROTOCOL_VERSION)
    without = parse_route_request(b'{"model": "m", "token_ids": [7]}')
    assert (with_version.version, list(with_version.token_ids)) == (PROTOCOL_VERSION, [7])
    assert list(without.token_ids) == [7]
