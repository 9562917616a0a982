"""SGLang's router ``cache_aware`` policy, over token ids.

Source
------
SGLang's Rust router (``sgl-router/``, renamed ``sgl-model-gateway/`` and released as "smg"
from sgl-project/sglang) moved with its history to ``lightseekorg/smg``, whose current release
is v1.9.0 (2026-07-29); ``sgl-router/`` in sgl-project/sglang now holds a different router
(PyPI ``sgl-router``, 2026), not modelled here. The citations below are to that release,
``SMG = lightseekorg/smg@106ffacd6228a67920a5db58628f61751c7c49e2`` (tag v1.9.0):
``CA = model_gateway/src/policies/cache_aware.rs``, ``ST = crates/kv_index/src/string_tree.rs``,
``TT = crates/kv_index/src/token_tree.rs``. The rules the policy uses were last changed in
2025-12 in sgl-project/sglang: PR #14650 (shown here as ``lightseekorg/smg@6fe82758a70402c8``
``src/policies/cache_aware.rs:311-317``: before it, a miss went to
``tree.get_smallest_tenant()``, the rule the docstrings still describe). smg PR #1714
(``lightseekorg/smg@823cbbf984599d18``) added the ``processed`` tie-break.

Defaults are the router binary's (SMG ``model_gateway/src/main.rs:191-222``):
``cache_threshold`` 0.3, ``balance_abs_threshold`` 64, ``balance_rel_threshold`` 1.5,
``eviction_interval`` 120 s, ``max_tree_size`` 2**26. The Python launcher has the same values
but an eviction interval of 60 s (SMG ``bindings/python/src/smg/router_args.py:59-65``).
Other defaults apply to a model whose workers register with a ``cache_aware`` policy hint:
that policy is built with ``CacheAwareConfig::default()`` (SMG
``model_gateway/src/policies/registry.rs:293-296, 305-307``, ``mod.rs:133-148``: 0.5, 32, 1.1,
30 s, 10000); the router's default policy gets the command-line values. slime
sets abs 10, rel 1.2 (``THUDM/slime@624b824a898ab0ec1fcb4d373004c7f3852bf515``
``slime/backends/sglang_utils/arguments.py:46``) and posts ``input_ids`` to the router's
``/generate`` (``slime/rollout/sglang_rollout.py:158, 191``).

The rules, per ``choose()`` (the router's ``select_worker``)
-----------------------------------------------------------
1. **Load** is the router's own in-flight count per worker: ``WorkerLoadGuard::new`` increments
   it when the request is sent to the worker the policy chose, and its ``Drop`` decrements it
   when the response ends (SMG ``model_gateway/src/worker/worker.rs:1336-1360``; created only
   for ``cache_aware`` and ``manual``: SMG ``model_gateway/src/routers/http/router.rs:382-384``).
   The engines do not report it. Here: ``EngineState.running + waiting``. In the simulator a
   dispatched turn enters ``waiting`` at once and leaves ``running`` when it finishes, and in
   :class:`~war_openrlhf.rollout.pool.RolloutPool` ``in_flight`` is incremented just after
   ``choose()`` returns and decremented when the turn returns; so the snapshot is the router's
   counter, not a stale engine report.
2. **Imbalance** (CA:283-307, called at CA:814-816): over the healthy workers,
   ``max - min > balance_abs_threshold`` AND ``max > min * balance_rel_threshold``, both strict,
   in f32. (smg also has two KV-usage triggers, disabled by default: CA:290-302; not modelled.)
   If imbalanced: the min-load worker, and the request is still inserted into the tree under
   it (CA:472-563).
3. **Min-load worker**, used when imbalanced and on a miss: the smallest ``(load, processed,
   index)`` over healthy workers (CA:778-800), where ``processed`` counts the requests the
   policy sent to the worker (``increment_processed`` at CA:558 and CA:1139).
4. **Balanced**: one walk of the shared radix tree (CA:1095-1117 over ST:707-816). The walk
   goes as deep as the request matches any node of the tree, whichever tenants hold it;
   ``match_rate = matched / len(request)``. The tenant is taken from the deepest node reached
   (the last fully matched node, or the partially matched child): its ``last_tenant`` if that
   tenant still holds the node, else the first tenant of its map (ST:674-689). ``last_tenant``
   is the tenant that created the node (ST:447), copied to both halves when a node is split
   (ST:487), and not changed by later inserts. So the matched tenant is the engine whose request
   first reached that node, whatever its load, and not the least-loaded of the engines that
   hold the match.
   * ``match_rate > cache_threshold`` (strict): that tenant, if healthy (CA:1102-1110); if it is
     not healthy, the first healthy worker is returned and nothing is inserted (CA:1143-1145).
   * otherwise (a miss): the min-load worker (CA:1111-1112). Not the smallest tree.
   The request is inserted under the chosen worker, in the same walk (ST:766-815).
5. **Tree**: one tree shared by the workers (tenants); per (node, tenant) a last-access time.
   An insert attaches the tenant to every node of the path, with time 0 when it was not there
   (ST:503-538), and gives the final node a new time (ST:561-565); the tenant's size grows by
   the length of each node it newly holds (ST:451-454, 509-512, 531-534).
6. **Eviction** (CA:148-180, ST:952-1056): every ``eviction_interval`` s a background task
   removes, for each tenant over ``max_tree_size``, its least-recently-used leaves (nodes it
   holds that no child of which it holds) until it is within the size, dropping nodes no
   tenant holds; a parent becomes a leaf candidate when its last child of that tenant goes.
7. **Weight sync**: the router's ``/flush_cache`` only fans out to the workers (SMG
   ``model_gateway/src/server.rs:521-525``, ``model_gateway/src/worker/manager.rs:776-802``);
   the trees stay. So :meth:`on_prefix_cache_reset` keeps the tree, and the next step's
   requests are matched against what earlier steps inserted.

Deviations
----------
* **Alphabet.** Over HTTP the router matches characters of the routing text; for ``/generate``
  with ``input_ids`` (how RL frameworks call it) that text is the ids in decimal joined by
  spaces (SMG ``crates/protocols/src/generate.rs:214-237``), so its match rate is a character
  share. Here the alphabet is the token id: the dispatcher sees token ids, and the rate is a
  token share (a token's digits are not matched one by one). ``page_size > 1`` models smg's
  gRPC token tree instead (TT:1-13, 77-82: only whole pages of 16 tokens are inserted and
  matched; the rate is ``aligned matched tokens / all tokens``, TT:1043-1062, CA:1013-1017);
  its tenant choice is still the string tree's creator rule, where TT picks a tenant through a
  probabilistically refreshed cache (TT:253-299), and its size counts tokens once per tenant,
  where TT re-counts the full-matched prefix on every insert (TT:476-483, 604, 1186-1189).
* **Eviction time.** The policy has no clock: eviction runs right after an insert that takes the
  tenant over ``max_tree_size`` (the router waits for its next 120 s cycle, so its tree can
  overshoot). Matches do not refresh access times (the router refreshes the matched tenant's
  time on 1 match in 8, ST:638-646). With the default 2**26 tokens per engine eviction
  rarely happens in a rollout step.
* **First tenant of a node's map.** Where the router takes the first entry of a DashMap (an
  arbitrary, hash-dependent order), this takes the lowest engine id.
* **Health.** Unhealthy engines stand for the router's unhealthy or circuit-broken workers:
  left out of the loads, never returned.

Why it loses to ``least_loaded`` on multi-turn agentic GRPO steps
-----------------------------------------------------------------
All trajectories of a step start together and every first turn begins with the same system
prompt (instructions, tool schemas). The first request creates the node of that prompt, so the
node's ``last_tenant`` is that request's engine (rule 4), and the split that later makes the
system prompt a node of its own keeps it. Every first turn of another group matches the system
prompt; when the prompt is more than 30% of the first turn's tokens, that is a hit on that one
engine, whatever its load, and the group's other samples follow (they match their group's node
there). Only when that engine is more than 64 in-flight requests above the least-loaded one does
the imbalance switch send a request elsewhere (rule 2; with the others idle ``max > 1.5 * min``
holds at once), and the next hit goes back to it: the engine of the first request keeps about
64 trajectories more than the others for the whole step. A later turn reaches its group's node
(or its own earlier leaf) and goes to that node's creator while the spread is <= 64, so the
trajectories stay where they began; a sample the switch sent away from its group's engine goes
back there at its next turn if the spread allows. OpenRLHF's placement (``least_loaded``) and
verl's (``sticky``) spread the first turns evenly.

Checked (not assumed): ``test_sglang_agentic_first_turns_pile_on_the_system_prompt_engine``
(4 engines, 32 groups x 8 first turns, 2000-token system prompt: ``[112, 48, 48, 48]`` =
64 + 192/4 on engine 0; a 50-token system prompt, under 30%: ``[64, 64, 64, 64]``), and the
simulator (``simulation.cluster``, preset h100_qwen7b, tau-bench airline traces as
``tools/bench_dispatch.py --load high --pressure 2`` builds them: their first turns share 1273
tokens, 96-99% of each first turn). 4 engines, 128 trajectories: first turns per engine
``[80, 16, 16, 16]``, makespan 105.1 s vs 55.4 s for ``least_loaded`` (0.53x), prefix hit 0.70
vs 0.92, busy seconds ``[102, 32, 27, 30]``; the same policy with ``balance_abs_threshold=8``:
``[43, 28, 28, 29]``, 52.0 s. 8 engines, 256 trajectories: ``[74, 17, 17, 17, 81, 17, 17, 16]``
(a second hot engine created the node that the benchmark's replicated groups share: the system
prompt plus the replica's salt token), 117.3 s vs 52.0 s (0.44x); with abs 8: 52.0 s. The
loss is the placement of first turns under the abs threshold, not the cache rule.
"""

from __future__ import annotations

import heapq
from dataclasses import dataclass, field
from typing import Dict, List, Optional, Sequence, Tuple

import numpy as np

from .base import DispatchPolicy, EngineState, PolicyOptions, TurnRequest

_FNV_OFFSET = np.uint64(0xCBF29CE484222325)
_FNV_PRIME = np.uint64(0x100000001B3)


def _common_prefix_len(a: np.ndarray, b: np.ndarray) -> int:
    n = min(len(a), len(b))
    if n == 0:
        return 0
    if n <= 8:  # short keys: a python loop beats numpy's fixed overhead
        for i in range(n):
            if a[i] != b[i]:
                return i
        return n
    neq = np.flatnonzero(a[:n] != b[:n])
    return int(neq[0]) if len(neq) else n


def page_symbols(tokens: np.ndarray, page_size: int) -> np.ndarray:
    """The tree's alphabet for ``tokens``: the tokens themselves for ``page_size`` 1, else one
    64-bit hash per whole page (the tail shorter than a page is dropped, as smg's token tree
    does)."""
    tokens = np.asarray(tokens)
    if page_size == 1:
        return tokens
    n = len(tokens) // page_size
    pages = tokens[:n * page_size].astype(np.uint32).astype(np.uint64).reshape(n, page_size)
    h = np.full(n, _FNV_OFFSET, dtype=np.uint64)
    for j in range(page_size):  # FNV-1a over the page's token ids (wraps mod 2**64)
        h ^= pages[:, j]
        h *= _FNV_PRIME
    return h.view(np.int64)


class _Node:
    __slots__ = ("key", "children", "parent", "tenants", "last_tenant")

    def __init__(self, key: np.ndarray, parent: Optional["_Node"],
                 last_tenant: Optional[int] = None) -> None:
        self.key = key
        self.children: Dict[int, _Node] = {}
        self.parent = parent
        self.tenants: Dict[int, int] = {}  # engine id -> last access tick (0: attached in passing)
        self.last_tenant = last_tenant     # the tenant that created the node (ST:447, 487)


class ApproxRadixTree:
    """SGLang's approximate radix tree, shared by all engines (tenants), over symbols (token ids,
    or page hashes). Sizes are in symbols; the policy multiplies by its page size."""

    def __init__(self) -> None:
        self.root = _Node(np.zeros(0, dtype=np.int64), None)
        self.tenant_size: Dict[int, int] = {}  # symbols held per engine
        self._tick = 0

    # -- match ---------------------------------------------------------------------------
    def match(self, symbols: np.ndarray) -> Tuple[int, Optional[int]]:
        """(matched symbols, tenant) as the router's walk resolves them: the walk follows the
        tree as far as ``symbols`` match, whoever holds the nodes, and the tenant is the
        ``last_tenant`` of the deepest node reached (or its lowest holder if that one left);
        ``None`` when nothing matched."""
        node, last, pos, n = self.root, self.root, 0, len(symbols)
        while pos < n:
            child = node.children.get(int(symbols[pos]))
            if child is None:
                break
            m = _common_prefix_len(child.key, symbols[pos:pos + len(child.key)])
            pos += m
            last = child
            if m < len(child.key):
                break
            node = child
        if pos == 0:
            return 0, None
        return pos, self._resolve(last)

    @staticmethod
    def _resolve(node: _Node) -> Optional[int]:
        t = node.last_tenant
        if t is not None and t in node.tenants:
            return t
        if not node.tenants:
            return None
        t = min(node.tenants)  # the router: first entry of a DashMap (arbitrary order)
        node.last_tenant = t
        return t

    def held_prefix(self, symbols: np.ndarray, tenant: int) -> int:
        """Symbols of the longest prefix of ``symbols`` on nodes ``tenant`` holds."""
        node, pos, n = self.root, 0, len(symbols)
        while pos < n:
            child = node.children.get(int(symbols[pos]))
            if child is None or tenant not in child.tenants:
                break
            m = _common_prefix_len(child.key, symbols[pos:pos + len(child.key)])
            pos += m
            if m < len(child.key):
                break
            node = child
        return pos

    # -- insert --------------------------------------------------------------------------
    def insert(self, symbols: np.ndarray, tenant: int) -> None:
        """ST:393-566: attach ``tenant`` along the path, split at divergence, new leaf for the
        rest; the final node gets a new access time, nodes attached in passing time 0."""
        self.root.tenants.setdefault(tenant, 0)
        self.tenant_size.setdefault(tenant, 0)
        if len(symbols) == 0:
            return
        self._tick += 1
        node, pos, n = self.root, 0, len(symbols)
        while pos < n:
            first = int(symbols[pos])
            child = node.children.get(first)
            if child is None:
                leaf = _Node(symbols[pos:].copy(), node, last_tenant=tenant)
                leaf.tenants[tenant] = self._tick
                node.children[first] = leaf
                self.tenant_size[tenant] += n - pos
                return
            m = _common_prefix_len(child.key, symbols[pos:pos + len(child.key)])
            if m < len(child.key):  # split child at m; both halves keep its last_tenant
                mid = _Node(child.key[:m].copy(), node, last_tenant=child.last_tenant)
                mid.tenants = dict(child.tenants)
                child.key = child.key[m:].copy()
                child.parent = mid
                mid.children[int(child.key[0])] = child
                node.children[first] = mid
                child = mid
            if tenant not in child.tenants:
                self.tenant_size[tenant] += len(child.key)
                child.tenants[tenant] = 0
            pos += len(child.key)
            node = child
        node.tenants[tenant] = self._tick  # the path ended on an existing node

    # -- eviction ------------------------------------------------------------------------
    def evict_tenant(self, tenant: int, max_size: int) -> None:
        """ST:952-1056 for one tenant: remove its least-recently-used leaves until it holds
        <= ``max_size`` symbols."""
        if self.tenant_size.get(tenant, 0) <= max_size:
            return
        heap: List[Tuple[int, int, _Node]] = []
        seq = 0
        stack = [self.root]
        while stack:
            node = stack.pop()
            has_child_with_tenant = False
            for c in node.children.values():
                stack.append(c)
                if tenant in c.tenants:
                    has_child_with_tenant = True
            if node is not self.root and not has_child_with_tenant and tenant in node.tenants:
                heap.append((node.tenants[tenant], seq, node))
                seq += 1
        heapq.heapify(heap)
        while heap and self.tenant_size[tenant] > max_size:
            _, _, node = heapq.heappop(heap)
            if tenant not in node.tenants or any(tenant in c.tenants for c in node.children.values()):
                continue
            del node.tenants[tenant]
            self.tenant_size[tenant] -= len(node.key)
            parent = node.parent
            if not node.tenants and not node.children:
                del parent.children[int(node.key[0])]
            if (parent is not self.root and tenant in parent.tenants
                    and not any(tenant in c.tenants for c in parent.children.values())):
                seq += 1
                heapq.heappush(heap, (parent.tenants[tenant], seq, parent))

    def size_of(self, tenant: int) -> int:
        return self.tenant_size.get(tenant, 0)


@dataclass(frozen=True)
class SGLangCacheAwareOptions(PolicyOptions):
    """Options of ``sglang_cache_aware`` (the router's own names and defaults)."""

    cache_threshold: float = field(default=0.3, metadata={
        "help": "least prefix-match rate that routes to the matching engine, in [0, 1]"})
    balance_abs_threshold: int = field(default=64, metadata={
        "help": "load gap (requests) above which the router balances instead of matching"})
    balance_rel_threshold: float = field(default=1.5, metadata={
        "help": "load ratio above which the router balances instead of matching"})
    max_tree_size: int = field(default=2 ** 26, metadata={"help": "tree symbols kept per engine"})
    page_size: int = field(default=1, metadata={"help": "tokens per tree symbol (1: token ids)"})

    def __post_init__(self) -> None:
        if not 0.0 <= self.cache_threshold <= 1.0:
            raise ValueError(f"cache_threshold must be in [0, 1], got {self.cache_threshold}")
        if self.balance_abs_threshold < 0 or self.balance_rel_threshold < 0:
            raise ValueError("balance thresholds must be >= 0, got "
                             f"abs={self.balance_abs_threshold} rel={self.balance_rel_threshold}")
        if self.max_tree_size <= 0:
            raise ValueError(f"max_tree_size must be positive, got {self.max_tree_size}")
        if not isinstance(self.page_size, (int, np.integer)) or self.page_size < 1:
            raise ValueError(f"page_size must be a positive int, got {self.page_size!r}")


class SGLangCacheAwarePolicy(DispatchPolicy):
    name = "sglang_cache_aware"
    Options = SGLangCacheAwareOptions

    def __init__(self, num_engines: int, cache_threshold: float = 0.3,
                 balance_abs_threshold: int = 64, balance_rel_threshold: float = 1.5,
                 max_tree_size: int = 2 ** 26, page_size: int = 1) -> None:
        super().__init__(num_engines)
        SGLangCacheAwareOptions(cache_threshold, balance_abs_threshold, balance_rel_threshold, max_tree_size,
                                page_size)  # the checks
        self.cache_threshold = float(cache_threshold)
        self.balance_abs_threshold = int(balance_abs_threshold)
        self.balance_rel_threshold = float(balance_rel_threshold)
        self.max_tree_size = int(max_tree_size)
        self.page_size = int(page_size)
        self._threshold32 = np.float32(self.cache_threshold)
        self._rel32 = np.float32(self.balance_rel_threshold)
        self.tree = ApproxRadixTree()
        self.processed = [0] * self.num_engines  # requests sent per engine (the tie-break)
        # "shortest_queue" | "cache_match" | "min_load" | "first_healthy"
        self.last_decision: str = ""
        self.last_match_rate: float = 0.0

    def size_of(self, engine_id: int) -> int:
        """Tokens of the tree held by ``engine_id``."""
        return self.tree.size_of(engine_id) * self.page_size

    def on_prefix_cache_reset(self) -> None:
        """The engines' caches were flushed; the router's tree is not (rule 7): nothing to do."""

    def _insert(self, symbols: np.ndarray, eid: int) -> None:
        self.tree.insert(symbols, eid)
        limit = self.max_tree_size // self.page_size
        if self.tree.size_of(eid) > limit:
            self.tree.evict_tenant(eid, limit)

    def choose(self, request: TurnRequest, engines: Sequence[EngineState]) -> int:
        healthy = self._healthy(engines)
        loads = {e.engine_id: e.load for e in healthy}
        processed = self.processed
        min_eid = min(loads, key=lambda i: (loads[i], processed[i], i))
        max_load, min_load = max(loads.values()), loads[min_eid]
        # f32 arithmetic as in the router (CA:305-306).
        imbalanced = (max_load - min_load > self.balance_abs_threshold
                      and np.float32(max_load) > np.float32(min_load) * self._rel32)
        symbols = page_symbols(request.context_token_ids, self.page_size)
        if imbalanced:
            eid = min_eid
            self.last_decision = "shortest_queue"
        else:
            matched, tenant = self.tree.match(symbols)
            n = len(request.context_token_ids)
            rate = np.float32(matched * self.page_size) / np.float32(n) if n else np.float32(0.0)
            self.last_match_rate = float(rate)
            if rate > self._threshold32:  # f32, strict (CA:1096-1102)
                if tenant in loads:
                    eid = tenant
                    self.last_decision = "cache_match"
                else:  # the matched engine is not healthy: first healthy, no insert
                    self.last_decision = "first_healthy"
                    return min(loads)
            else:
                eid = min_eid
                self.last_decision = "min_load"
        self._insert(symbols, eid)
        processed[eid] += 1
        return eid
