"""Publish KV-cache events from an engine that does not speak vLLM's ZMQ protocol.

Two publishers with one API (`stored`, `removed`, `cleared`; block hashes as ints, token ids, the parent
block hash, the medium, the LoRA name, the data-parallel rank), like Dynamo's
``KvEventPublisher.publish_stored`` / ``publish_removed``:

* `JetStreamPublisher` (`open_jetstream`): straight to the events stream, with an ingest's guarantees (a
  new epoch per start, ``Nats-Msg-Id`` on every message, acks taken in order, a bounded outbox whose
  overflow clears the rank instead of leaving the index wrong) through the ingest's own publishing code;
* `ZmqPublisher`: vLLM-format PUB and replay ROUTER sockets, so ``kvmesh ingest`` attaches to it unchanged.

`TrtllmEvents` feeds either from TensorRT-LLM's polled ``LLM.get_kv_cache_events()`` dicts.

```python
pub = await kvmesh.publish.open_jetstream(worker_id="w0", model="my-model", block_size=16,
                                          nats_url="nats://nats:4222")
pub.stored([h0, h1], tokens[:32])                        # blocks 0 and 1 of a prompt
pub.stored([h2], tokens[32:48], parent_block_hash=h1)    # block 2, chained on block 1
pub.removed([h0])
await pub.aclose()
```
"""

from __future__ import annotations

from kvmesh.publish._events import PublishError
from kvmesh.publish._jetstream import JetStreamPublisher, open_jetstream
from kvmesh.publish._trtllm import TrtllmEvents, TrtllmEventStats
from kvmesh.publish._zmq import ZmqPublisher

__all__ = [
    "JetStreamPublisher",
    "PublishError",
    "TrtllmEventStats",
    "TrtllmEvents",
    "ZmqPublisher",
    "open_jetstream",
]
