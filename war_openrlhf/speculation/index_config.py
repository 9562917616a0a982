"""The knobs of a :class:`~war_openrlhf.speculation.index.GlobalSuffixIndex` replica."""

from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path
from typing import Any

from ..config_checks import check_int, dataclass_from_dict, load_yaml


@dataclass
class SuffixIndexConfig:
    """Knobs of the index; defaults are the values the speculation benchmark chose
    (``tools/bench_speculation.py --ablations``, see docs/benchmarks.md).

    - ``max_tree_depth``: longest suffix kept per position (matching window). Cost of
      insertion and speculation grows with it. arctic-inference uses 64, vLLM 24;
      32 drafts as well as 64 on agent traces at a quarter of the speculate cost.
    - ``token_budget``: tokens kept in the global tree (records' inserted tokens).
    - ``evict_to_fraction``: when over budget, evict oldest records down to this
      fraction of the budget, then rebuild once (amortises the rebuild).
    - ``max_policy_lag``: drop records older than ``current_version - lag``
      (``None`` keeps all versions).
    - ``prompt_lead_in``: tokens from the end of a record's prompt inserted in front
      of its response, so the tree can draft a response's first tokens from the
      generation prompt / tool result that precedes it.
    - ``group_trees`` / ``group_bias``: keep a tree per GRPO group and multiply its
      draft scores by ``group_bias`` when choosing among candidate drafts.
    - ``live_responses``: share this engine's in-flight responses (vLLM's behaviour).
    - ``inflight_sharing``: share every engine's in-flight responses with their GRPO group on
      every engine: the engine hands the new tokens of its running turns to the pool in chunks
      (``inflight_chunk_tokens`` at least, every log sync), the log carries them to every
      replica, and a request drafts from its group's in-flight tree (scores times
      ``group_bias``). A sibling generating on another engine drafts for this one while both run.
    - ``max_spec_factor``, ``max_spec_offset``, ``min_token_prob``: arctic's draft
      rule: at most ``match_len * factor + offset`` tokens, stop below ``min_token_prob``.
      Factor 1 as vLLM: on the trained policy's task rollouts drafts of up to 2x the match
      were accepted at 0.44 against vLLM's 0.64 (docs/benchmarks.md); inside the cap, the
      engine's cost-aware cut-off (``SpecSwitchConfig.cost_aware_drafts``) replaces
      ``min_token_prob`` once it has measured its steps.
    - ``max_trajectory_trees``: trajectory trees kept for multi-turn reuse (LRU).
    - ``match_window``: context tokens matched against the trees. A tree path is at
      most ``max_tree_depth`` long, so a match of ``m`` tokens can draft at most
      ``depth - m``; ``None`` (default) matches ``depth - max_tokens + 1`` tokens,
      which keeps every match that can still yield a full draft and cuts the
      speculate cost (quadratic in the window) by ~3x at depth 32, K 16.
    - ``apply_budget_ms``: on a busy engine, log entries are applied between steps in
      slices of about this long (0.5 ms: under 3% of a 20 ms GPU decode step), so a
      burst of completed turns never stalls a step; an idle engine applies them at once.
    - ``max_pending_tokens``: a backlog beyond this many queued response tokens is applied
      in full at the next step (the replica never falls far behind the log).
    - ``suffix_tree``: the C++ tree (:mod:`.suffix_tree`): ``war`` (arctic-inference's tree
      with a longest-first speculate, the same drafts at fewer node visits; compiled at first
      use), ``arctic`` (arctic-inference's own, for a node without a C++ compiler); ``None``:
      ``$WAR_SUFFIX_TREE``, else ``war``.
    """

    max_tree_depth: int = 32
    token_budget: int = 4_000_000
    evict_to_fraction: float = 0.75
    max_policy_lag: int | None = None
    prompt_lead_in: int = 16
    group_trees: bool = False
    group_bias: float = 1.0
    live_responses: bool = True
    inflight_sharing: bool = True
    inflight_chunk_tokens: int = 8
    max_spec_factor: float = 1.0
    max_spec_offset: float = 0.0
    min_token_prob: float = 0.1
    max_trajectory_trees: int = 4096
    match_window: int | None = None
    apply_budget_ms: float = 0.5
    max_pending_tokens: int = 65536
    suffix_tree: str | None = None

    def __post_init__(self) -> None:
        def bad(name: str, why: str) -> ValueError:
            return ValueError(f"SuffixIndexConfig.{name}: {why}, got {getattr(self, name)!r}")

        for name in ("max_tree_depth", "token_budget", "max_trajectory_trees"):
            check_int("SuffixIndexConfig", name, getattr(self, name), 1)
        check_int("SuffixIndexConfig", "prompt_lead_in", self.prompt_lead_in, 0)
        check_int("SuffixIndexConfig", "max_policy_lag", self.max_policy_lag, 0, nullable=True)
        check_int("SuffixIndexConfig", "match_window", self.match_window, 2, nullable=True)
        check_int("SuffixIndexConfig", "max_pending_tokens", self.max_pending_tokens, 0)
        check_int("SuffixIndexConfig", "inflight_chunk_tokens", self.inflight_chunk_tokens, 1)
        if self.suffix_tree is not None and self.suffix_tree not in ("war", "arctic"):
            raise bad("suffix_tree", "must be 'war', 'arctic' or null")
        if not float(self.apply_budget_ms) > 0:
            raise bad("apply_budget_ms", "must be > 0")
        if not 0.0 < float(self.evict_to_fraction) <= 1.0:
            raise bad("evict_to_fraction", "must be in (0, 1]")
        if float(self.group_bias) <= 0:
            raise bad("group_bias", "must be > 0")
        if float(self.max_spec_factor) < 0 or float(self.max_spec_offset) < 0:
            raise bad("max_spec_factor" if float(self.max_spec_factor) < 0 else "max_spec_offset", "must be >= 0")
        if not 0.0 <= float(self.min_token_prob) <= 1.0:
            raise bad("min_token_prob", "must be in [0, 1]")

    @classmethod
    def from_dict(cls, data: dict[str, Any], source: str = "SuffixIndexConfig") -> "SuffixIndexConfig":
        """Build from a mapping; unknown keys and wrong types name the key and ``source``."""
        return dataclass_from_dict(cls, data, source)

    @classmethod
    def from_yaml(cls, path: str | Path) -> "SuffixIndexConfig":
        data = load_yaml(path)
        return cls.from_dict(data, source=str(path))
