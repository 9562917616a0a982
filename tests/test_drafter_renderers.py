"""The docs' reading of bench_engine's drafting sweep: tokens per verification step against
vLLM's suffix method batch by batch (per drafted step and per decode step of a request), and
the drafter's share of the engine's time at batch 32."""

from __future__ import annotations

import numpy as np
import pytest

from war_openrlhf.metrics.docs_renderers import engine_drafter, engine_drafter_reading
from war_openrlhf.metrics.vllm_metrics import request_step_yield

NEW_TOKENS = 11


def _row(batch, tpv, share=None, us=None, accepted=40, drafts=None):
    r = {"batch": batch, "tokens_per_s": 100.0 * batch, "tokens_per_s_min": 90.0 * batch,
         "tokens_per_s_max": 110.0 * batch, "tokens_per_verification_step": tpv, "repeats": 10,
         "draft_tokens": 100, "accepted_tokens": accepted,
         "drafts": drafts if drafts is not None else round(accepted / (tpv - 1))}
    if share is not None:
        r["drafter_share"] = share
        r["drafter_step_us"] = {"p50": us, "p99": 2 * us, "max": 3 * us, "mean": us}
    return r


def _doc(war_tpv=(2.5, 2.4), share32=0.02):
    return {"machine": {"load_average": [1.0, 1.0, 1.0], "cpus": 2}, "new_tokens": NEW_TOKENS,
            "results": {"vllm_suffix": [_row(1, 2.4), _row(32, 2.3)],
                        "war_on": [_row(1, war_tpv[0], 0.05, 300.0), _row(32, war_tpv[1], share32, 900.0)]}}


def test_rows_come_in_batch_order_with_the_drafter_columns_only_for_war():
    lines = [x for x in engine_drafter(_doc()).splitlines() if x.startswith("| ") and not x.startswith("| batch")]
    assert [x.split(" | ")[0] for x in lines] == ["| 1", "| 1", "| 32", "| 32"]
    war32 = next(x for x in lines if x.startswith("| 32 | `war_on`"))
    assert war32.endswith("| 900 | 900 | 2.0% |") and "| 0.40 |" in war32
    assert next(x for x in lines if x.startswith("| 32 | `vllm_suffix`")).endswith("| - | - | - |")


def test_the_reading_checks_every_batch_and_the_share_at_32():
    ok = engine_drafter_reading(_doc())
    assert "(at least vLLM's at 2 of 2 batches). Target (tokens per verification step >= vLLM's at every " \
        "batch, read per drafted step): met." in ok and "2.0% of the engine's time (target <= 3%: met)" in ok
    worse = engine_drafter_reading(_doc(war_tpv=(2.5, 2.2), share32=0.04))
    assert "(at least vLLM's at 1 of 2 batches). Target" in worse and "read per drafted step): missed." in worse
    assert "4.0% of the engine's time (target <= 3%: missed)" in worse
    assert "vLLM's own suffix drafter" not in ok  # a file that did not time it says nothing of it


def test_the_reading_gives_vllms_own_drafter_cost_when_the_file_timed_it():
    doc = _doc()
    doc["results"]["vllm_suffix"][1] = _row(32, 2.3, 0.011, 250.0)
    text = engine_drafter_reading(doc)
    assert "vLLM's own suffix drafter, timed alike at batch 32: 1.1% of its engine's time, 250 us per step" in text
    row = next(x for x in engine_drafter(doc).splitlines() if x.startswith("| 32 | `vllm_suffix`"))
    assert row.endswith("| 250 | 250 | 1.1% |")


@pytest.mark.parametrize("seed", range(5))
def test_request_step_yield_counts_the_decode_steps_of_a_lockstep_run(seed):
    """Brute force: requests of NEW_TOKENS tokens decoded step by step, each step a draft or
    not and some of it accepted (never past the request's end), counted directly."""
    rng = np.random.default_rng(seed)
    batch, repeats = int(rng.integers(1, 9)), int(rng.integers(1, 4))
    steps = drafts = accepted = 0
    for _ in range(batch * repeats):
        left = NEW_TOKENS - 1  # the first token comes from the prefill
        while left > 0:
            steps += 1
            if rng.random() < 0.6:
                drafts += 1
                a = int(rng.integers(0, min(left - 1, 4) + 1))
                accepted += a
                left -= a + 1
            else:
                left -= 1
    y = request_step_yield({"batch": batch, "repeats": repeats, "accepted_tokens": accepted, "drafts": drafts},
                           NEW_TOKENS)
    assert y["decode_request_steps"] == steps
    assert y["tokens_per_request_step"] == pytest.approx(batch * repeats * (NEW_TOKENS - 1) / steps)
    assert y["drafted_step_share"] == pytest.approx(drafts / steps)


def test_a_drafter_that_drafts_more_often_can_lose_per_draft_and_win_per_step():
    """The reason the second reading exists: per draft, drafting in fewer steps looks better."""
    doc = _doc()
    # vLLM: 20 drafts, 30 accepted (2.5 per draft); WAR: 40 drafts, 50 accepted (2.25 per draft)
    doc["results"]["vllm_suffix"] = [_row(1, 2.5, accepted=30, drafts=20)]
    doc["results"]["war_on"] = [_row(1, 2.25, 0.02, 300.0, accepted=50, drafts=40)]
    text = engine_drafter_reading(doc)
    assert "read per drafted step): missed." in text
    assert "tokens per decode step of a request (every step, drafted or not) by batch: 1: 2.000 vs 1.429" in text
    assert "at least vLLM's at every batch for every WAR drafter" in text
    row = next(x for x in engine_drafter(doc).splitlines() if x.startswith("| 1 | `war_on`"))
    assert "| 2.25 | 2.000 | 80% |" in row


def _sweep(auto_at_16=95.0):
    def rows(rates, frac=None):
        return [{"batch": b, "tokens_per_s": r, **({"spec_step_fraction": frac} if frac is not None else {})}
                for b, r in zip((1, 16), rates)]
    return {"machine": {"load_average": [1.0, 1.0, 1.0], "cpus": 2},
            "results": {"off": rows((100.0, 100.0)), "war_off": rows((98.0, 99.0)), "war_on": rows((150.0, 90.0)),
                        "war_auto": rows((149.0, auto_at_16), 0.9)}}


def test_the_switch_reading_compares_with_the_faster_fixed_mode_per_batch():
    from war_openrlhf.metrics.docs_renderers import engine_switch_reading

    ok = engine_switch_reading(_sweep())
    assert "1: 0.99x, 16: 0.96x" in ok and "(target >= 0.95x at every batch: met)" in ok
    assert "`war_auto` 1.49x plain vLLM (`off`; target > 1: met)" in ok
    bad = engine_switch_reading(_sweep(auto_at_16=90.0))
    assert "worst 0.91x at batch 16" in bad and "missed" in bad
    lacking = _sweep()
    del lacking["results"]["war_off"]
    assert "lacks war_off" in engine_switch_reading(lacking)
