"""A snapshot whose upload fails is retried without waiting for another interval's worth of messages."""

from __future__ import annotations

from typing import Any

import pytest
from tests.indexers import group, wait_for

pytestmark = [pytest.mark.anyio, pytest.mark.nats]


async def test_a_failed_snapshot_upload_is_retried_for_the_same_messages(nats_url: str, uid: str) -> None:
    """The first upload fails (as when the bucket is electing a leader); with no further message, the snapshot
    loop writes the snapshot on its next pass, covering all 120 messages."""
    async with group(nats_url, uid) as g:
        svc = await g.start(f"{uid}-a", snapshot_every_messages=100)
        assert svc._store is not None
        real = svc._store.put
        calls: list[int] = []

        async def flaky_put(seq: int, data: bytes, **kw: Any) -> Any:
            calls.append(seq)
            if len(calls) == 1:
                raise TimeoutError("bucket electing a leader")
            return await real(seq, data, **kw)

        svc._store.put = flaky_put  # type: ignore[method-assign,assignment]
        await g.publish(120)

        async def last() -> int:
            snap = svc.snapshots["last"]
            return int(snap["applied_seq"]) if snap else 0

        assert await wait_for(last, lambda s: s == 120, timeout_s=20) == 120
        assert len(calls) == 2 and calls[1] == 120
        assert svc.snapshots["written"] == 1
