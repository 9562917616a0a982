"""Trace-shaped workloads: recorded agent trajectories replayed on real engines.

    python examples/trace_replay/dataset.py --traces ../shared/traces/tau_airline_dev.json \
        --split report --out trace_report.jsonl

One row per task (a GRPO group: the task's trials): ``prompt`` is the conversation before the
first assistant turn (chat template + generation prompt); ``label`` (a JSON string) holds, per
trial, each model turn's recorded length in Qwen2.5 tokens, the text the environment returned
after it (tool results, user replies, then the next generation prompt), and the tool latency
of that step, drawn once here (fixed x lognormal jitter + per environment token) so that every
configuration that replays the row waits exactly as long. ``examples/trace_replay/agent.py``
replays it; the model's own text is sampled, only its length is the recorded one.

``--split``: tasks are split in two halves by a hash of their id, ``tune`` and ``report``:
tune constants on one, report the other.
"""

from __future__ import annotations

import argparse
import hashlib
import json
import sys
from pathlib import Path

import numpy as np

# Loaded by path: put examples/common and this folder on sys.path (examples/README.md).
_HERE = Path(__file__).resolve().parent
sys.path[:0] = [p for p in (str(_HERE.parent / "common"), str(_HERE)) if p not in sys.path]

from jsonl import write_jsonl  # noqa: E402

SPLITS = ("tune", "report", "tuning", "validation", "all")


def task_split(task_id: int) -> str:
    """``tune`` or ``report``: half the tasks each, by a hash of the id (not by its order).
    The dispatch benchmarks use ``tuning`` / ``validation`` instead
    (:func:`war_openrlhf.traces.task_halves`), the halves the dispatcher was tuned on / not."""
    return "tune" if hashlib.sha1(str(task_id).encode()).digest()[0] % 2 == 0 else "report"


def generate_from_traces(path: str | Path, *, split: str = "report", seed: int = 0, tool_latency_s: float = 0.05,
                         jitter_sigma: float = 0.5, per_env_token_s: float = 0.0,
                         max_groups: int | None = None, skip_groups: int = 0) -> list[dict]:
    """Rows for the tasks of ``split`` in the trace file at ``path`` (tau-bench format): in task
    order, the first ``skip_groups`` left out, then at most ``max_groups``."""
    from war_openrlhf.traces import (load_chat_traces, qwen25_tokenizer, render_assistant_response,
                                     task_halves)
    from war_openrlhf.traces.chat_template import GENERATION_PROMPT, render_blocks

    if split not in SPLITS:
        raise ValueError(f"split: {split!r} is not one of {', '.join(SPLITS)}")
    for name, value in (("tool_latency_s", tool_latency_s), ("jitter_sigma", jitter_sigma),
                        ("per_env_token_s", per_env_token_s)):
        if not (isinstance(value, (int, float)) and np.isfinite(value) and value >= 0):
            raise ValueError(f"{name}: must be a finite number >= 0, got {value!r}")
    if not (isinstance(skip_groups, int) and skip_groups >= 0):
        raise ValueError(f"skip_groups: must be an int >= 0, got {skip_groups!r}")
    trajectories = load_chat_traces(path)
    tokenizer = qwen25_tokenizer()
    halves = task_halves(t.group_id for t in trajectories)
    groups: dict[int, list] = {}
    for t in trajectories:
        if (split == "all" or (split in halves and t.group_id in halves[split])
                or task_split(t.task_id) == split):
            groups.setdefault(t.task_id, []).append(t)
    rows = []
    chosen = sorted(groups)[skip_groups:]
    for task_id in chosen[: max_groups if max_groups else None]:
        trials = []
        prompt = None
        for t in sorted(groups[task_id], key=lambda x: x.trial):
            blocks = render_blocks(t.messages)
            first = next((i for i, b in enumerate(blocks) if b.role == "assistant"), None)
            if first is None:
                continue  # no model turn: nothing to replay
            text = "".join(b.text for b in blocks[:first]) + GENERATION_PROMPT
            prompt = prompt or text  # a group shares one prompt (its first trial's)
            lengths, observations, env_tokens = [], [], []
            assistant = [i for i, b in enumerate(blocks) if b.role == "assistant"]
            for k, i in enumerate(assistant):
                lengths.append(len(tokenizer.encode(render_assistant_response(t.messages[blocks[i].start]))))
                if k + 1 < len(assistant):
                    env = "".join(b.text for b in blocks[i + 1: assistant[k + 1]])
                    observations.append("\n" + env + GENERATION_PROMPT)
                    env_tokens.append(len(tokenizer.encode(env)))
            rng = np.random.default_rng([seed, task_id, t.trial])
            delays = [round(float(tool_latency_s * rng.lognormal(0.0, jitter_sigma) + per_env_token_s * n), 6)
                      for n in env_tokens] + [0.0]
            trials.append({"trial": t.trial, "lengths": lengths, "observations": observations, "delays": delays})
        if trials:
            rows.append({"prompt": prompt, "label": json.dumps({"task": task_id, "trials": trials})})
    if not rows:
        raise ValueError(f"{path}: no trajectory with a model turn in split {split!r}"
                         + (f" after the first {skip_groups} tasks" if skip_groups else ""))
    return rows


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--traces", required=True)
    ap.add_argument("--split", choices=SPLITS, default="report")
    ap.add_argument("--out", required=True)
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("--tool-latency", type=float, default=0.05, help="median tool latency, seconds")
    ap.add_argument("--jitter-sigma", type=float, default=0.5, help="lognormal sigma of the latency")
    ap.add_argument("--per-env-token", type=float, default=0.0, help="extra seconds per environment token")
    ap.add_argument("--max-groups", type=int)
    ap.add_argument("--skip-groups", type=int, default=0, help="leave out the split's first N tasks")
    a = ap.parse_args()
    rows = generate_from_traces(a.traces, split=a.split, seed=a.seed, tool_latency_s=a.tool_latency,
                                jitter_sigma=a.jitter_sigma, per_env_token_s=a.per_env_token, max_groups=a.max_groups,
                                skip_groups=a.skip_groups)
    write_jsonl(a.out, rows)
    print(f"wrote {len(rows)} tasks to {a.out}")


if __name__ == "__main__":
    main()
