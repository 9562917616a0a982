"""A replica's local (per-engine) state: the trees of its live requests.

- a tree per live trajectory: its whole context plus what it generated, extended across
  turns instead of rebuilt, kept LRU for multi-turn reuse;
- a "live" tree of the engine's in-flight responses, as vLLM's proposer has.
"""

from __future__ import annotations

from collections import OrderedDict
from dataclasses import dataclass
from typing import Any, Sequence

import numpy as np

from .index_config import SuffixIndexConfig
from .rebuild import SEQ_MASK
from .records import _check_id, as_token_array
from .suffix_tree import tree_class


@dataclass
class RequestState:
    trajectory_key: str
    group_id: str | None
    live_seq: int | None
    live_tokens: int = 0
    handle: int = 0  # the request's key for the incremental speculate of shared trees


class TrajectoryTree:
    """A trajectory's own context (+ generated tokens), extended turn over turn."""

    __slots__ = ("tree", "tokens", "length")

    def __init__(self, tree: Any) -> None:
        self.tree = tree
        self.tokens = np.zeros(1024, dtype=np.int32)
        self.length = 0

    def append(self, new: np.ndarray) -> None:
        if new.size == 0:
            return
        need = self.length + new.size
        if need > self.tokens.size:
            grown = np.zeros(max(need, 2 * self.tokens.size), dtype=np.int32)
            grown[: self.length] = self.tokens[: self.length]
            self.tokens = grown
        self.tokens[self.length : need] = new
        self.length = need
        self.tree.extend_ndarray(0, new)

    def is_prefix_of(self, prompt: np.ndarray) -> bool:
        n = self.length
        return prompt.size >= n and bool(np.array_equal(prompt[:n], self.tokens[:n]))


class RequestTrees:
    """Live requests, their trajectory trees and the engine's live tree."""

    def __init__(self, config: SuffixIndexConfig) -> None:
        self.config = config
        self.depth = config.max_tree_depth
        self.requests: dict[str, RequestState] = {}
        self.trajectories: OrderedDict[str, TrajectoryTree] = OrderedDict()
        tree = tree_class(config.suffix_tree)
        self.new_tree = lambda: tree(self.depth)
        #: the compiled tree's incremental speculate, keyed by each request's handle (arctic's has none)
        self.incremental = hasattr(tree, "speculate_handle_ndarray")
        self.live = self.new_tree()
        self.live_seqs = 0  # sequences in the live tree (its num_seqs(), without a call into C++)
        self.next_live_seq = 0
        self.next_handle = 0

    def start(
        self,
        request_id: str,
        prompt_token_ids: Sequence[int] | np.ndarray,
        group_id: str | None = None,
        trajectory_id: str | None = None,
    ) -> None:
        request_id = _check_id(request_id, "request_id")
        if request_id in self.requests:
            raise ValueError(f"request_id: '{request_id}' is already active; stop_request it first")
        prompt = as_token_array(prompt_token_ids, "prompt_token_ids")
        group = None if group_id is None else _check_id(group_id, "group_id")
        key = ("traj:" + _check_id(trajectory_id, "trajectory_id")) if trajectory_id is not None else ("req:" + request_id)
        ttree = self.trajectories.get(key)
        if ttree is None or not ttree.is_prefix_of(prompt):
            ttree = TrajectoryTree(self.new_tree())
            self.trajectories[key] = ttree
        self.trajectories.move_to_end(key)
        ttree.append(prompt[ttree.length :])
        while len(self.trajectories) > self.config.max_trajectory_trees:
            old_key = next(iter(self.trajectories))
            if any(st.trajectory_key == old_key for st in self.requests.values()):
                break  # never drop a tree a live request uses
            del self.trajectories[old_key]
        live_seq = None
        if self.config.live_responses:
            live_seq = self.next_live_seq
            self.next_live_seq = (self.next_live_seq + 1) & SEQ_MASK
        self.requests[request_id] = RequestState(key, group, live_seq, handle=self.next_handle)
        self.next_handle += 1

    def extend(self, request_id: str, token_ids: Sequence[int] | np.ndarray) -> None:
        state = self.get(request_id)  # an unknown request is an error even with nothing to add
        tokens = as_token_array(token_ids, "token_ids", allow_empty=True)
        if tokens.size:
            self.append_to(state, tokens)

    def append_to(self, state: RequestState, tokens: np.ndarray) -> None:
        """Append checked, non-empty int32 tokens to a live request's trees."""
        self.trajectories[state.trajectory_key].append(tokens)
        if state.live_seq is not None:
            self.live.extend_ndarray(state.live_seq, tokens)
            self.live_seqs += state.live_tokens == 0
            state.live_tokens += int(tokens.size)

    def stop(self, request_id: str) -> RequestState:
        state = self.get(request_id)
        del self.requests[request_id]
        if state.live_seq is not None and state.live_tokens:
            self.live.remove(state.live_seq)
            self.live_seqs -= 1
        if state.trajectory_key.startswith("req:"):
            self.trajectories.pop(state.trajectory_key, None)
        elif self.incremental and state.trajectory_key in self.trajectories:
            self.trajectories[state.trajectory_key].tree.forget_handle(state.handle)
        return state

    def get(self, request_id: Any) -> RequestState:
        """The live request's state; an unknown id raises with the reason."""
        state = self.requests.get(request_id) if isinstance(request_id, str) else None
        if state is None:
            raise ValueError(
                f"request_id: unknown request {request_id!r}; call start_request first "
                f"({len(self.requests)} active)"
            )
        return state
