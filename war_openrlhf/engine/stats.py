"""``EngineStats``: the typed view of what an engine reports (``WarEngine.stats()``).

``WarEngine.stats()`` returns a plain dict because it crosses Ray and must stay readable by
any client; everything in this package that reads it goes through :meth:`EngineStats.from_wire`,
so a renamed or missing field fails in one place, not as a ``KeyError`` (or a silent ``.get``
default) in four.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any, Mapping

#: Running totals an engine reports (monotonic between resets); differences of two
#: snapshots give a batch's figures (:meth:`EngineStats.minus`).
COUNTERS = ("prefix_cache_queries", "prefix_cache_hits", "spec_drafts", "spec_draft_tokens",
            "spec_accepted_tokens", "prompt_tokens", "generation_tokens", "steps", "preemptions")


@dataclass(frozen=True)
class EngineStats:
    """One engine's report. Counters are running totals; the rest is the latest snapshot."""

    engine: int = 0
    healthy: bool = True
    error: str | None = None
    speculation: str = ""
    running: int = 0
    waiting: int = 0
    kv_cache_usage: float = 0.0
    kv_capacity_tokens: int | None = None
    kv_block_size: int | None = None  # the engine's KV block: its prefix cache reuses whole blocks only
    # the engine's measured step cost (engine/step_meter.py): step_s + step_per_seq_s x sequences
    # + prefill_token_s x prompt tokens; zeros until measured
    step_s: float = 0.0
    step_per_seq_s: float = 0.0
    prefill_token_s: float = 0.0
    prefix_cache_queries: int = 0
    prefix_cache_hits: int = 0
    spec_drafts: int = 0
    spec_draft_tokens: int = 0
    spec_accepted_tokens: int = 0
    prompt_tokens: int = 0
    generation_tokens: int = 0
    steps: int = 0
    preemptions: int = 0  # requests vLLM preempted (KV full): their KV is recomputed
    spec_step_fraction: float | None = None  # engine steps that drafted (the WAR switch), None: no switch
    index_applied_seq: int | None = None  # last log entry the engine's index replica applied
    index_owner: str | None = None  # the pool whose log the replica follows
    sync_lag_records: int = 0
    sync_errors: int = 0
    pid: int | None = None  # the engine's process
    kv_events: dict[str, int] = field(default_factory=dict)  # KvEventSubscriber.stats() (config.kv_events)
    war: dict[str, Any] = field(default_factory=dict, repr=False)  # the replica's own report, unparsed

    @classmethod
    def from_wire(cls, d: Mapping[str, Any], *, healthy: bool = True, error: str | None = None) -> "EngineStats":
        """From ``WarEngine.stats()``'s dict (an empty dict: an engine never reached)."""
        war = dict(d.get("war") or {})
        switch = war.get("switch") or {}
        index = war.get("index") or {}
        cap = d.get("kv_capacity_tokens")
        return cls(
            engine=int(d.get("engine", 0)), healthy=healthy, error=error, speculation=str(d.get("speculation", "")),
            running=int(d.get("running", 0)), waiting=int(d.get("waiting", 0)),
            kv_cache_usage=float(d.get("kv_cache_usage", 0.0) or 0.0),
            kv_capacity_tokens=int(cap) if cap else None,
            kv_block_size=int(d["kv_block_size"]) if d.get("kv_block_size") else None,
            step_s=float(d.get("step_s", 0.0) or 0.0), step_per_seq_s=float(d.get("step_per_seq_s", 0.0) or 0.0),
            prefill_token_s=float(d.get("prefill_token_s", 0.0) or 0.0),
            **{k: int(d.get(k, 0) or 0) for k in COUNTERS},
            spec_step_fraction=switch.get("spec_step_fraction"),
            index_applied_seq=index.get("applied_seq"), index_owner=d.get("index_owner"),
            sync_lag_records=int(d.get("sync_lag_records", 0)), sync_errors=int(d.get("sync_errors", 0)),
            pid=int(d["pid"]) if d.get("pid") else None, kv_events=dict(d.get("kv_events") or {}), war=war,
        )

    def minus(self, before: "EngineStats") -> dict[str, int]:
        """Counter differences since ``before`` (a batch's figures)."""
        return {k: getattr(self, k) - getattr(before, k) for k in COUNTERS}
