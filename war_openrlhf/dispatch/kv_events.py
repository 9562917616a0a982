"""An engine's KV-cache events (:mod:`war_openrlhf.engine.kv_events` wire tuples) as the
dispatcher's block hashes.

vLLM's block hashes (SHA-256 over the parent hash, the tokens and extra keys) are not the
dispatcher's; a ``stored`` event carries the stored blocks' token ids and the parent block's
hash, so :class:`KvEventTranslator` re-hashes the tokens into the dispatcher's 16-token chain
(:func:`~war_openrlhf.dispatch.block_index.chain_hashes`), continuing from the parent's chain.
A block whose parent it never saw stored (events lost, or stored before it subscribed) is
counted in ``unresolved`` and skipped: the model keeps its own guess there. The deltas it
returns feed :meth:`~war_openrlhf.dispatch.block_index.BlockHashIndex.apply_kv_events`.
"""

from __future__ import annotations

from typing import Any, Iterable

import numpy as np

from .block_index import BLOCK_SIZE, ROOT_HASH, chain_hashes

__all__ = ["KvEventTranslator"]


class KvEventTranslator:
    """One engine's events -> ``(kind, block hashes)`` deltas: ``stored`` (the chain of the
    stored blocks' 16-token hashes, root first, continuing their parent's), ``removed`` (the
    evicted blocks' hashes), ``cleared`` (the engine's prefix cache was emptied)."""

    def __init__(self) -> None:
        self._fine: dict[Any, tuple[int, ...]] = {}  # vLLM block hash -> its 16-token hashes
        self.unresolved = 0  # stored blocks whose parent was never seen (skipped)

    def __len__(self) -> int:
        return len(self._fine)

    def translate(self, events: Iterable[tuple]) -> list[tuple[str, list[int]]]:
        out: list[tuple[str, list[int]]] = []
        for ev in events:
            kind = ev[0]
            if kind == "stored":
                delta = self._stored(*ev[1:])
                if delta:
                    out.append(("stored", delta))
            elif kind == "removed":
                gone: list[int] = []
                for h in ev[1]:
                    gone.extend(self._fine.pop(h, ()))
                if gone:
                    out.append(("removed", gone))
            elif kind == "cleared":
                self._fine.clear()
                out.append(("cleared", []))
            else:
                raise ValueError(f"KV event kind {kind!r}: expected stored, removed or cleared")
        return out

    def _stored(self, block_hashes: list, parent_hash: Any, token_ids: list[int], block_size: int) -> list[int]:
        bs = int(block_size)
        if bs % BLOCK_SIZE:
            raise ValueError(f"KV events: vLLM block size {bs} is not a multiple of {BLOCK_SIZE}")
        parent = ROOT_HASH
        if parent_hash is not None:
            prev = self._fine.get(parent_hash)
            if not prev:
                self.unresolved += len(block_hashes)
                return []
            parent = prev[-1]
        n = min(len(block_hashes), len(token_ids) // bs)
        fine = chain_hashes(np.asarray(token_ids[:n * bs], dtype=np.int32), parent)
        per = bs // BLOCK_SIZE
        for i in range(n):
            self._fine[block_hashes[i]] = tuple(fine[i * per:(i + 1) * per])
        return fine
