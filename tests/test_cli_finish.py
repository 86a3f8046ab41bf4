"""`kvmesh finish`: ends a request routed with a request id at every router (its load stops counting)."""

from __future__ import annotations

import asyncio
import json
import sys
from importlib.metadata import version
from pathlib import Path

import pytest
from tests.test_router import HOT, fleet, until

pytestmark = [pytest.mark.anyio, pytest.mark.nats]

KVMESH = str(Path(sys.executable).parent / "kvmesh")


async def run_kvmesh(*args: str) -> tuple[int, str, str]:
    """Run the installed `kvmesh ARGS`; return exit status, stdout and stderr."""
    proc = await asyncio.create_subprocess_exec(
        KVMESH, *args, stdout=asyncio.subprocess.PIPE, stderr=asyncio.subprocess.PIPE
    )
    out, err = await asyncio.wait_for(proc.communicate(), 60)
    assert proc.returncode is not None
    return proc.returncode, out.decode(), err.decode()


async def test_finish_ends_a_routed_request(nats_url: str, uid: str) -> None:
    """A request routed with an id counts at the router until `kvmesh finish --request-id` ends it."""
    async with fleet(nats_url, uid) as f:
        r0 = await f.start_router()
        await f.client(0).route("m", HOT, request_id="cli-1")
        await f.client(0).route("m", HOT, request_id="cli-2")
        assert r0.ledger.stats().active == 2
        code, out, err = await run_kvmesh(
            "finish", "--request-id", "cli-1", "--nats-url", nats_url, "--requests-prefix", f"t{uid}.requests"
        )
        assert (code, err) == (0, "")
        assert out.strip() == "finished cli-1"
        await until(lambda: r0.ledger.stats().active == 1)
        assert r0.ledger.stats().active == 1


async def test_finish_with_cached_tokens_is_delivered_at_the_router_that_answered(
    nats_url: str, uid: str
) -> None:
    """`kvmesh finish --cached-tokens N` reports the engine's count: the answering router's receipts count N
    delivered tokens for the chosen worker."""
    async with fleet(nats_url, uid) as f:
        r0 = await f.start_router()
        reply = await f.client(0).route("m", HOT, request_id="cli-3")
        code, out, err = await run_kvmesh(
            "finish", "--request-id", "cli-3", "--cached-tokens", "48", "--nats-url", nats_url,
            "--requests-prefix", f"t{uid}.requests",
        )  # fmt: skip
        assert (code, err, out.strip()) == (0, "", "finished cli-3")
        key = f"{reply.worker_id}/{reply.dp_rank}"
        await until(lambda: r0.ledger.stats().active == 0)
        receipts = r0.stats_message().receipts[key]
        assert (receipts.delivered_requests, receipts.delivered_tokens) == (1, 48)


async def test_finish_cached_tokens_needs_one_finished_request() -> None:
    code, _, err = await run_kvmesh(
        "finish", "--request-id", "a", "--request-id", "b", "--cached-tokens", "3"
    )
    assert code == 2
    assert "--cached-tokens goes with one --request-id, without --prefill-done, and is >= 0" in err


async def test_the_router_announces_the_package_version(nats_url: str, uid: str) -> None:
    """A running router's $SRV.INFO names the one package version, as `kvmesh --version` does."""
    async with fleet(nats_url, uid) as f:
        await f.start_router()
        msg = await f.nc.request("$SRV.INFO.kvmesh-router", b"", timeout=3)
        assert json.loads(msg.data)["version"] == version("kvmesh-shared")
