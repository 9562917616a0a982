"""The tiny trained agent policy: scripted transcripts (token stream, action mask, rewards)
and the build (loadable, reused when the spec matches, rebuilt when it changes).

Builds here train for a handful of steps only; the real build takes minutes.
"""

from __future__ import annotations

import json
import os
import re
import shutil
from pathlib import Path

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

os.environ.setdefault("HF_HUB_OFFLINE", "1")
os.environ.setdefault("TOKENIZERS_PARALLELISM", "false")

import torch  # noqa: E402
import transformers  # noqa: E402

from war_openrlhf.fixtures import tiny_policy  # noqa: E402
from war_openrlhf.fixtures.tiny_model import build_tiny_model  # noqa: E402
from war_openrlhf.fixtures.tiny_policy import TASKS, build_tiny_policy, read_manifest, scripted_transcripts  # noqa: E402

# A build small enough for a unit test: a few steps, a few transcripts, a short check.
SMALL = dict(
    steps=3,
    batch_sizes={task: 2 for task in TASKS},
    n_train=6,
    n_eval=2,
    n_samples=2,
    n_sample_prompts=1,
    max_new_tokens=8,
    episode_turns=1,
    num_threads=1,
)


@pytest.fixture(scope="module", autouse=True)
def _one_thread():
    """One intra-op thread: these tensors are tiny, and on a busy machine a second thread mostly waits."""
    saved = torch.get_num_threads()
    torch.set_num_threads(1)
    yield
    torch.set_num_threads(saved)


@pytest.fixture(scope="module")
def tokenizer(tmp_path_factory):
    path = build_tiny_model(tmp_path_factory.mktemp("tiny") / "model", **tiny_policy.DEFAULT_MODEL)
    return transformers.AutoTokenizer.from_pretrained(str(path))


@pytest.fixture(scope="module")
def word_split_tokenizer(tmp_path_factory):
    from war_openrlhf.fixtures.tiny_model import write_tokenizer

    out = tmp_path_factory.mktemp("wordsplit")
    write_tokenizer(out, ["SELECT name FROM products WHERE city = 'Oslo'", "Question: how many?"] * 20, 400, 512,
                    split_words=True)
    return transformers.AutoTokenizer.from_pretrained(str(out))


def _runs(mask):
    """(start, end, value) of each maximal run of equal values in ``mask``."""
    out, start = [], 0
    for i in range(1, len(mask) + 1):
        if i == len(mask) or mask[i] != mask[start]:
            out.append((start, i, mask[start]))
            start = i
    return out


@pytest.mark.parametrize("task", TASKS)
def test_transcripts_are_deterministic_and_mask_exactly_the_actions(tokenizer, task):
    a = scripted_transcripts(tokenizer, task, 8, seed=3, error_rate=0.5, n_eval=2)
    b = scripted_transcripts(tokenizer, task, 8, seed=3, error_rate=0.5, n_eval=2)
    assert a == b and len(a) == 8
    assert scripted_transcripts(tokenizer, task, 8, seed=4, error_rate=0.5, n_eval=2) != a

    def ids(text):
        return list(tokenizer(text, add_special_tokens=False)["input_ids"]) if text else []

    eos = tokenizer.eos_token_id
    for t in a:
        assert len(t.input_ids) == len(t.action_mask)
        assert len(t.actions) == len(t.feedbacks) >= 2
        # feedback after every action but the last (the answer ends the episode)
        assert all(t.feedbacks[:-1]) and t.feedbacks[-1] == ""
        assert "<answer>" in t.actions[-1] and all("<tool_call>" in x for x in t.actions[:-1])
        # rebuild the stream segment by segment: prompt, (action + EOS, feedback)*
        expected_ids, expected_mask = ids(t.prompt), [False] * len(ids(t.prompt))
        for action, feedback in zip(t.actions, t.feedbacks):
            expected_ids += ids(action) + [eos]
            expected_mask += [True] * (len(ids(action)) + 1)
            expected_ids += ids(feedback)
            expected_mask += [False] * len(ids(feedback))
        assert list(t.input_ids) == expected_ids
        assert list(t.action_mask) == expected_mask
        # one masked run per action, each ending with the model's EOS; EOS only there
        masked = [(s, e) for s, e, v in _runs(t.action_mask) if v]
        assert len(masked) == len(t.actions)
        assert all(t.input_ids[e - 1] == eos for _, e in masked)
        assert sum(1 for x in t.input_ids if x == eos) == len(t.actions)
        assert t.prompt_len == len(ids(t.prompt))


@pytest.mark.parametrize("task", TASKS)
def test_scripted_answers_get_full_reward_from_the_agents_reward(tokenizer, task):
    transcripts = scripted_transcripts(tokenizer, task, 10, seed=0, error_rate=1.0, n_eval=2)
    protocol = tiny_policy.tool_protocol()
    agent = tiny_policy.load_task(task).agent
    for t in transcripts:
        assert t.reward == 1.0
        answer = protocol.extract_answer(t.actions[-1])
        assert agent.reward(answer, t.label) == 1.0
    # error_rate=1.0: every episode holds one mistaken turn the environment complains about
    # (an error) or that does not help (the wrong article), then the correct call
    normal_turns = 3 if task == "doc_lookup" else 2
    assert all(len(t.actions) == normal_turns + 1 for t in transcripts)
    assert any("Error:" in f for t in transcripts for f in t.feedbacks)


def test_held_out_prompts_are_not_trained_on(tokenizer):
    for task in TASKS:
        t = tiny_policy.load_task(task)
        train, held, _ = tiny_policy.split_rows(t, 30, 5, seed=0)
        assert len(held) == 5 and len(train) == 30
        assert not {r["prompt"] for r, _ in held} & {r["prompt"] for r, _ in train}


def test_build_is_loadable_idempotent_and_rebuilds_on_spec_change(tmp_path, monkeypatch):
    out = tmp_path / "policy"
    stale, recent = tmp_path / ".policy.build-killed", tmp_path / ".policy.build-running"
    stale.mkdir()
    recent.mkdir()
    os.utime(stale, (0, 0))  # left by a build killed long ago
    path = build_tiny_policy(out, **SMALL)
    assert path == out.absolute()
    names = sorted(p.name for p in path.iterdir())
    assert "model.safetensors" in names and "tokenizer.json" in names and "war_tiny_model.json" not in names
    # no build directory of its own left behind; a killed build's removed, a running one's kept
    assert sorted(p.name for p in tmp_path.iterdir() if p.name.startswith(".")) == [recent.name]

    manifest = read_manifest(path)
    assert manifest["spec"]["train"]["steps"] == SMALL["steps"]
    results = manifest["results"]
    assert results["train"]["final_loss"] > 0
    for task in TASKS:
        check = results["held_out"][task]
        assert check["prompts"] == SMALL["n_eval"]
        assert 0.0 <= check["greedy_valid_tool_call"] <= 1.0
        assert 0 < check["greedy_mean_turn_tokens"] <= SMALL["max_new_tokens"]

    model = transformers.AutoModelForCausalLM.from_pretrained(str(path), dtype=torch.float32)
    tok = transformers.AutoTokenizer.from_pretrained(str(path))
    assert model.config.eos_token_id == tok.eos_token_id == tok.convert_tokens_to_ids("<|im_end|>")
    assert model.config.vocab_size == len(tok)
    # the tasks' own tokenizer: a value is the same tokens in a question and in a call
    def enc(text):
        return tok(text, add_special_tokens=False)["input_ids"]

    for value in ("Oslo", "Fjell Camp Stove", "2023", "customers"):
        inner = enc(value)
        for around in (f"Question: in {value}?", f"WHERE city = '{value}'", f'{{"query": "{value}"}}'):
            ids_ = enc(around)
            assert any(ids_[i : i + len(inner)] == inner for i in range(len(ids_))), (value, around)
    assert len(enc("SELECT COUNT(*) FROM customers")) <= 12  # keywords and names are whole tokens
    ids = tok("<tool_call>", add_special_tokens=False, return_tensors="pt")["input_ids"]
    with torch.no_grad():
        assert torch.isfinite(model(input_ids=ids).logits).all()

    # the same spec: reused, nothing trained or written
    stamp = (path / "model.safetensors").stat().st_mtime_ns

    def no_training(*args, **kwargs):
        raise AssertionError("retrained although the spec matches")

    monkeypatch.setattr(tiny_policy, "_train_and_check", no_training)
    assert build_tiny_policy(out, **SMALL) == path
    assert (path / "model.safetensors").stat().st_mtime_ns == stamp
    monkeypatch.undo()

    # a different spec: rebuilt in place
    changed = {**SMALL, "steps": SMALL["steps"] + 1}
    assert build_tiny_policy(out, **changed) == path
    assert read_manifest(path)["spec"]["train"]["steps"] == changed["steps"]


@settings(max_examples=60, deadline=None)
@given(text=st.text(st.characters(codec="utf-8", exclude_categories=("Cs",)), max_size=60))
def test_word_split_tokenizer_round_trips_any_text(word_split_tokenizer, text):
    ids = word_split_tokenizer(text, add_special_tokens=False)["input_ids"]
    assert word_split_tokenizer.decode(ids) == text


def test_build_is_deterministic(tmp_path):
    a = build_tiny_policy(tmp_path / "a", **SMALL)
    b = build_tiny_policy(tmp_path / "b", **SMALL)
    assert (a / "model.safetensors").read_bytes() == (b / "model.safetensors").read_bytes()
    ra, rb = read_manifest(a)["results"], read_manifest(b)["results"]
    assert ra["train"]["final_loss"] == rb["train"]["final_loss"]
    assert ra["held_out"]["all"] == rb["held_out"]["all"]


def test_build_refuses_a_foreign_directory_and_bad_specs(tmp_path):
    foreign = tmp_path / "mine"
    foreign.mkdir()
    (foreign / "notes.txt").write_text("keep me")
    with pytest.raises(ValueError, match="not a tiny-policy build"):
        build_tiny_policy(foreign, **SMALL)
    assert (foreign / "notes.txt").read_text() == "keep me"
    with pytest.raises(ValueError, match="dtype"):
        tiny_policy.tiny_policy_spec(dtype="bfloat16")
    with pytest.raises(ValueError, match="head size"):
        tiny_policy.tiny_policy_spec(hidden_size=96, num_heads=4)
    with pytest.raises(ValueError, match="steps"):
        tiny_policy.tiny_policy_spec(steps=-1)
    with pytest.raises(ValueError, match="batch_sizes"):
        tiny_policy.tiny_policy_spec(batch_sizes={"no_such_task": 2})


def test_spec_takes_a_task_subset_the_basic_level_and_tied_embeddings():
    spec = tiny_policy.tiny_policy_spec(tasks=["arithmetic_calculator"], arithmetic_level="basic",
                                        tie_embeddings=True)
    assert spec["data"]["tasks"] == ["arithmetic_calculator"] and spec["data"]["arithmetic_level"] == "basic"
    assert set(spec["train"]["batch_sizes"]) == {"arithmetic_calculator"}
    assert spec["model"]["tie_embeddings"] is True
    assert "tie_embeddings" not in tiny_policy.tiny_policy_spec()["model"]  # default specs unchanged
    assert tiny_policy._model_kwargs(spec)["tie_embeddings"] is True
    with pytest.raises(ValueError, match="tasks"):
        tiny_policy.tiny_policy_spec(tasks=["arithmetic_calculator", "arithmetic_calculator"])
    with pytest.raises(ValueError, match="tasks"):
        tiny_policy.tiny_policy_spec(tasks=[])
    with pytest.raises(ValueError, match="arithmetic_level"):
        tiny_policy.tiny_policy_spec(arithmetic_level="hard")
    with pytest.raises(ValueError, match="batch_sizes: must map the tasks arithmetic_calculator"):
        tiny_policy.tiny_policy_spec(tasks=["arithmetic_calculator"], batch_sizes={"sql_qa": 2})


def test_basic_level_transcripts_use_the_short_prompt_and_solve_it(tokenizer):
    ts = scripted_transcripts(tokenizer, "arithmetic_calculator", 6, level="basic", n_eval=2)
    words = scripted_transcripts(tokenizer, "arithmetic_calculator", 6, n_eval=2)
    assert max(t.prompt_len for t in ts) < min(t.prompt_len for t in words) / 2
    for t in ts:
        text = tokenizer.decode(t.input_ids)
        call = re.search(r'"expression": "(\d+) ([-+*]) (\d+)"', text)
        answer = re.search(r"<answer>(\d+)</answer>", text)
        assert call and answer, text
        a, op, b = int(call.group(1)), call.group(2), int(call.group(3))
        assert int(answer.group(1)) == {"+": a + b, "-": a - b, "*": a * b}[op]


def test_a_slipping_teacher_uses_the_wrong_operation_and_earns_nothing(tokenizer):
    """slip_rate: that fraction of basic transcripts computes with the wrong operation and
    answers its result (reward 0); the rest are the right episodes, unchanged."""
    clean = scripted_transcripts(tokenizer, "arithmetic_calculator", 40, level="basic", n_eval=2)
    slipped = scripted_transcripts(tokenizer, "arithmetic_calculator", 40, level="basic", n_eval=2, slip_rate=0.5)
    wrong = [s for s in slipped if s.reward == 0.0]
    assert 8 <= len(wrong) <= 32 and all(s.reward in (0.0, 1.0) for s in slipped)
    for c, s in zip(clean, slipped):
        assert c.prompt == s.prompt
        if s.reward == 1.0:
            assert s.actions == c.actions
        else:
            expr = lambda t: re.search(r'"expression": "(\d+ [-+*] \d+)"', t.actions[-2]).group(1)
            (a, op, b), (a2, op2, b2) = expr(c).split(), expr(s).split()
            assert (a, b) == (a2, b2) and op2 == {"+": "-", "-": "+", "*": "+"}[op]
            assert s.actions[-1] == f"<answer>{eval(expr(s))}</answer>" != c.actions[-1]
    assert tiny_policy.tiny_policy_spec(tasks=["arithmetic_calculator"], arithmetic_level="basic",
                                        slip_rate=0.5)["data"]["slip_rate"] == 0.5
    assert "slip_rate" not in tiny_policy.tiny_policy_spec()["data"]  # default specs unchanged
    with pytest.raises(ValueError, match="slip_rate: applies to the basic arithmetic level"):
        tiny_policy.tiny_policy_spec(slip_rate=0.5)
    with pytest.raises(ValueError, match="slip_rate: must be in"):
        tiny_policy.tiny_policy_spec(tasks=["arithmetic_calculator"], arithmetic_level="basic", slip_rate=1.0)


def test_spec_records_what_changes_the_transcripts():
    spec = tiny_policy.tiny_policy_spec()
    assert spec["data"]["examples_digest"] == tiny_policy.examples_digest()
    assert spec["data"]["feedback_format"] in ("plain", "chatml")
    assert spec["model"]["dtype"] == "float32" and spec["model"]["head_dim"] == 32
    assert json.loads(json.dumps(spec)) == spec  # what the manifest stores compares equal
    assert tiny_policy.tiny_policy_spec(seed=1) != spec


def test_examples_dir_override_and_error(tmp_path, monkeypatch):
    checkout = tiny_policy.examples_dir()
    assert checkout == Path(__file__).resolve().parents[1] / "examples"
    # a copy elsewhere (the argument, else the environment variable) gives the same digest:
    # the directory's location is not part of the build spec
    copy = tmp_path / "ex"
    shutil.copytree(checkout, copy, ignore=shutil.ignore_patterns("__pycache__"))
    assert tiny_policy.examples_dir(copy) == copy
    assert tiny_policy.examples_digest(copy) == tiny_policy.examples_digest()
    monkeypatch.setenv(tiny_policy.EXAMPLES_ENV, str(copy))
    assert tiny_policy.examples_dir() == copy
    assert tiny_policy.examples_dir(checkout) == checkout  # the argument wins
    monkeypatch.setenv(tiny_policy.EXAMPLES_ENV, str(tmp_path / "missing"))
    with pytest.raises(FileNotFoundError, match="WAR_EXAMPLES_DIR.*not a directory.*examples="):
        tiny_policy.load_task("sql_qa")
    (copy / "sql_qa" / "agent.py").unlink()
    with pytest.raises(FileNotFoundError, match="lacks sql_qa/agent.py"):
        tiny_policy.examples_digest(copy)
