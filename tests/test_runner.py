"""The one service lifecycle (`kvmesh.runtime.runner`): `supervise` and `run_async`'s exit codes, with a real
nats-server for the connection."""

from __future__ import annotations

import asyncio
import logging

import nats
import nats.errors
import pytest

from kvmesh.core.errors import ConnectionClosedForGood
from kvmesh.runtime.runner import run_async, supervise

pytestmark = [pytest.mark.anyio, pytest.mark.nats]


async def test_supervise_returns_on_stop_and_cancels_every_loop(nats_url: str) -> None:
    """Setting stop ends supervise normally; a loop still running is cancelled, one that finished stays done."""
    nc = await nats.connect(nats_url)
    stop = asyncio.Event()
    seen: list[str] = []

    async def forever() -> None:
        try:
            await asyncio.sleep(3600)
        except asyncio.CancelledError:
            seen.append("cancelled")
            raise

    async def short() -> None:
        seen.append("short done")
        stop.set()

    try:
        await asyncio.wait_for(
            supervise(nc, {"forever": forever(), "short": short()}, stop=stop, name="t"), 5
        )
    finally:
        await nc.close()
    assert seen == ["short done", "cancelled"]


async def test_supervise_raises_the_failing_loops_error_unwrapped(nats_url: str) -> None:
    """A loop that raises ends supervise with that very exception; the other loops are cancelled."""
    nc = await nats.connect(nats_url)
    cancelled = asyncio.Event()

    async def forever() -> None:
        try:
            await asyncio.sleep(3600)
        except asyncio.CancelledError:
            cancelled.set()
            raise

    async def broken() -> None:
        await asyncio.sleep(0)
        raise ValueError("loop broke")

    try:
        with pytest.raises(ValueError, match="loop broke"):
            await asyncio.wait_for(
                supervise(nc, {"a": forever(), "b": broken()}, stop=asyncio.Event(), name="t"), 5
            )
    finally:
        await nc.close()
    assert cancelled.is_set()


async def test_supervise_exits_when_the_connection_is_closed_for_good(nats_url: str) -> None:
    """A connection closed for good (not reconnecting) raises ConnectionClosedForGood naming the service."""
    nc = await nats.connect(nats_url)

    async def forever() -> None:
        await asyncio.sleep(3600)

    async def close_soon() -> None:
        await asyncio.sleep(0.1)
        await nc.close()

    with pytest.raises(
        ConnectionClosedForGood, match=r"^indexer i-0: the NATS connection was closed for good"
    ):
        await asyncio.wait_for(
            supervise(
                nc,
                {"a": forever(), "closer": close_soon()},
                stop=asyncio.Event(),
                name="indexer i-0",
                closed_poll_s=0.05,
            ),
            5,
        )


class _Raises:
    """A service whose run() raises what it is given."""

    def __init__(self, exc: BaseException) -> None:
        self.exc = exc

    async def run(self) -> None:
        raise self.exc

    def stop(self) -> None:
        return None


def test_a_stray_nats_error_exits_1_with_one_log_line(caplog: pytest.LogCaptureFixture) -> None:
    """A nats-py error a service did not map ends run_async with exit 1 and a mapped one-line log, no traceback."""
    caplog.set_level(logging.ERROR, logger="kvmesh")
    assert run_async(_Raises(nats.errors.NoRespondersError())) == 1
    records = [r for r in caplog.records if r.name == "kvmesh"]
    assert [r.getMessage() for r in records] == [
        "NATS: no responders (is JetStream enabled, the service running?)"
    ]
    assert records[0].exc_info is None


def test_a_kvmesh_error_exits_1_and_a_clean_run_0(caplog: pytest.LogCaptureFixture) -> None:
    """run_async returns 1 for a KvmeshError (logged as its message) and 0 for a run that returns."""
    caplog.set_level(logging.ERROR, logger="kvmesh")
    assert run_async(_Raises(ConnectionClosedForGood("router: closed"))) == 1
    assert [r.getMessage() for r in caplog.records if r.name == "kvmesh"] == ["router: closed"]

    class _Fine(_Raises):
        async def run(self) -> None:
            return None

    assert run_async(_Fine(ValueError())) == 0


async def test_a_loop_that_swallows_its_cancellation_is_left_behind_after_the_grace(
    nats_url: str, caplog: pytest.LogCaptureFixture
) -> None:
    """On stop, a loop that ignores cancellation gets stop_grace_s, is logged by name, and supervise returns."""
    nc = await nats.connect(nats_url)
    stop = asyncio.Event()
    release = asyncio.Event()

    async def stubborn() -> None:
        while not release.is_set():
            try:
                await asyncio.sleep(3600)
            except asyncio.CancelledError:
                continue  # what a swallowed cancellation looks like

    async def stopper() -> None:
        stop.set()

    stubborn_task = asyncio.ensure_future(stubborn())
    try:
        await asyncio.wait_for(
            supervise(
                nc, {"stubborn": stubborn_task, "stopper": stopper()}, stop=stop, name="t", stop_grace_s=0.2
            ),
            5,
        )
        assert not stubborn_task.done()
        assert "t: stubborn did not stop within 0.2 s; left behind" in caplog.text
    finally:
        release.set()
        stubborn_task.cancel()
        await asyncio.wait({stubborn_task}, timeout=1)
        await nc.close()


@pytest.mark.parametrize("service", ["ingest", "indexer", "router"])
def test_every_service_reports_the_one_version(service: str, capsys: pytest.CaptureFixture[str]) -> None:
    """`kvmesh <service> --version` prints the kvmesh version (from package metadata) and exits 0."""
    from kvmesh.cli import main
    from kvmesh.runtime.runner import VERSION

    with pytest.raises(SystemExit) as info:
        main([service, "--version"])
    assert info.value.code == 0
    assert capsys.readouterr().out == f"kvmesh {service} {VERSION}\n"
