"""What an OpenRLHF agent file sees in WAR's episode runner is what OpenRLHF 0.11.2's own
``MultiTurnAgentExecutor.execute`` shows it: the same agent class runs through both, with the
same scripted model, and what it observed (every ``reset`` / ``step`` argument), what each turn
asked the engine for and the trajectory handed to the trainer are compared.

No engine: a turn is what vLLM would return for a scripted token stream, its stop checks
(``check_stop``) and its text made by vLLM's own incremental detokenizer, so ``action_text``
on WAR's side (rebuilt from token ids) is checked against vLLM's real ``.text``. OpenRLHF's
initial ``SamplingParams`` come from its own generator code (``_dispatch_prompts_to_vllm``)
with Ray stubbed out."""

from __future__ import annotations

import asyncio
import copy
import importlib.util
import json
import random
import textwrap
from pathlib import Path
from types import SimpleNamespace

import pytest
import torch
from openrlhf.utils.agent import AgentInstanceBase, MultiTurnAgentExecutor
from vllm import SamplingParams

from war_openrlhf.rollout import RolloutConfig, load_agent_class, run_episode
from war_openrlhf.rollout.action_text import action_text
from war_openrlhf.rollout.trajectory import to_openrlhf_response
from war_openrlhf.rollout.turn_result import TurnResult

#: SamplingParams fields a caller sets (vLLM derives the others).
FIELDS = [f for f in SamplingParams.__struct_fields__ if not f.startswith("_") and f != "output_text_buffer_length"]
#: extra_logs keys WAR adds itself (an agent's own keys are compared).
WAR_LOG_KEYS = {"prompt_truncated_tokens", "tool_errors", "episode_traceback_lines"}


def fields(sp) -> dict:
    return {f: copy.deepcopy(getattr(sp, f)) for f in FIELDS}


@pytest.fixture(scope="module")
def tok(tmp_path_factory):
    """A small byte-level BPE with ChatML special tokens (EOS = <|im_end|>), trained here."""
    from transformers import AutoTokenizer

    from war_openrlhf.fixtures.tiny_model import write_tokenizer

    out = tmp_path_factory.mktemp("tok")
    texts = ["Question: what is 2+3? Let me <tool_call>search</tool_call> now.",
             "<tool_response>result 1</tool_response> Sure, the answer is <answer>5</answer>.",
             "café naïve — über straße 😀 done"] * 30
    write_tokenizer(out, texts, 400, 4096)
    return AutoTokenizer.from_pretrained(str(out))


# ---------------------------------------------------------------- a turn as vLLM returns it
def vllm_turn(tokenizer, context, sp, intended):
    """What vLLM returns for a request whose sampler picks ``intended`` in order: the scheduler
    stops at EOS / ``stop_token_ids`` / ``max_tokens`` (vllm/v1/core/sched/utils.py:94-136), the
    detokenizer makes the text and ends the turn at a stop string (detokenizer.py:96-144)."""
    from vllm.v1.engine.detokenizer import IncrementalDetokenizer

    request = SimpleNamespace(request_id="r", sampling_params=sp, prompt_token_ids=list(context), prompt_embeds=None)
    detok = IncrementalDetokenizer.from_new_request(tokenizer, request)
    eos = None if sp.ignore_eos else tokenizer.eos_token_id
    out, finish = [], "length"
    for token in intended:
        out.append(token)
        finish = None
        if token == eos or token in (sp.stop_token_ids or ()):
            finish = "stop"
        elif len(out) >= sp.max_tokens:
            finish = "length"
        if detok.update([token], finish == "stop"):
            finish = "stop"
        if finish:
            break
    return out, detok.get_next_output_text(True, False), finish or "length"


class Model:
    """The scripted policy: turn k samples ``texts[k]`` then EOS (a turn may stop earlier)."""

    def __init__(self, tokenizer, texts):
        self.tokenizer, self.texts, self.requests = tokenizer, list(texts), []

    def turn(self, context, sp):
        k = len(self.requests)
        self.requests.append((list(context), fields(SamplingParams(**fields(sp)))))  # as an engine reads it
        ids = self.tokenizer(self.texts[k], add_special_tokens=False)["input_ids"] + [self.tokenizer.eos_token_id]
        return vllm_turn(self.tokenizer, context, sp, ids)


class OpenRLHFEngine(Model):
    """``llm_engine`` as OpenRLHF's executor calls it (RolloutRayActor.generate, vllm_engine.py:153-177)."""

    async def generate(self, prompt_token_ids, sampling_params, multi_modal_data=None):
        ids, text, finish = self.turn(prompt_token_ids, copy.deepcopy(sampling_params))
        lps = None if sampling_params.logprobs is None else [{t: SimpleNamespace(logprob=-0.5)} for t in ids]
        return SimpleNamespace(outputs=[SimpleNamespace(token_ids=ids, text=text, finish_reason=finish, logprobs=lps)])


class WarService(Model):
    """The pool as an episode calls it; the request becomes ``SamplingParams(**fields)`` as in
    ``WarEngine.generate_tokens`` (engine/engine.py)."""

    async def generate_turn(self, trajectory_id, group_id, context, sampling_params, turn_index, tokens_so_far):
        ids, _text, finish = self.turn(context, SamplingParams(**sampling_params))
        return TurnResult(token_ids=ids, logprobs=[-0.5] * len(ids), finish_reason=finish, engine=0,
                          num_prompt_tokens=len(context))

    def park(self, trajectory_id, engine):
        pass

    def unpark(self, trajectory_id):
        pass


# ---------------------------------------------------------------- the agent under test
def recording_agent(plan, seen):
    """An agent whose step ``k`` returns ``plan[k](states)`` (keys given there override the
    defaults) and that records everything it is shown, as it is shown (the object is live)."""

    class Agent(AgentInstanceBase):
        def __init__(self, *args, **kwargs):
            self.k = 0

        async def reset(self, states, **kwargs):
            seen.append(("reset", copy.deepcopy(states)))
            return {"observation": states["observation"]}

        async def step(self, states, **kwargs):
            sp = states["sampling_params"]
            seen.append(("step", {**{k: v for k, v in states.items() if k != "sampling_params"},
                                  "sampling_params": (type(sp), fields(sp))}))
            k, self.k = self.k, self.k + 1
            result = {"rewards": torch.tensor(float(k)), "done": k + 1 >= len(plan), "sampling_params": sp,
                      "environment_feedback": f"\n<tool_response>r{k}</tool_response>\n", "extra_logs": {"turn": k}}
            result.update(plan[k](states))
            return result

    return Agent


def run_openrlhf(agent_cls, tokenizer, texts, prompt, label, *, max_len, max_new_tokens, monkeypatch, executor=None):
    """OpenRLHF's path: its generator builds the request (samples_generator.py:199-238), its
    executor (``executor``, else the default one over ``agent_cls``) runs the episode."""
    import openrlhf.trainer.ppo_utils.samples_generator as sg

    sent = []
    engine = SimpleNamespace(get_num_unfinished_requests=SimpleNamespace(remote=lambda: 0),
                             generate_responses=SimpleNamespace(remote=lambda **kw: sent.append(kw)))
    advantage = SimpleNamespace(is_correction_level="off")
    gen = SimpleNamespace(vllm_engines=[engine], tokenizer=tokenizer,
                          args=SimpleNamespace(algo=SimpleNamespace(advantage=advantage),
                                               rollout=SimpleNamespace(n_samples_per_prompt=1)))
    monkeypatch.setattr(sg, "ray", SimpleNamespace(get=lambda refs: list(refs)))
    # the keyword arguments train_ppo_ray.py:159-165 passes
    sg.SamplesGenerator._dispatch_prompts_to_vllm(gen, [prompt], [label], do_sample=True, max_len=max_len,
                                                  max_new_tokens=max_new_tokens, temperature=1.0, top_p=1.0)
    (kw,) = sent
    model = OpenRLHFEngine(tokenizer, texts)
    out = asyncio.run((executor or MultiTurnAgentExecutor(agent_cls)).execute(
        kw["prompt"], kw["label"], copy.deepcopy(kw["sampling_params"]), kw["max_length"], kw["hf_tokenizer"], model))
    return out, model.requests


def run_war(agent_cls, tokenizer, texts, prompt, label, *, max_len, max_new_tokens):
    cfg = RolloutConfig(max_turns=32, max_context_tokens=max_len, max_new_tokens_per_turn=max_new_tokens,
                        temperature=1.0, top_p=1.0, tool_timeout_s=10, agent_func_path="contract_agent.py",
                        progress=False)
    service = WarService(tokenizer, texts)
    traj = asyncio.run(run_episode(service, agent_cls, tokenizer, cfg, prompt=prompt, label=label,
                                   trajectory_id="t0", group_id="g0"))
    return traj, service.requests


def keep(**kw):
    return lambda states: kw


def new_params(**kw):
    return lambda states: {"sampling_params": SamplingParams(**kw)}


def mutate(**kw):
    def step(states):
        for k, v in kw.items():
            setattr(states["sampling_params"], k, v)
        return {"sampling_params": None}  # falsy: OpenRLHF keeps its (changed) object
    return step


SCENARIOS = {
    # special tokens inside a turn, EOS ending it, a last step's feedback, logs that change keys
    "plain": (["Let me <tool_call>search</tool_call>", "Sure<|endoftext|> the <|im_start|>answer",
               "<answer>5</answer> café"],
              [keep(extra_logs={"a": 1, "b": 2}), keep(extra_logs={"a": 3}, scores=torch.tensor(0.25)),
               keep(extra_logs={"c": 4}, environment_feedback="bye")], 4096, None),
    # the agent's own SamplingParams: every field reaches the engine; then changed in place
    "agent_params": (["call <tool_call>x</tool_call> tail", "Sure<|endoftext|> <tool_call>y</tool_call> more",
                      "naïve über 😀 <tool_call>z</tool_call> <answer>5</answer>", "done<|endoftext|> after"],
                     [new_params(temperature=0.5, top_k=7, top_p=0.9, min_p=0.05, presence_penalty=0.1,
                                 repetition_penalty=1.1, seed=11, stop=["</tool_call>"], min_tokens=2,
                                 skip_special_tokens=True, spaces_between_special_tokens=False,
                                 logit_bias={5: 0.5}, bad_words=["zzz"]),
                      mutate(include_stop_str_in_output=True, temperature=0.9),
                      mutate(stop=None, stop_token_ids=[4], skip_special_tokens=False,
                             include_stop_str_in_output=False),
                      keep()], 4096, None),
    # a prompt longer than the context (kept from its end), a turn cut by the budget
    "budget": (["word " * 200, "never"], [keep(done=False), keep(done=False)], 64, None),
    # OpenRLHF's --rollout.max_new_tokens: the prompt keeps room for it (WAR's cap never binds here)
    "reserve": (["Let me <tool_call>search</tool_call>", "<answer>5</answer>"], [keep(), keep()], 96, 40),
}


@pytest.mark.parametrize("name", list(SCENARIOS))
def test_an_agent_sees_and_produces_the_same_through_both_executors(tok, name, monkeypatch):
    texts, plan, max_len, max_new = SCENARIOS[name]
    prompt = "Question: what is 2+3? " * (12 if name in ("budget", "reserve") else 1)
    seen_o, seen_w = [], []
    ours, req_o = run_openrlhf(recording_agent(plan, seen_o), tok, texts, prompt, "5", max_len=max_len,
                               max_new_tokens=max_new, monkeypatch=monkeypatch)
    traj, req_w = run_war(recording_agent(plan, seen_w), tok, texts, prompt, "5", max_len=max_len,
                          max_new_tokens=max_new)
    assert traj.error is None, traj.error
    # what the agent was shown, call by call (sampling_params: a vllm.SamplingParams, the same fields)
    assert [kind for kind, _ in seen_w] == [kind for kind, _ in seen_o]
    for (kind, o), (_, w) in zip(seen_o, seen_w):
        if kind == "step":
            assert o["sampling_params"][0] is SamplingParams and w["sampling_params"][0] is SamplingParams
        assert w == o
    # what each turn asked the engine for (WAR always asks for the sampled token's logprob)
    assert len(req_w) == len(req_o)
    for (ctx_o, sp_o), (ctx_w, sp_w) in zip(req_o, req_w):
        assert ctx_w == ctx_o
        assert {k: v for k, v in sp_w.items() if k != "logprobs"} == {k: v for k, v in sp_o.items() if k != "logprobs"}
    # what the trainer gets (OpenRLHF's experience cuts the sequence at max_len)
    war = to_openrlhf_response(traj)
    assert war["observation_tokens"] == ours["observation_tokens"][:max_len]
    assert war["action_ranges"] == [tuple(r) for r in ours["action_ranges"]]
    assert war["truncated"] == ours["truncated"] and war["reward"] == pytest.approx(ours["reward"])
    assert war["scores"] == pytest.approx(float(ours["scores"]))
    # the last step's logs, not a merge
    assert {k: v for k, v in war["extra_logs"].items() if k not in WAR_LOG_KEYS} == \
        {k: float(v) for k, v in ours["extra_logs"].items()}


def test_with_a_turn_cap_only_max_tokens_differs(tok, monkeypatch):
    """WAR's max_new_tokens_per_turn bounds each turn (OpenRLHF gives every turn the rest of the
    context); with turns shorter than the cap, nothing else the agent sees differs."""
    plan = [keep(done=False), keep(done=False), keep()]
    texts = ["Let me <tool_call>search</tool_call>", "again", "<answer>5</answer>"]
    seen_o, seen_w = [], []
    run_openrlhf(recording_agent(plan, seen_o), tok, texts, "Q", "5", max_len=256, max_new_tokens=32,
                 monkeypatch=monkeypatch)
    traj, _ = run_war(recording_agent(plan, seen_w), tok, texts, "Q", "5", max_len=256, max_new_tokens=32)
    assert traj.error is None and len(seen_w) == len(seen_o) == 4
    for (kind, o), (_, w) in zip(seen_o[1:], seen_w[1:]):
        sp_o, sp_w = o.pop("sampling_params")[1], w.pop("sampling_params")[1]
        assert sp_w.pop("max_tokens") == 32 < sp_o.pop("max_tokens")
        assert (w, sp_w) == (o, sp_o)


def test_a_dict_as_sampling_params_fails_in_both_and_war_names_it(tok, monkeypatch):
    """OpenRLHF sets ``.max_tokens`` on whatever ``step`` returned (agent.py:94): a dict breaks
    the next turn there; WAR refuses it at once, naming the field."""
    plan = [keep(sampling_params={"temperature": 0.5}, done=False), keep()]
    texts = ["a", "b"]
    with pytest.raises(AttributeError, match="max_tokens"):
        run_openrlhf(recording_agent(plan, []), tok, texts, "Q", "5", max_len=256, max_new_tokens=None,
                     monkeypatch=monkeypatch)
    traj, _ = run_war(recording_agent(plan, []), tok, texts, "Q", "5", max_len=256, max_new_tokens=None)
    assert traj.end_reason == "agent_error" and "sampling_params of type dict" in traj.error
    assert "contract_agent.py: step()" in traj.error


def test_a_delta_output_kind_is_refused(tok):
    from vllm.sampling_params import RequestOutputKind

    plan = [new_params(output_kind=RequestOutputKind.DELTA), keep()]
    traj, _ = run_war(recording_agent(plan, []), tok, ["a", "b"], "Q", "5", max_len=256, max_new_tokens=None)
    assert traj.end_reason == "agent_error" and "output_kind = DELTA" in traj.error


# ---------------------------------------------------------------- action_text against vLLM's detokenizer
def metaspace_tokenizer():
    """A SentencePiece-style tokenizer: a word's leading space lives in its token, so a turn's
    first token decodes differently alone and after its context."""
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers
    from transformers import PreTrainedTokenizerFast

    words = ["<unk>", "</s>", "<s>", "<sep>", "▁Hello", "▁world", "▁", "!", "é", "▁stop", "here", "▁a", "b"]
    backend = Tokenizer(models.WordLevel({w: i for i, w in enumerate(words)}, unk_token="<unk>"))
    backend.pre_tokenizer, backend.decoder = pre_tokenizers.Metaspace(), decoders.Metaspace()
    return PreTrainedTokenizerFast(tokenizer_object=backend, eos_token="</s>", bos_token="<s>", unk_token="<unk>",
                                   additional_special_tokens=["<sep>"])


@pytest.mark.parametrize("which", ["bpe", "metaspace"])
def test_action_text_is_vllms_text(tok, which):
    """Random turns, each ended as vLLM would end it, with random text settings: the text WAR
    rebuilds from the token ids equals vLLM's own detokenizer's, character for character."""
    t = tok if which == "bpe" else metaspace_tokenizer()
    rng = random.Random(7)
    vocab = len(t)

    def random_case():
        max_tokens = rng.randint(1, 12)
        sp = SamplingParams(max_tokens=max_tokens, min_tokens=min(max_tokens, rng.choice([0, 0, 1, 3])),
                            skip_special_tokens=rng.random() < 0.5, spaces_between_special_tokens=rng.random() < 0.5,
                            include_stop_str_in_output=rng.random() < 0.3, ignore_eos=rng.random() < 0.2,
                            stop=rng.choice([None, ["!"], ["here", "ab"], ["o w", "é"], ["er"], ["é!", "b</s>"]]),
                            stop_token_ids=rng.choice([None, [3], [4, 7]]))
        return sp, [rng.randrange(vocab) for _ in range(rng.randint(0, 8))], [rng.randrange(vocab) for _ in range(16)]

    # a stop string that ends in the stop token that ended the turn: the token stop decides
    fixed = [(SamplingParams(stop=["é!"], stop_token_ids=[7]), [4], [8, 7, 5]),
             (SamplingParams(stop=["b</s>"], skip_special_tokens=False), [4], [12, 1, 5])]
    fixed = fixed if which == "metaspace" else []
    differs_from_plain_decode = 0
    for sp, context, intended in fixed + [random_case() for _ in range(300)]:
        ids, text, finish = vllm_turn(t, context, sp, intended)
        assert action_text(t, context, ids, finish, sp) == text, (context, ids, finish, sp)
        plain = t.decode(ids[:-1] if finish == "stop" else ids, skip_special_tokens=sp.skip_special_tokens)
        differs_from_plain_decode += plain != text
    assert differs_from_plain_decode > 0  # the cases a plain decode of the turn gets wrong are covered
    sp = SamplingParams(detokenize=False)
    assert action_text(t, [], [4, 5], "length", sp) == ""


# ---------------------------------------------------------------- the agent file
AGENT_FILE = '''
from openrlhf.utils.agent import AgentInstanceBase, MultiTurnAgentExecutor


class AgentInstance(AgentInstanceBase):
    def __init__(self, *args, **kwargs):
        pass

    async def step(self, states, **kwargs):
        return {"rewards": 0.0, "environment_feedback": "", "done": True}


class Other(AgentInstance):
    pass


class AgentExecutor(MultiTurnAgentExecutor):
    def __init__(self):
        super().__init__(Other)
'''


def test_the_instance_class_is_the_one_openrlhfs_executor_runs(tmp_path):
    path = tmp_path / "agent.py"
    path.write_text(AGENT_FILE)
    assert load_agent_class(path).__name__ == "Other"  # not the module's AgentInstance (agent.py:39)


def test_a_custom_execute_is_refused_naming_the_file(tmp_path):
    custom = AGENT_FILE + textwrap.dedent('''
        class AgentExecutor(MultiTurnAgentExecutor):
            def __init__(self):
                super().__init__(AgentInstance)

            async def execute(self, prompt, label, sampling_params, max_length, hf_tokenizer, llm_engine, images=None):
                sampling_params.stop = ["</tool_call>"]
                return await super().execute(prompt, label, sampling_params, max_length, hf_tokenizer, llm_engine)
    ''')
    path = tmp_path / "custom.py"
    path.write_text(custom)
    with pytest.raises(ValueError, match=r"custom\.py'.*overrides execute\(\).*never calls"):
        load_agent_class(path)
    declared = tmp_path / "declared.py"
    declared.write_text(custom.replace("    def __init__(self):\n        super().__init__(AgentInstance)",
                                       "    war_bypass_execute = True\n\n    def __init__(self):\n"
                                       "        super().__init__(AgentInstance)"))
    assert load_agent_class(declared).__name__ == "AgentInstance"
    not_base = tmp_path / "not_base.py"
    not_base.write_text(AGENT_FILE + "\n\nclass AgentExecutor:\n    pass\n")
    with pytest.raises(ValueError, match="must inherit from AgentExecutorBase"):
        load_agent_class(not_base)


def test_the_trace_replay_agent_bounds_every_turn_on_both_paths(tok, monkeypatch):
    """examples/trace_replay/agent.py: each turn at its recorded length, through its engine proxy
    on OpenRLHF's path and through ``war_turn_limits`` on WAR's (which never calls execute)."""
    path = Path(__file__).resolve().parents[1] / "examples" / "trace_replay" / "agent.py"
    lengths = [3, 5, 2]
    label = json.dumps({"task": 0, "trials": [{"trial": 0, "lengths": lengths, "observations": ["obs1", "obs2"],
                                               "delays": [0.0, 0.0, 0.0]}]})
    texts = ["word " * 40] * len(lengths)
    spec = importlib.util.spec_from_file_location("agent_module", path)  # as OpenRLHF loads it
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    ours, req_o = run_openrlhf(None, tok, texts, "Q", label, max_len=512, max_new_tokens=None,
                               monkeypatch=monkeypatch, executor=module.AgentExecutor())
    traj, req_w = run_war(load_agent_class(path), tok, texts, "Q", label, max_len=512, max_new_tokens=None)
    assert traj.end_reason == "done" and [end - start for start, end in traj.action_ranges] == lengths
    assert [end - start for start, end in ours["action_ranges"]] == lengths
    for requests in (req_o, req_w):
        assert [(sp["max_tokens"], sp["min_tokens"], sp["ignore_eos"]) for _, sp in requests] == \
            [(n, n, True) for n in lengths]
    assert to_openrlhf_response(traj)["observation_tokens"] == ours["observation_tokens"]


def test_a_turns_request_fields_equal_the_attribute_by_attribute_reference():
    """engine_sampling_kwargs reads a SamplingParams as one tuple: for random parameter sets it
    sends exactly the fields that differ from vLLM's defaults (and max_tokens), as reading every
    attribute would, and the engine's SamplingParams(**fields) equals the agent's."""
    from war_openrlhf.rollout.agents import _DERIVED_FIELDS, engine_sampling_kwargs

    default = SamplingParams()
    rng = random.Random(7)
    for _ in range(200):
        kw = {"max_tokens": rng.randint(1, 64)}
        if rng.random() < 0.5:
            kw["temperature"] = rng.choice([0.0, 0.7, 1.0, 1.3])
        if rng.random() < 0.5:
            kw["top_p"] = rng.choice([0.5, 0.9, 1.0])
        if rng.random() < 0.3:
            kw["top_k"] = rng.choice([-1, 5, 50])
        if rng.random() < 0.3:
            kw["stop"] = rng.choice([["</tool_call>"], ["a", "b"]])
        if rng.random() < 0.3:
            kw["seed"] = rng.randint(0, 99)
        if rng.random() < 0.3:
            kw["skip_special_tokens"] = False
        if rng.random() < 0.3:
            kw["presence_penalty"] = 0.5
        params = SamplingParams(**kw)
        reference = {name: getattr(params, name) for name in SamplingParams.__struct_fields__
                     if not name.startswith("_") and name not in _DERIVED_FIELDS
                     and (name == "max_tokens" or getattr(params, name) != getattr(default, name))}
        if reference.get("seed") is None:
            reference["seed"] = 11
        if reference.get("logprobs") is None:
            reference["logprobs"] = 0
        assert engine_sampling_kwargs(params, {}, 11, "agent.py: ") == reference
