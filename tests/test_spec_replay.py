"""The GRPO-step replay and the proposers it compares."""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

import numpy as np
import pytest

from war_openrlhf.dispatch.least_loaded import openrlhf_group_placement
from war_openrlhf.simulation import ReplayConfig, replay, split_into_steps
from war_openrlhf.speculation.proposers import (
    NgramProposer,
    NoSpeculation,
    PerEngineSuffixProposer,
    TurnRequest,
    WarGlobalProposer,
)
from war_openrlhf.traces import TokenizedTrajectory, Turn

ROOT = Path(__file__).resolve().parents[1]


def _traj(tid: str, gid: str, turns: list[tuple[list[int], list[int]]]) -> TokenizedTrajectory:
    return TokenizedTrajectory(
        tid, gid, [Turn(np.array(c, dtype=np.int32), np.array(r, dtype=np.int32), 3) for c, r in turns]
    )


def _workload(n_groups=4, samples=2, seed=0):
    """Groups whose samples share long phrases (like GRPO siblings) and a phrase shared
    by every group (like a tool-call template)."""
    rng = np.random.default_rng(seed)
    shared = rng.integers(1000, 2000, size=40).tolist()
    groups = {}
    for g in range(n_groups):
        mine = rng.integers(2000, 3000, size=30).tolist()
        trajs = []
        for s in range(samples):
            prompt = [1, 2, g, 3]
            turns = []
            for t in range(3):
                resp = mine[: 10 + 5 * t] + [9] + shared + [int(rng.integers(3000, 4000))]
                turns.append((prompt, resp))
                prompt = prompt + resp + [7, 7]
            trajs.append(_traj(f"g{g}/s{s}", f"g{g}", turns))
        groups[f"g{g}"] = trajs
    return groups


def test_no_speculation_emits_one_token_per_step_and_every_token_once():
    groups = _workload()
    res = replay(groups, NoSpeculation(), ReplayConfig(engines=2, k=8))
    total = sum(int(t.response_token_ids.size) for g in groups.values() for tr in g for t in tr.turns)
    assert res.generated_tokens == total == res.verification_steps
    assert res.tokens_per_step == 1.0 and res.draft_tokens == 0
    assert res.turns == sum(len(tr.turns) for g in groups.values() for tr in g)


@pytest.mark.parametrize("steps", [1, 2])
def test_replay_is_deterministic_and_conserves_tokens(steps):
    groups = _workload()
    cfg = ReplayConfig(engines=2, k=8, steps=steps, seed=3)
    a = replay(groups, WarGlobalProposer(2), cfg).as_dict()
    b = replay(groups, WarGlobalProposer(2), cfg).as_dict()
    a.pop("propose_us_per_call"), b.pop("propose_us_per_call")
    assert a == b
    total = sum(int(t.response_token_ids.size) for g in groups.values() for tr in g for t in tr.turns)
    assert a["generated_tokens"] == total
    assert a["accepted_tokens"] <= a["draft_tokens"]
    assert len(a["per_step_ticks"]) == steps


def test_global_index_drafts_at_least_as_well_as_per_engine_trees():
    """Same draft rule (the match-length cap): the global index never drafts less than vLLM's
    per-engine trees. Here each group stays on one engine (OpenRLHF's placement), so every
    phrase a request can draft is on its own engine too and the two tie; a sibling drafting
    from another engine's turn is tested in test_suffix_index. Verification costs nothing in
    this replay, so a longer cap (2x the match) drafts more."""
    from war_openrlhf.speculation import SuffixIndexConfig

    groups = _workload(n_groups=6)
    cfg = ReplayConfig(engines=3, k=8, tool_delay_ticks=20)
    none = replay(groups, NoSpeculation(), cfg)
    per_engine = replay(groups, PerEngineSuffixProposer(3), cfg)
    war = replay(groups, WarGlobalProposer(3), cfg)
    assert none.tokens_per_step < per_engine.tokens_per_step <= war.tokens_per_step
    longer = replay(groups, WarGlobalProposer(3, SuffixIndexConfig(max_spec_factor=2.0)), cfg)
    assert longer.tokens_per_step > war.tokens_per_step


def test_per_engine_suffix_shares_live_responses_only_within_an_engine():
    prop = PerEngineSuffixProposer(2)
    ctx = np.array([5, 6, 7, 8], dtype=np.int32)
    a = TurnRequest("a", 0, "ta", "g", ctx)
    b_same = TurnRequest("b", 0, "tb", "g", ctx)
    c_other = TurnRequest("c", 1, "tc", "g", ctx)
    for r in (a, b_same, c_other):
        prop.start(r)
    prop.observe(a, np.arange(100, 120, dtype=np.int32))
    probe = np.array([9, 100, 101, 102, 103], dtype=np.int32)
    assert prop.propose(b_same, probe, 4) == [104, 105, 106, 107]
    assert prop.propose(c_other, probe, 4) == []


def test_ngram_uses_vllm_prompt_lookup():
    prop = NgramProposer(min_n=2, max_n=3)
    req = TurnRequest("r", 0, "t", "g", np.array([1], dtype=np.int32))
    ctx = np.array([1, 2, 3, 4, 5, 9, 2, 3], dtype=np.int32)
    assert prop.propose(req, ctx, 2) == [4, 5]
    with pytest.raises(ValueError, match="min_n"):
        NgramProposer(min_n=4, max_n=2)


def test_least_loaded_placement_matches_openrlhf_dispatch():
    assert openrlhf_group_placement([4, 4, 4, 2, 2], 3) == [0, 1, 2, 0, 1]
    assert openrlhf_group_placement([8, 1, 1, 1], 2) == [0, 1, 1, 1]


def test_bad_replay_config_is_named():
    with pytest.raises(ValueError, match="engines"):
        ReplayConfig(engines=0)
    with pytest.raises(ValueError, match="steps: group 'g0' has 2 samples"):
        split_into_steps(_workload(samples=2), 3)


def test_bench_speculation_names_file_and_record_of_malformed_traces(tmp_path):
    bad = tmp_path / "bad.json"
    bad.write_text(json.dumps([{"task_id": 0, "trial": 0, "reward": 1.0, "traj": [{"role": "system", "content": "x"}]},
                               {"task_id": 1, "trial": 0, "reward": 1.0}]))
    proc = subprocess.run([sys.executable, str(ROOT / "tools" / "bench_speculation.py"), "--traces", str(bad)],
                          capture_output=True, text=True, timeout=120)
    assert proc.returncode == 2
    assert "bad.json" in proc.stderr and "record 1" in proc.stderr and "traj" in proc.stderr
