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
