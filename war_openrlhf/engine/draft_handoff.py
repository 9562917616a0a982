"""A step's drafts travel back with its output: one worker round trip per step less.

Why: in vLLM 0.29 an engine with a speculative config and synchronous scheduling (every
suffix-drafting engine, and every CPU engine) asks its worker for the step's drafts in a call
of its own after every step (``EngineCore.post_step`` -> ``model_executor.take_draft_token_ids``,
``vllm/v1/engine/core.py`` ~629-636): a third message round trip through the executor's queues
beside ``execute_model`` and ``sample_tokens``, paid on every step, drafting or not. A plain
engine makes two. That round trip is part of what a WAR engine costs with drafting off.

How: the worker's model runner puts the drafts it just proposed on the step's
``ModelRunnerOutput`` (:func:`attach_drafts_to_outputs`, run in the worker by WAR's worker
extension; the output is pickled whole to the engine core, so the attribute travels with it),
and the engine core (:func:`register`, a vLLM general plugin, so it runs in every engine core
process) applies them where vLLM would have: ``post_step`` hands them to
``scheduler.update_draft_token_ids`` instead of calling the worker. The drafts are the ones
``take_draft_token_ids`` would have returned (the same call, made in the worker right after
sampling, before anything changes the batch), so the scheduler sees the same drafts and
outputs do not change. An output without the attribute (a vLLM engine without WAR's extension,
OpenRLHF's own, or a step whose output came from ``execute_model`` alone) takes vLLM's path.
"""

from __future__ import annotations

import threading
from typing import Any

__all__ = ["ATTR", "COUNTERS", "attach_drafts_to_outputs", "install", "register"]

#: the ``ModelRunnerOutput`` attribute carrying the step's ``DraftTokenIds`` (None: no drafts)
ATTR = "war_draft_token_ids"
_MISSING = object()
_STASH = "_war_step_drafts"
_MARK = "_war_draft_handoff"
#: the worker attribute holding :func:`attach_drafts_to_outputs`'s counters
COUNTERS = _MARK
_LOCK = threading.Lock()


def attach_drafts_to_outputs(worker: Any) -> dict[str, int] | None:
    """Worker side: wrap the worker's ``model_runner.sample_tokens`` (where vLLM's runner proposes
    a step's drafts) so every ``ModelRunnerOutput`` it returns carries ``take_draft_token_ids()``
    as :data:`ATTR`. Returns the worker's counters, ``handed_off`` (outputs that carried their
    drafts) and ``asked`` (the engine core still asked the worker in a call of its own: the engine
    core runs without :func:`install`, i.e. this package's vLLM plugin is not installed there);
    None if the runner has no drafter. Idempotent."""
    runner = getattr(worker, "model_runner", None)
    if getattr(runner, "drafter", None) is None or not hasattr(runner, "take_draft_token_ids"):
        return None
    counters = worker.__dict__.get(_MARK)
    if counters is not None:
        return counters
    from vllm.v1.outputs import ModelRunnerOutput

    counters = {"handed_off": 0, "asked": 0}
    sample_tokens, take = runner.sample_tokens, runner.take_draft_token_ids

    def sample_tokens_with_drafts(*args: Any, **kwargs: Any) -> Any:
        out = sample_tokens(*args, **kwargs)
        if type(out) is ModelRunnerOutput:  # not an async output (async scheduling takes no drafts here)
            drafts = take()
            if drafts is not None and not any(drafts.draft_token_ids):
                # no request drafted (drafting off): the scheduler already emptied every scheduled
                # request's drafts when it scheduled this step, so there is nothing to apply or ship
                drafts = None
            setattr(out, ATTR, drafts)
            counters["handed_off"] += 1
        return out

    asked = getattr(worker, "take_draft_token_ids", None)

    def take_draft_token_ids_counted(*args: Any, **kwargs: Any) -> Any:
        counters["asked"] += 1
        return asked(*args, **kwargs)

    runner.sample_tokens = sample_tokens_with_drafts
    if asked is not None:  # the engine core's RPC reaches the worker's method (vLLM's WorkerProc)
        worker.take_draft_token_ids = take_draft_token_ids_counted
    worker.__dict__[_MARK] = counters
    return counters


def install() -> bool:
    """Engine-core side: ``Scheduler.update_from_output`` keeps the output's drafts for the
    step's ``post_step``, which applies them instead of asking the worker. False without vLLM.
    Idempotent."""
    try:
        from vllm.v1.core.sched.scheduler import Scheduler
        from vllm.v1.engine.core import EngineCore
    except ImportError:
        return False
    with _LOCK:
        if getattr(EngineCore, _MARK, None) is not None:
            return True
        update, post_step = Scheduler.update_from_output, EngineCore.post_step

        def update_from_output(self, scheduler_output, model_runner_output, *args, **kwargs):
            self.__dict__[_STASH] = getattr(model_runner_output, ATTR, _MISSING)
            return update(self, scheduler_output, model_runner_output, *args, **kwargs)

        def post_step_with_handoff(self, model_executed: bool) -> None:
            drafts = self.scheduler.__dict__.pop(_STASH, _MISSING)
            if drafts is _MISSING or getattr(self, "batch_queue", None) is not None:
                return post_step(self, model_executed)  # vLLM's own path
            # vLLM's condition (core.py ~633), with the drafts already here
            if self.check_for_draft_tokens and not self.async_scheduling and model_executed and drafts is not None:
                self.scheduler.update_draft_token_ids(drafts)

        Scheduler.update_from_output = update_from_output
        EngineCore.post_step = post_step_with_handoff
        setattr(EngineCore, _MARK, (update, post_step))
    return True


def register() -> None:
    """vLLM general-plugin entry point (every vLLM process): engine cores apply handed-off drafts."""
    install()
