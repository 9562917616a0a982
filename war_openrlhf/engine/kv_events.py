"""vLLM's KV-cache events, read where the engine runs.

vLLM publishes what its prefix cache stores and evicts (``BlockStored`` / ``BlockRemoved`` /
``AllBlocksCleared``, ``vllm/distributed/kv_events.py``) on a ZMQ PUB socket when
``kv_events_config`` enables it: the feed NVIDIA Dynamo's KV router and llm-d's scheduler
subscribe to. With ``EngineConfig.kv_events`` on, each WAR engine binds that socket to a
private ``ipc://`` endpoint and reads it on a thread (:class:`KvEventSubscriber`); the pool
polls the events since its last call (``WarEngine.kv_events``) every ``log_sync_interval_s``
and its dispatcher turns them into its own block hashes
(:class:`war_openrlhf.dispatch.kv_events.KvEventTranslator`) to correct its model of the cache.

On the wire an event is a plain tuple: ``("stored", block_hashes, parent_block_hash,
token_ids, block_size)``, ``("removed", block_hashes)`` or ``("cleared",)``; blocks of another
medium than the engine's KV cache (a CPU offload tier) are left out here.
"""

from __future__ import annotations

import logging
import threading
import uuid
from typing import Any, Iterable

log = logging.getLogger(__name__)

__all__ = ["KvEventSubscriber", "kv_events_endpoint", "events_to_wire"]


def kv_events_endpoint() -> str:
    """A private endpoint for one engine's publisher (vLLM binds ``ipc://`` endpoints)."""
    return f"ipc:///tmp/war-kv-events-{uuid.uuid4().hex[:16]}"


def events_to_wire(events: Iterable[Any]) -> list[tuple]:
    """vLLM's event objects as the wire tuples above (in order)."""
    out: list[tuple] = []
    for ev in events:
        if getattr(ev, "medium", None) not in (None, "GPU"):
            continue
        kind = type(ev).__name__
        if kind == "BlockStored":
            out.append(("stored", list(ev.block_hashes), ev.parent_block_hash, list(ev.token_ids), int(ev.block_size)))
        elif kind == "BlockRemoved":
            out.append(("removed", list(ev.block_hashes)))
        elif kind == "AllBlocksCleared":
            out.append(("cleared",))
    return out


class KvEventSubscriber:
    """Reads one engine's KV-event socket on a daemon thread; :meth:`drain` returns the events
    since the last call (wire tuples, in order). Gaps in vLLM's sequence numbers (the PUB
    socket's high-water mark dropped batches) are counted in ``missed_batches``."""

    def __init__(self, endpoint: str, topic: str = "") -> None:
        self.endpoint = endpoint
        self.topic = topic
        self.events = 0
        self.missed_batches = 0
        self.errors = 0
        self._pending: list[tuple] = []
        self._lock = threading.Lock()
        self._stop = threading.Event()
        self._ready = threading.Event()
        self._thread = threading.Thread(target=self._run, daemon=True, name="war-kv-events")

    def start(self, timeout_s: float = 10.0) -> "KvEventSubscriber":
        self._thread.start()
        if not self._ready.wait(timeout_s):
            raise RuntimeError(f"KV events: no subscriber socket on {self.endpoint} within {timeout_s:g} s")
        return self

    def _run(self) -> None:
        import msgspec
        import zmq
        from vllm.distributed.kv_events import KVEventBatch

        decoder = msgspec.msgpack.Decoder(type=KVEventBatch)
        sock = zmq.Context.instance().socket(zmq.SUB)
        sock.setsockopt(zmq.RCVHWM, 0)
        sock.connect(self.endpoint)
        sock.setsockopt_string(zmq.SUBSCRIBE, self.topic)
        self._ready.set()
        last_seq = -1
        try:
            while not self._stop.is_set():
                if not sock.poll(100):
                    continue
                _topic, seq_bytes, payload = sock.recv_multipart()
                seq = int.from_bytes(seq_bytes, "big", signed=True)
                if last_seq >= 0 and seq > last_seq + 1:
                    self.missed_batches += seq - last_seq - 1
                last_seq = seq
                try:
                    wire = events_to_wire(decoder.decode(payload).events)
                except Exception:  # noqa: BLE001 - one bad batch: counted, the feed goes on
                    self.errors += 1
                    log.exception("KV events: a batch could not be read")
                    continue
                if wire:
                    with self._lock:
                        self._pending.extend(wire)
                        self.events += len(wire)
        finally:
            sock.close(linger=0)

    def drain(self) -> list[tuple]:
        with self._lock:
            out, self._pending = self._pending, []
        return out

    def reset(self) -> None:
        """The engine's prefix cache was just emptied: drop the queued events, queue ``cleared``."""
        with self._lock:
            self._pending = [("cleared",)]

    def stats(self) -> dict[str, int]:
        return {"events": self.events, "missed_batches": self.missed_batches, "errors": self.errors}

    def stop(self) -> None:
        """Stop reading and remove the ``ipc://`` socket file (vLLM's publisher leaves it)."""
        self._stop.set()
        if self.endpoint.startswith("ipc://"):
            import os

            try:
                os.unlink(self.endpoint[len("ipc://"):])
            except OSError:
                pass
