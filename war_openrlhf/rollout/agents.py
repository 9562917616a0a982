"""Environments: OpenRLHF 0.11.2's ``AgentInstanceBase`` API, loaded from an agent file.

An OpenRLHF agent file (``--agent_func_path``) defines ``AgentInstance(AgentInstanceBase)``
(one instance per trajectory: ``await reset(states)`` then ``await step(states)`` per turn)
and ``AgentExecutor(MultiTurnAgentExecutor)``. The pool runs the same file unchanged: it
takes the instance class (``AgentInstance``, or the executor's ``agent_instance_cls``) and
drives it turn by turn itself, so that every turn can be dispatched to any engine. There
is no second, native API: this one is already minimal.

``step`` returns ``rewards``, ``scores``, ``environment_feedback``, ``done``,
``sampling_params`` and ``extra_logs``; :func:`check_step_result` validates that dict and
names a missing or malformed key.

``sampling_params`` (from ``step``, or from ``reset`` for the first turn) is a dict in the
pool, where ``temperature`` / ``top_p`` change the sampling of later turns and
:data:`TURN_LIMIT_KEYS` bound the *next* turn only (an environment replaying recorded turn
lengths sets ``max_tokens = min_tokens = L`` with ``ignore_eos``); the context budget still
applies. :func:`turn_limits` validates them.
"""

from __future__ import annotations

import importlib.util
import math
import sys
from pathlib import Path
from typing import Any, Mapping

REQUIRED_STEP_KEYS = ("rewards", "environment_feedback", "done")
#: Keys of an environment's ``sampling_params`` that bound its next turn.
TURN_LIMIT_KEYS = ("max_tokens", "min_tokens", "ignore_eos")


def turn_limits(params: Any, where: str) -> dict[str, Any]:
    """The next-turn bounds in an environment's ``sampling_params`` (``{}`` if none)."""
    if not isinstance(params, Mapping):
        return {}
    out: dict[str, Any] = {}
    for key in ("max_tokens", "min_tokens"):
        if key in params and params[key] is not None:
            v = params[key]
            if isinstance(v, bool) or not isinstance(v, int) or v < (1 if key == "max_tokens" else 0):
                raise ValueError(f"{where} returned sampling_params.{key} = {v!r}: expected an int "
                                 f">= {1 if key == 'max_tokens' else 0}")
            out[key] = v
    if "ignore_eos" in params:
        if not isinstance(params["ignore_eos"], bool):
            raise ValueError(f"{where} returned sampling_params.ignore_eos = {params['ignore_eos']!r}: expected a bool")
        out["ignore_eos"] = params["ignore_eos"]
    return out


def load_agent_class(agent_func_path: str | Path) -> type:
    """The per-trajectory environment class defined by an OpenRLHF agent file."""
    from openrlhf.utils.agent import AgentInstanceBase

    path = Path(agent_func_path)
    if path.suffix != ".py" or not path.is_file():
        raise ValueError(f"agent_func_path: '{agent_func_path}' is not a Python file; pass the path of an "
                         "OpenRLHF agent file defining AgentInstance(AgentInstanceBase)")
    name = f"war_agent_{abs(hash(str(path.resolve())))}"
    spec = importlib.util.spec_from_file_location(name, path)
    module = importlib.util.module_from_spec(spec)
    sys.modules[name] = module  # dataclasses / pickling inside the agent file need it
    spec.loader.exec_module(module)
    cls = getattr(module, "AgentInstance", None)
    if cls is None and hasattr(module, "AgentExecutor"):
        cls = getattr(module.AgentExecutor(), "agent_instance_cls", None)
    if not (isinstance(cls, type) and issubclass(cls, AgentInstanceBase)):
        raise ValueError(f"agent_func_path: '{agent_func_path}' defines no AgentInstance(AgentInstanceBase) "
                         "and no AgentExecutor(MultiTurnAgentExecutor) with one")
    return cls


class AgentContractError(ValueError):
    """The agent's ``reset`` / ``step`` returned something outside OpenRLHF's contract: the
    agent file's bug, never a tool result; the episode ends and is not trained on."""


def _scalar(value: Any, key: str, where: str) -> float:
    try:
        if hasattr(value, "numel") and value.numel() != 1:
            raise ValueError(f"{value.numel()} elements")
        out = float(value.item()) if hasattr(value, "item") else float(value)
    except (TypeError, ValueError) as exc:
        raise AgentContractError(f"{where} returned '{key}' = {str(value)[:80]}: expected a number or a "
                                 f"1-element tensor ({exc})") from None
    if not math.isfinite(out):
        raise AgentContractError(f"{where} returned '{key}' = {out}: rewards and logs must be finite numbers")
    return out


def _flag(value: Any, key: str, where: str) -> bool:
    if isinstance(value, bool):
        return value
    if isinstance(value, int) and value in (0, 1):
        return bool(value)
    if hasattr(value, "numel") and value.numel() == 1 and ("bool" in str(value.dtype) or "int" in str(value.dtype)) \
            and int(value.item()) in (0, 1):
        return bool(value.item())
    raise AgentContractError(f"{where} returned '{key}' = {value!r} ({type(value).__name__}): expected a bool "
                             "(a string such as 'False' would end the episode)")


def check_step_result(result: Any, where: str = "step()") -> dict[str, Any]:
    """Normalise ``step()``'s dict: finite floats for rewards/scores/logs, str feedback, bool
    done. ``where`` names the agent (its file) in the :class:`AgentContractError` raised for
    anything else."""
    if not isinstance(result, Mapping):
        raise AgentContractError(f"{where} returned {type(result).__name__}: expected a dict with keys "
                                 f"{', '.join(REQUIRED_STEP_KEYS)}")
    missing = [k for k in REQUIRED_STEP_KEYS if k not in result]
    if missing:
        raise AgentContractError(f"{where} result is missing key '{missing[0]}' "
                                 f"(required: {', '.join(REQUIRED_STEP_KEYS)})")
    feedback = result["environment_feedback"]
    if not isinstance(feedback, str):
        raise AgentContractError(f"{where} returned environment_feedback of type {type(feedback).__name__}: "
                                 "expected str")
    reward = _scalar(result["rewards"], "rewards", where)
    scores = result.get("scores")
    extra = result.get("extra_logs") or {}
    if not isinstance(extra, Mapping):
        raise AgentContractError(f"{where} returned extra_logs of type {type(extra).__name__}: expected a dict")
    return {
        "rewards": reward,
        "scores": None if scores is None else _scalar(scores, "scores", where),
        "environment_feedback": feedback,
        "done": _flag(result["done"], "done", where),
        "sampling_params": result.get("sampling_params"),
        "extra_logs": {str(k): _scalar(v, f"extra_logs.{k}", where) for k, v in extra.items()},
    }
