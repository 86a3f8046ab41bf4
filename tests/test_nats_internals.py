"""The nats-py private attributes kvmesh relies on (all behind `kvmesh.runtime.nats`) still exist and behave.

These fail loudly when a nats-py release renames or reshapes them, instead of an ingest silently re-sending out
of order, a registry read failing, or router errors missing from ``$SRV.STATS``. Real nats-server, real client.
"""

from __future__ import annotations

import nats
import nats.errors
import nats.js.errors
import pytest
from nats.micro import add_service
from nats.micro.service import EndpointConfig, ServiceConfig

from kvmesh.core import protocol
from kvmesh.core.errors import ConnectionClosedForGood, StreamUnavailableError, TransportError
from kvmesh.core.protocol import MicroServiceStats
from kvmesh.runtime.nats import (
    bucket_stream,
    count_endpoint_error,
    micro_endpoint,
    transport_error,
    withdraw_buffered_publishes,
)

pytestmark = [pytest.mark.anyio, pytest.mark.nats]


async def test_withdraw_takes_only_this_contexts_buffered_publishes(nats_url: str, uid: str) -> None:
    """Publishes buffered with the JetStream context's ack inbox as reply are withdrawn; others stay."""
    nc = await nats.connect(nats_url)
    try:
        js = nc.jetstream()
        await js.add_stream(name=f"S{uid}", subjects=[f"s.{uid}"])
        await (await js.publish_async(f"s.{uid}", b"0"))  # sets up the context's async ack inbox
        prefix = bytes(js._async_reply_prefix or b"").decode()
        assert prefix.startswith("_INBOX.")
        # No await below yields to the event loop, so nats-py's flusher task cannot write them out meanwhile.
        await nc.publish(f"s.{uid}", b"1", reply=prefix + "a")
        await nc.publish(f"other.{uid}", b"2")
        await nc.publish(f"s.{uid}", b"3", reply=prefix + "b", headers={"Nats-Msg-Id": "x"})
        assert len(nc._pending) == 3
        assert withdraw_buffered_publishes(nc, js) == 2
        assert len(nc._pending) == 1 and nc._pending[0].startswith(f"PUB other.{uid} ".encode())
        assert nc._pending_data_size == len(nc._pending[0])
        assert withdraw_buffered_publishes(nc, js) == 0
    finally:
        await nc.close()


async def test_bucket_stream_names_the_kv_buckets_stream(nats_url: str, uid: str) -> None:
    """bucket_stream gives the bucket's JetStream context, stream KV_<bucket> and key prefix $KV.<bucket>."""
    nc = await nats.connect(nats_url)
    try:
        js = nc.jetstream()
        kv = await js.create_key_value(bucket=f"B{uid}")
        got_js, stream, prefix = bucket_stream(kv)
        assert (stream, prefix) == (f"KV_B{uid}", f"$KV.B{uid}.")
        info = await got_js.stream_info(stream)
        assert info.config.name == stream
    finally:
        await nc.close()


async def test_an_endpoint_error_counted_by_hand_shows_in_srv_stats(nats_url: str, uid: str) -> None:
    """count_endpoint_error on micro_endpoint(service, name) shows as num_errors/last_error in $SRV.STATS."""
    nc = await nats.connect(nats_url)
    try:

        async def handler(req: object) -> None:
            return None

        service = await add_service(nc, ServiceConfig(name=f"svc{uid}", version="0.0.1"))
        await service.add_endpoint(EndpointConfig(name="ep", subject=f"ep.{uid}", handler=handler))
        with pytest.raises(LookupError):
            micro_endpoint(service, "nope")
        count_endpoint_error(micro_endpoint(service, "ep"), "bad_request: x")
        count_endpoint_error(micro_endpoint(service, "ep"), "internal: y")
        msg = await nc.request(f"$SRV.STATS.svc{uid}", b"", timeout=2)
        ep = protocol.decode(msg.data, MicroServiceStats).endpoints[0]
        assert (ep.num_errors, ep.last_error) == (2, "internal: y")
        await service.stop()
    finally:
        await nc.close()


def test_nats_errors_map_to_the_transport_tree() -> None:
    """Closed → ConnectionClosedForGood, missing stream → StreamUnavailableError, the rest → TransportError."""
    closed = transport_error(nats.errors.ConnectionClosedError(), "publish")
    assert type(closed) is ConnectionClosedForGood
    missing = transport_error(nats.js.errors.NotFoundError(), "stream info KV")
    assert type(missing) is StreamUnavailableError
    assert str(transport_error(nats.errors.TimeoutError(), "get")) == "get: timed out"
    none = transport_error(nats.errors.NoRespondersError(), "request")
    assert type(none) is TransportError and str(none).startswith("request: no responders")
    other = transport_error(nats.errors.MaxPayloadError(), "publish")
    assert type(other) is TransportError and str(other).startswith("publish: MaxPayloadError: ")
