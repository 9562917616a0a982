"""OpenRLHF agent that replays recorded agent trajectories (rows of ``dataset.py``).

Each sample of a group takes the next trial of its task (the trials of a task are a GRPO group).
Every model turn is forced to its recorded length (``max_tokens = min_tokens = L``,
``ignore_eos``); after it, the environment waits the recorded step's drawn tool latency and
returns the recorded observation text; the episode ends after the last recorded turn. Rewards
are 0: the workload is the shape of the trace (lengths, observations, latencies), not a task.

Both rollout paths run the same file: the WAR pool reads the per-turn bound from the
``war_turn_limits`` that ``reset`` / ``step`` return (a key OpenRLHF's executor never reads);
OpenRLHF's ``MultiTurnAgentExecutor`` sets ``max_tokens`` itself before each turn, so
:class:`AgentExecutor` hands it an engine proxy that applies the recorded length to each call
(the WAR pool never calls ``execute``: ``war_bypass_execute``).
"""

from __future__ import annotations

import asyncio
import json
import threading

import torch
from openrlhf.utils.agent import AgentInstanceBase, MultiTurnAgentExecutor

_LOCK = threading.Lock()
_NEXT_TRIAL: dict[int, int] = {}


def _parse(label) -> dict:
    data = json.loads(label) if isinstance(label, str) else dict(label)
    if not isinstance(data.get("trials"), list) or not data["trials"]:
        raise ValueError("trace_replay: label has no 'trials' (build rows with examples/trace_replay/dataset.py)")
    return data


def _pick_trial(data: dict, sample_index: int | None = None) -> dict:
    """The trial this sample replays: ``data['trial_index']`` if set; else the sample's number in
    its group where the rollout path gives it (the WAR pool's ``war_sample_index``: the same trial
    in whichever process the agent runs); else the task's next one (a counter of this process)."""
    trials = data["trials"]
    if "trial_index" in data:
        return trials[int(data["trial_index"]) % len(trials)]
    if sample_index is not None:
        return trials[int(sample_index) % len(trials)]
    with _LOCK:
        k = _NEXT_TRIAL.get(data["task"], 0)
        _NEXT_TRIAL[data["task"]] = k + 1
    return trials[k % len(trials)]


def _limits(length: int) -> dict:
    return {"max_tokens": int(length), "min_tokens": int(length), "ignore_eos": True}


class AgentInstance(AgentInstanceBase):
    def __init__(self, *args, **kwargs):
        self.trial: dict | None = None
        self.turn = 0

    async def reset(self, states: dict, **kwargs):
        self.trial = _pick_trial(_parse(states["label"]), states.get("war_sample_index"))
        self.turn = 0
        return {"observation": states["observation"], "war_turn_limits": _limits(self.trial["lengths"][0])}

    async def step(self, states: dict, **kwargs):
        k = self.turn
        self.turn += 1
        trial = self.trial
        await asyncio.sleep(trial["delays"][k] if k < len(trial["delays"]) else 0.0)
        done = self.turn >= len(trial["lengths"])
        zero = torch.tensor(0.0)
        return {"rewards": zero, "scores": zero, "done": done, "sampling_params": states.get("sampling_params"),
                "extra_logs": {}, "environment_feedback": "" if done else trial["observations"][k],
                "war_turn_limits": None if done else _limits(trial["lengths"][self.turn])}


class _RecordedLengths:
    """The engine as OpenRLHF's executor sees it, with each call's length set to the recorded one."""

    def __init__(self, engine, lengths):
        self._engine, self._lengths, self._turn = engine, list(lengths), 0

    async def generate(self, prompt_token_ids, sampling_params, multi_modal_data=None):
        if self._turn < len(self._lengths):
            n = min(int(sampling_params.max_tokens), self._lengths[self._turn])
            sampling_params.max_tokens, sampling_params.min_tokens, sampling_params.ignore_eos = n, n, True
        self._turn += 1
        return await self._engine.generate(prompt_token_ids, sampling_params, multi_modal_data=multi_modal_data)

    def __getattr__(self, name):
        return getattr(self._engine, name)


class AgentExecutor(MultiTurnAgentExecutor):
    #: the WAR pool runs the turns itself and bounds them with ``war_turn_limits`` instead
    war_bypass_execute = True

    def __init__(self):
        super().__init__(AgentInstance)

    async def execute(self, prompt, label, sampling_params, max_length, hf_tokenizer, llm_engine, images=None):
        data = _parse(label)
        trial = _pick_trial(data)
        label = json.dumps({**data, "trial_index": data["trials"].index(trial)})
        return await super().execute(prompt, label, sampling_params, max_length, hf_tokenizer,
                                     _RecordedLengths(llm_engine, trial["lengths"]), images)
