"""The docs' reading of bench_engine's drafting sweep: tokens per verification step against
vLLM's suffix method batch by batch, and the drafter's share of the engine's time at batch 32."""

from __future__ import annotations

from war_openrlhf.metrics.docs_renderers import engine_drafter, engine_drafter_reading


def _row(batch, tpv, share=None, us=None):
    r = {"batch": batch, "tokens_per_s": 100.0 * batch, "tokens_per_s_min": 90.0 * batch,
         "tokens_per_s_max": 110.0 * batch, "tokens_per_verification_step": tpv,
         "draft_tokens": 100, "accepted_tokens": 40}
    if share is not None:
        r["drafter_share"] = share
        r["drafter_step_us"] = {"p50": us, "p99": 2 * us, "max": 3 * us, "mean": us}
    return r


def _doc(war_tpv=(2.5, 2.4), share32=0.02):
    return {"machine": {"load_average": [1.0, 1.0, 1.0], "cpus": 2},
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
    assert "every batch: met; at least vLLM's at 2 of 2 batches" in ok and "2.0% of the engine's time (target <= 3%: met)" in ok
    worse = engine_drafter_reading(_doc(war_tpv=(2.5, 2.2), share32=0.04))
    assert "every batch: missed; at least vLLM's at 1 of 2 batches" in worse and "4.0% of the engine's time (target <= 3%: missed)" in worse
    assert "vLLM's own suffix drafter" not in ok  # a file that did not time it says nothing of it


def test_the_reading_gives_vllms_own_drafter_cost_when_the_file_timed_it():
    doc = _doc()
    doc["results"]["vllm_suffix"][1] = _row(32, 2.3, 0.011, 250.0)
    text = engine_drafter_reading(doc)
    assert "vLLM's own suffix drafter, timed alike at batch 32: 1.1% of its engine's time, 250 us per step" in text
    row = next(x for x in engine_drafter(doc).splitlines() if x.startswith("| 32 | `vllm_suffix`"))
    assert row.endswith("| 250 | 250 | 1.1% |")


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
