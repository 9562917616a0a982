"""Reading vLLM's own counters (Prometheus metrics of ``LLM.get_metrics()``)."""

from __future__ import annotations

from typing import Any

SPEC_COUNTERS = ("num_drafts", "num_draft_tokens", "num_accepted_tokens")


def spec_decode_counters(llm: Any) -> dict[str, float]:
    """``vllm:spec_decode_*`` totals of an offline ``vllm.LLM`` (zeros without speculation)."""
    out = dict.fromkeys(SPEC_COUNTERS, 0.0)
    for metric in llm.get_metrics():
        name = metric.name.removeprefix("vllm:spec_decode_")
        if name in out:
            out[name] += metric.value
    return out


def engine_spec_decode_counters(llm: Any) -> dict[str, float]:
    """The same totals for this engine alone. vLLM 0.29 registers one engine's Prometheus
    metrics at a time (a new ``PrometheusStatLogger`` unregisters the previous one's), so with
    several engines in one process :func:`spec_decode_counters` sees only the last one started;
    each engine's logger still counts its own, read here. Falls back to the registry where the
    engine keeps no such logger."""
    manager = getattr(getattr(llm, "llm_engine", None), "logger_manager", None)
    for logger in getattr(manager, "stat_loggers", None) or []:
        prom = getattr(logger, "spec_decoding_prom", None)
        if prom is None:
            continue
        if not getattr(prom, "spec_decoding_enabled", False):
            return dict.fromkeys(SPEC_COUNTERS, 0.0)
        return {name: float(sum(child._value.get() for child in getattr(prom, f"counter_spec_decode_{name}").values()))
                for name in SPEC_COUNTERS}
    return spec_decode_counters(llm)


def request_step_yield(row: dict, new_tokens: int) -> dict[str, float | None]:
    """Tokens a request gains per decode step, drafting or not, from a fixed-length run's
    spec-decode counters: the per-draft figure (``1 + accepted / drafts``) rewards drafting
    less often, so two drafters that draft in different shares of the steps compare only
    here. ``row``: ``batch``, ``repeats`` (else the count of ``tokens_per_s_runs``) and
    ``accepted_tokens`` / ``drafts`` summed over the runs, every request generating exactly
    ``new_tokens`` (the first from its prefill, the rest from decode steps that each yield
    one token plus what they accepted)."""
    repeats = row.get("repeats") or len(row.get("tokens_per_s_runs") or ())
    decoded = repeats * int(row["batch"]) * (int(new_tokens) - 1)
    accepted = row.get("accepted_tokens") or 0
    steps = decoded - accepted
    if decoded <= 0 or steps <= 0:
        return {"decode_request_steps": None, "tokens_per_request_step": None, "drafted_step_share": None}
    return {"decode_request_steps": steps, "tokens_per_request_step": decoded / steps,
            "drafted_step_share": (row.get("drafts") or 0) / steps}
