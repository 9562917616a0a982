"""Each engine's own spec-decode counters: with several vLLM engines in one process only the last
one's Prometheus metrics stay registered, so a benchmark that rotates engines reads each one's
logger, not the process-wide registry."""

from __future__ import annotations

from types import SimpleNamespace

from prometheus_client import CollectorRegistry, Counter

from war_openrlhf.metrics.vllm_metrics import engine_spec_decode_counters


def _engine(drafts, tokens, accepted, enabled=True):
    reg = CollectorRegistry()  # a logger's counters, registered or not, count on
    counters = {name: {0: Counter(f"x_{name}", "", ["engine"], registry=reg).labels("0")}
                for name in ("num_drafts", "num_draft_tokens", "num_accepted_tokens")}
    for name, value in zip(counters, (drafts, tokens, accepted)):
        counters[name][0].inc(value)
    prom = SimpleNamespace(spec_decoding_enabled=enabled,
                           **{f"counter_spec_decode_{k}": v for k, v in counters.items()})
    loggers = [SimpleNamespace(), SimpleNamespace(spec_decoding_prom=prom)]
    return SimpleNamespace(llm_engine=SimpleNamespace(logger_manager=SimpleNamespace(stat_loggers=loggers)))


def test_each_engine_reads_its_own_counters():
    a, b = _engine(3, 12, 5), _engine(7, 20, 9)
    assert engine_spec_decode_counters(a) == {"num_drafts": 3.0, "num_draft_tokens": 12.0, "num_accepted_tokens": 5.0}
    assert engine_spec_decode_counters(b)["num_accepted_tokens"] == 9.0


def test_an_engine_without_speculation_counts_nothing():
    assert set(engine_spec_decode_counters(_engine(1, 1, 1, enabled=False)).values()) == {0.0}
