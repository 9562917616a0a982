"""vLLM's KV-cache events, read where the engine runs and turned into the dispatcher's block hashes.

vLLM publishes what its prefix cache stores and evicts (``BlockStored`` / ``BlockRemoved`` /
``AllBlocksCleared``, ``vllm/distributed/kv_events.py``) on a ZMQ PUB socket when
``kv_events_config`` enables it: the feed NVIDIA Dynamo's KV router and llm-d's scheduler
subscribe to. With ``EngineConfig.kv_events`` on, each WAR engine binds that socket to a
private ``ipc://`` endpoint, reads it on a thread (:class:`KvEventSubscriber`), and hands out
the events since the last call (``WarEngine.kv_events``), which the pool polls every
``log_sync_interval_s`` and passes to the dispatcher
(``DispatchPolicy.on_kv_events``), which then corrects its block-hash model of the engine's
cache with what the engine really holds instead of guessing evictions from an LRU bound.

vLLM's block hashes (SHA-256 over the parent hash, the tokens and extra keys) are not the
dispatcher's; ``BlockStored`` carries the stored blocks' token ids and the parent block's hash,
so :class:`KvEventTranslator` re-hashes the tokens into the dispatcher's 16-token chain
(:func:`~war_openrlhf.dispatch.block_index.chain_hashes`), continuing from the parent's chain.
A block whose parent it never saw stored (events lost, or stored before the subscriber
connected) is counted in ``unresolved`` and skipped: the model keeps its own guess there.
"""

from __future__ import annotations

import logging
import threading
import uuid
from typing import Any, Iterable

from ..dispatch.block_index import BLOCK_SIZE, ROOT_HASH, chain_hashes

log = logging.getLogger(__name__)

__all__ = ["KvEventTranslator", "KvEventSubscriber", "kv_events_endpoint"]

STORED, REMOVED, CLEARED = "stored", "removed", "cleared"


def kv_events_endpoint() -> str:
    """A private endpoint for one engine's publisher (vLLM binds ``ipc://`` endpoints)."""
    return f"ipc:///tmp/war-kv-events-{uuid.uuid4().hex[:16]}"


class KvEventTranslator:
    """vLLM KV-cache events -> ``(kind, dispatcher block hashes)`` deltas for one engine.

    ``stored``: the chain of 16-token block hashes of the stored blocks, root first (a
    continuation of their parent's chain); ``removed``: the hashes of evicted blocks;
    ``cleared``: the engine's prefix cache was emptied. Blocks not of the main KV medium (a CPU
    offload tier) are ignored."""

    def __init__(self) -> None:
        self._fine: dict[Any, tuple[int, ...]] = {}  # vLLM block hash -> its 16-token hashes
        self.unresolved = 0  # stored blocks whose parent was never seen (skipped)
        self.events = 0

    def __len__(self) -> int:
        return len(self._fine)

    def translate(self, events: Iterable[Any]) -> list[tuple[str, list[int]]]:
        out: list[tuple[str, list[int]]] = []
        for ev in events:
            self.events += 1
            kind = type(ev).__name__
            if getattr(ev, "medium", None) not in (None, "GPU"):
                continue
            if kind == "BlockStored":
                delta = self._stored(ev)
                if delta:
                    out.append((STORED, delta))
            elif kind == "BlockRemoved":
                gone: list[int] = []
                for h in ev.block_hashes:
                    gone.extend(self._fine.pop(h, ()))
                if gone:
                    out.append((REMOVED, gone))
            elif kind == "AllBlocksCleared":
                self._fine.clear()
                out.append((CLEARED, []))
        return out

    def _stored(self, ev: Any) -> list[int]:
        bs = int(ev.block_size)
        if bs % BLOCK_SIZE:
            raise ValueError(f"KV events: vLLM block size {bs} is not a multiple of {BLOCK_SIZE}")
        parent = ROOT_HASH
        if ev.parent_block_hash is not None:
            prev = self._fine.get(ev.parent_block_hash)
            if not prev:
                self.unresolved += len(ev.block_hashes)
                return []
            parent = prev[-1]
        tokens = list(ev.token_ids)
        n = min(len(ev.block_hashes), len(tokens) // bs)
        fine = chain_hashes(_as_array(tokens[:n * bs]), parent)
        per = bs // BLOCK_SIZE
        for i in range(n):
            self._fine[ev.block_hashes[i]] = tuple(fine[i * per:(i + 1) * per])
        return fine


def _as_array(tokens: list[int]):
    import numpy as np

    return np.asarray(tokens, dtype=np.int32)


class KvEventSubscriber:
    """Reads one engine's KV-event socket on a daemon thread; :meth:`drain` returns the
    translated deltas since the last call (in order). Gaps in vLLM's sequence numbers (the
    PUB socket's high-water mark dropped batches) are counted in ``missed_batches``."""

    def __init__(self, endpoint: str, topic: str = "") -> None:
        self.endpoint = endpoint
        self.topic = topic
        self.translator = KvEventTranslator()
        self.missed_batches = 0
        self.errors = 0
        self._pending: list[tuple[str, list[int]]] = []
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
        ctx = zmq.Context.instance()
        sock = ctx.socket(zmq.SUB)
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
                    deltas = self.translator.translate(decoder.decode(payload).events)
                except Exception:  # noqa: BLE001 - one bad batch: counted, the feed goes on
                    self.errors += 1
                    log.exception("KV events: a batch could not be read")
                    continue
                if deltas:
                    with self._lock:
                        self._pending.extend(deltas)
        finally:
            sock.close(linger=0)

    def drain(self) -> list[tuple[str, list[int]]]:
        with self._lock:
            out, self._pending = self._pending, []
        return out

    def stats(self) -> dict[str, int]:
        t = self.translator
        return {"blocks": len(t), "events": t.events, "unresolved": t.unresolved,
                "missed_batches": self.missed_batches, "errors": self.errors}

    def stop(self) -> None:
        """Stop reading and remove the ``ipc://`` socket file (vLLM's publisher leaves it)."""
        self._stop.set()
        if self.endpoint.startswith("ipc://"):
            import os

            try:
                os.unlink(self.endpoint[len("ipc://"):])
            except OSError:
                pass
