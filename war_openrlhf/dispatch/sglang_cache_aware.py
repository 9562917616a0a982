"""SGLang router's ``cache_aware`` policy (sgl-router ``src/policies/cache_aware.rs``).

Faithful to the router's rules, with one change of alphabet: SGLang's approximate radix tree is
over request TEXT (characters); here it is over token ids (the dispatcher sees token ids, and a
token-level prefix is what the engine's prefix cache reuses). Sizes and match rates are counted
in tokens where SGLang counts characters.

Per ``choose()``:

1. loads = ``running + waiting`` of the healthy engines. Imbalanced iff
   ``max_load - min_load > balance_abs_threshold`` AND ``max_load > balance_rel_threshold *
   min_load``. If imbalanced: shortest queue (min load; ties to the lower id), and the request
   is still inserted into the tree under the chosen engine.
2. Otherwise: walk the shared tree; ``match_rate = matched_tokens / request_tokens`` where
   matched_tokens is the longest prefix held by any healthy engine. If ``match_rate >
   cache_threshold``: the engine holding that longest match (ties: lower load, then lower id);
   else the engine with the smallest tree (tokens it owns; ties to the lower id). Insert the
   request under the chosen engine.

One shared tree with per-node engine tags and per-(node, engine) last-access times, as in
SGLang. Eviction: SGLang evicts in a background thread every 120 s; here it runs synchronously
after an insert that pushes an engine over ``max_tree_size`` tokens, removing that engine's
least-recently-used leaves until it fits (same LRU-of-leaves rule). The router never sees
responses: ``on_turn_finished`` is a no-op (the next turn's request contains the response).

Defaults are SGLang's: cache_threshold 0.3, balance_abs_threshold 64, balance_rel_threshold
1.5, max_tree_size 2**26 (slime overrides abs 10, rel 1.2).
"""

from __future__ import annotations

import heapq
from typing import Dict, List, Optional, Sequence, Tuple

import numpy as np

from .base import DispatchPolicy, EngineState, TurnRequest


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


class _Node:
    __slots__ = ("key", "children", "parent", "tenants")

    def __init__(self, key: np.ndarray, parent: Optional["_Node"]) -> None:
        self.key = key
        self.children: Dict[int, _Node] = {}
        self.parent = parent
        self.tenants: Dict[int, int] = {}  # engine id -> last access tick


class ApproxRadixTree:
    """SGLang's approximate radix tree, over token ids, shared by all engines (tenants)."""

    def __init__(self) -> None:
        self.root = _Node(np.zeros(0, dtype=np.int32), None)
        self.tenant_size: Dict[int, int] = {}  # tokens owned per engine
        self._tick = 0

    def insert(self, tokens: np.ndarray, tenant: int) -> None:
        self._tick += 1
        tick = self._tick
        node = self.root
        node.tenants[tenant] = tick
        self.tenant_size.setdefault(tenant, 0)
        pos, n = 0, len(tokens)
        while pos < n:
            child = node.children.get(int(tokens[pos]))
            if child is None:
                leaf = _Node(tokens[pos:].copy(), node)
                leaf.tenants[tenant] = tick
                node.children[int(tokens[pos])] = leaf
                self.tenant_size[tenant] += n - pos
                return
            m = _common_prefix_len(child.key, tokens[pos:pos + len(child.key)])
            if m < len(child.key):  # split child at m
                mid = _Node(child.key[:m].copy(), node)
                mid.tenants = dict(child.tenants)
                child.key = child.key[m:].copy()
                child.parent = mid
                mid.children[int(child.key[0])] = child
                node.children[int(mid.key[0])] = mid
                child = mid
            if tenant not in child.tenants:
                self.tenant_size[tenant] += len(child.key)
            child.tenants[tenant] = tick
            pos += len(child.key)
            node = child

    def match_per_tenant(self, tokens: np.ndarray) -> Dict[int, int]:
        """Longest matched prefix (tokens) per engine that holds any of it."""
        best: Dict[int, int] = {}
        node, pos, n = self.root, 0, len(tokens)
        while pos < n:
            child = node.children.get(int(tokens[pos]))
            if child is None:
                break
            m = _common_prefix_len(child.key, tokens[pos:pos + len(child.key)])
            for t in child.tenants:
                best[t] = pos + m
            if m < len(child.key):
                break
            pos += m
            node = child
        return best

    def evict_tenant(self, tenant: int, max_size: int) -> None:
        """Remove the tenant's least-recently-used leaves until it owns <= max_size tokens."""
        if self.tenant_size.get(tenant, 0) <= max_size:
            return
        heap: List[Tuple[int, int, _Node]] = []
        seq = 0
        stack = [self.root]
        while stack:
            node = stack.pop()
            has_child_with_tenant = False
            for c in node.children.values():
                if tenant in c.tenants:
                    has_child_with_tenant = True
                    stack.append(c)
            if node is not self.root and not has_child_with_tenant and tenant in node.tenants:
                heap.append((node.tenants[tenant], seq, node))
                seq += 1
        heapq.heapify(heap)
        while heap and self.tenant_size[tenant] > max_size:
            _, _, node = heapq.heappop(heap)
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


class SGLangCacheAwarePolicy(DispatchPolicy):
    name = "sglang_cache_aware"

    def __init__(self, num_engines: int, cache_threshold: float = 0.3,
                 balance_abs_threshold: int = 64, balance_rel_threshold: float = 1.5,
                 max_tree_size: int = 2 ** 26) -> None:
        super().__init__(num_engines)
        if not 0.0 <= cache_threshold <= 1.0:
            raise ValueError(f"cache_threshold must be in [0, 1], got {cache_threshold}")
        if balance_abs_threshold < 0 or balance_rel_threshold < 0:
            raise ValueError("balance thresholds must be >= 0, got "
                             f"abs={balance_abs_threshold} rel={balance_rel_threshold}")
        if max_tree_size <= 0:
            raise ValueError(f"max_tree_size must be positive, got {max_tree_size}")
        self.cache_threshold = float(cache_threshold)
        self.balance_abs_threshold = balance_abs_threshold
        self.balance_rel_threshold = float(balance_rel_threshold)
        self.max_tree_size = int(max_tree_size)
        self.tree = ApproxRadixTree()
        self.last_decision: str = ""  # "shortest_queue" | "cache_match" | "smallest_tree"

    def _insert(self, tokens: np.ndarray, eid: int) -> None:
        self.tree.insert(tokens, eid)
        if self.tree.size_of(eid) > self.max_tree_size:
            self.tree.evict_tenant(eid, self.max_tree_size)

    def choose(self, request: TurnRequest, engines: Sequence[EngineState]) -> int:
        healthy = self._healthy(engines)
        tokens = np.asarray(request.context_token_ids, dtype=np.int32)
        loads = {e.engine_id: e.load for e in healthy}
        max_load, min_load = max(loads.values()), min(loads.values())
        imbalanced = (max_load - min_load > self.balance_abs_threshold
                      and max_load > self.balance_rel_threshold * min_load)
        if imbalanced:
            eid = min(healthy, key=lambda e: (e.load, e.engine_id)).engine_id
            self.last_decision = "shortest_queue"
        else:
            matches = {t: m for t, m in self.tree.match_per_tenant(tokens).items() if t in loads}
            matched = max(matches.values()) if matches else 0
            match_rate = matched / len(tokens) if len(tokens) else 0.0
            if match_rate > self.cache_threshold:
                eid = min((t for t, m in matches.items() if m == matched),
                          key=lambda t: (loads[t], t))
                self.last_decision = "cache_match"
            else:
                eid = min(loads, key=lambda t: (self.tree.size_of(t), t))
                self.last_decision = "smallest_tree"
        self._insert(tokens, eid)
        return eid
