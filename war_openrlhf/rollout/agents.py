"""Environments: OpenRLHF 0.11.2's ``AgentInstanceBase`` API, loaded from an agent file.

An OpenRLHF agent file (``--agent_func_path``) defines ``AgentInstance(AgentInstanceBase)``
(one instance per trajectory: ``await reset(states)`` then ``await step(states)`` per turn)
and ``AgentExecutor(MultiTurnAgentExecutor)``. The pool runs the same file unchanged: it takes
the instance class the executor runs and drives it turn by turn itself (``episode.py``), so
that every turn can be dispatched to any engine. What an agent sees is what OpenRLHF's
``MultiTurnAgentExecutor.execute`` (openrlhf/utils/agent.py:37-185) shows it, or the file is
refused with the reason:

* ``reset`` gets ``{"observation", "label"}``; only its ``observation`` is read (agent.py:42-44).
* ``step`` gets ``observation_text``, ``action_text`` (vLLM's ``.text`` of the turn,
  :mod:`.action_text`), ``label`` and ``sampling_params``: a ``vllm.SamplingParams``, the one
  OpenRLHF's generator builds (:func:`initial_sampling_params`), with ``max_tokens`` set to the
  turn's budget before each turn (agent.py:94, 114-119). It is the episode's live object, as
  there: a change made to it in place reaches the episode's later turns. (OpenRLHF shares one
  object between the samples of a prompt, vllm_engine.py:194-204; here each episode has its own.)
* A ``SamplingParams`` that ``step`` returns replaces it for the next turns, every field sent to
  the engine except ``max_tokens``, which each turn sets again (agent.py:94, 165-166; ``n`` > 1
  samples more but only the first output is used, as there). Refused: a dict or another type
  (OpenRLHF fails setting ``.max_tokens`` on it) and ``output_kind=DELTA`` (a turn would keep only
  its last chunk, vllm_engine.py:173-177).
* The trajectory's ``extra_logs`` are the last step's (agent.py:127); ``rewards`` add up and
  ``scores`` is the last step's, else the summed reward (agent.py:122-123).
* A file whose ``AgentExecutor`` overrides ``execute`` is refused (:func:`load_agent_class`): the
  pool never calls it.

**Where agents run.** OpenRLHF runs agents inside each vLLM engine actor, on the actor's event
loop. Here they run in the process that runs the pool (the trainer's), each episode's agent on
a thread and event loop of its own (``episode.AgentThread``): the agent file's module is loaded
once in that process, so module-level state is shared by every episode of every engine and
reached from several threads at once (guard it with a ``threading.Lock``, never an ``asyncio``
one), and the agent sees that process's environment, working directory and devices.

**WAR's own key.** ``reset`` / ``step`` may return ``war_turn_limits``, a dict bounding the
*next* turn only (:data:`TURN_LIMIT_KEYS`; an environment replaying recorded turn lengths sets
``max_tokens = min_tokens = L`` with ``ignore_eos``); the context budget still applies.
OpenRLHF's executor never reads it (it sets ``max_tokens`` itself), so a file that needs the
same bound there does it in a custom ``execute`` and declares ``war_bypass_execute = True`` on
its ``AgentExecutor`` (examples/trace_replay/agent.py).

:func:`check_step_result` validates ``step``'s dict and names a missing or malformed key.
"""

from __future__ import annotations

import functools
import importlib.util
import math
import sys
from pathlib import Path
from typing import Any, Mapping

REQUIRED_STEP_KEYS = ("rewards", "environment_feedback", "done")
#: The WAR-only key of ``reset`` / ``step`` results that bounds the next turn.
WAR_TURN_LIMITS = "war_turn_limits"
#: The WAR-only key of the ``reset`` states: the episode's sample number within its GRPO group
#: (0..n-1), so that an agent that replays or assigns work per sample can do it the same way in
#: any process (OpenRLHF's executor passes only ``observation`` and ``label``; agents ignore it).
WAR_SAMPLE_INDEX = "war_sample_index"
#: Keys of ``war_turn_limits``.
TURN_LIMIT_KEYS = ("max_tokens", "min_tokens", "ignore_eos")
#: ``SamplingParams`` fields vLLM sets itself (``__post_init__``, ``update_from_tokenizer``), never
#: an input: not sent to the engine, which builds its own ``SamplingParams(**fields)``.
_DERIVED_FIELDS = ("output_text_buffer_length",)


@functools.lru_cache(maxsize=1)
def _default_sampling_params():
    """vLLM's defaults, the reference for which fields a turn's request must carry."""
    from vllm import SamplingParams

    return SamplingParams()


@functools.lru_cache(maxsize=1)
def _request_fields() -> tuple[type, tuple[tuple[str, int, Any], ...]]:
    """``SamplingParams`` and, for each field a request may carry, its name, its position in the
    struct's tuple form and vLLM's default: read once, so a turn compares one tuple
    (``msgspec.structs.astuple``, a C call) instead of getting 2 x 39 attributes."""
    from vllm import SamplingParams

    default = _default_sampling_params()
    return SamplingParams, tuple((name, i, getattr(default, name))
                                 for i, name in enumerate(SamplingParams.__struct_fields__)
                                 if not name.startswith("_") and name not in _DERIVED_FIELDS)


class AgentContractError(ValueError):
    """The agent's ``reset`` / ``step`` returned something outside OpenRLHF's contract: the
    agent file's bug, never a tool result; the episode ends and is not trained on."""


def turn_limits(limits: Any, where: str) -> dict[str, Any]:
    """The next-turn bounds of a ``war_turn_limits`` value (``{}`` for None)."""
    if limits is None:
        return {}
    if not isinstance(limits, Mapping):
        raise AgentContractError(f"{where} returned {WAR_TURN_LIMITS} of type {type(limits).__name__}: expected "
                                 f"a dict with keys among {', '.join(TURN_LIMIT_KEYS)}")
    unknown = sorted(str(k) for k in limits if k not in TURN_LIMIT_KEYS)
    if unknown:
        raise AgentContractError(f"{where} returned {WAR_TURN_LIMITS}.{unknown[0]}: not one of "
                                 f"{', '.join(TURN_LIMIT_KEYS)} (other fields go in sampling_params)")
    out: dict[str, Any] = {}
    for key in ("max_tokens", "min_tokens"):
        if limits.get(key) is not None:
            v = limits[key]
            if isinstance(v, bool) or not isinstance(v, int) or v < (1 if key == "max_tokens" else 0):
                raise AgentContractError(f"{where} returned {WAR_TURN_LIMITS}.{key} = {v!r}: expected an int "
                                         f">= {1 if key == 'max_tokens' else 0}")
            out[key] = v
    if "ignore_eos" in limits:
        if not isinstance(limits["ignore_eos"], bool):
            raise AgentContractError(f"{where} returned {WAR_TURN_LIMITS}.ignore_eos = {limits['ignore_eos']!r}: "
                                     "expected a bool")
        out["ignore_eos"] = limits["ignore_eos"]
    return out


def initial_sampling_params(max_new_tokens: int | None, temperature: float, top_p: float):
    """The ``SamplingParams`` OpenRLHF's generator hands the executor of every sample
    (openrlhf/trainer/ppo_utils/samples_generator.py:199-207, with the keyword arguments
    train_ppo_ray.py:159-165 gives it: no ``top_k``, ``min_new_tokens`` nor ``skip_special_tokens``).
    ``logprobs`` is None, as there unless ``--algo.advantage.is_correction_level`` is set: the
    pool asks the engine for the sampled token's logprob on its own."""
    from vllm import SamplingParams

    return SamplingParams(temperature=temperature, top_p=top_p, top_k=-1, max_tokens=max_new_tokens,
                          min_tokens=1, skip_special_tokens=False, logprobs=None)


def check_sampling_params(params: Any, where: str):
    """``step``'s ``sampling_params``: None (keep the current ones) or a ``SamplingParams`` the
    engine can run. OpenRLHF ignores a falsy value (agent.py:165) and sets ``.max_tokens`` on any
    other (agent.py:94), which only a ``SamplingParams`` survives."""
    if params is None:
        return None
    try:
        if not params:  # OpenRLHF's own test (agent.py:165)
            return None
    except (TypeError, ValueError):  # no truth value (an array): refused below
        pass
    from vllm import SamplingParams

    if not isinstance(params, SamplingParams):
        hint = (" (a dict fails there: build vllm.SamplingParams(**fields), or return "
                "states['sampling_params'] after changing it)") if isinstance(params, Mapping) else ""
        raise AgentContractError(f"{where} returned sampling_params of type {type(params).__name__}: expected a "
                                 f"vllm.SamplingParams, as OpenRLHF's executor sets .max_tokens on it "
                                 f"(openrlhf/utils/agent.py:94){hint}")
    if getattr(params.output_kind, "name", "") == "DELTA":
        raise AgentContractError(f"{where} returned sampling_params.output_kind = DELTA: a turn would keep only "
                                 "its last chunk of tokens (OpenRLHF keeps the last RequestOutput, "
                                 "vllm_engine.py:173-177); use CUMULATIVE or FINAL_ONLY")
    return params


def engine_sampling_kwargs(params: Any, limits: Mapping[str, Any], seed: int | None, where: str) -> dict[str, Any]:
    """One turn's request to the engine: ``SamplingParams(**kwargs)`` there equals ``params`` (every
    field that differs from vLLM's default, and ``max_tokens``), bounded by WAR's ``limits``.
    ``seed``: the pool's per-turn seed, used when the agent set none. ``logprobs`` None asks for
    the sampled token's only (what PPO needs). A combination vLLM refuses is the agent's error."""
    import msgspec

    SamplingParams, fields = _request_fields()
    values = msgspec.structs.astuple(params)
    out = {name: values[i] for name, i, default in fields if name == "max_tokens" or values[i] != default}
    if "max_tokens" in limits:
        out["max_tokens"] = min(out["max_tokens"], limits["max_tokens"])
    if "min_tokens" in limits:
        out["min_tokens"] = min(limits["min_tokens"], out["max_tokens"])
    if "ignore_eos" in limits:
        out["ignore_eos"] = limits["ignore_eos"]
    if out.get("seed") is None and seed is not None:
        out["seed"] = seed
    if out.get("logprobs") is None:
        out["logprobs"] = 0
    try:
        SamplingParams(**out)
    except (ValueError, TypeError) as exc:
        raise AgentContractError(f"{where}sampling_params: vLLM refuses them for this turn: {exc}") from None
    return out


def load_agent_class(agent_func_path: str | Path) -> type:
    """The per-trajectory environment class an OpenRLHF agent file runs: its ``AgentExecutor``'s
    ``agent_instance_cls`` (what OpenRLHF instantiates, agent.py:39), or its ``AgentInstance``
    when it defines no executor."""
    from openrlhf.utils.agent import AgentExecutorBase, AgentInstanceBase, MultiTurnAgentExecutor

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
    executor = getattr(module, "AgentExecutor", None)
    if executor is not None:
        if not (isinstance(executor, type) and issubclass(executor, AgentExecutorBase)):
            raise ValueError(f"agent_func_path: '{agent_func_path}': AgentExecutor must inherit from "
                             "AgentExecutorBase (OpenRLHF refuses it: openrlhf/trainer/ray/vllm_engine.py:29)")
        if executor.execute is not MultiTurnAgentExecutor.execute and not getattr(executor, "war_bypass_execute",
                                                                                  False):
            raise ValueError(
                f"agent_func_path: '{agent_func_path}': AgentExecutor overrides execute(), which WAR's pool never "
                "calls: it runs every turn itself (one engine dispatch per turn) through the instance's reset() "
                "and step(), so what execute() changes would silently not happen. Move it into AgentInstance "
                f"(a per-turn length bound: return '{WAR_TURN_LIMITS}' from reset()/step()); if the file already "
                "does the same for WAR that way, set war_bypass_execute = True on AgentExecutor")
        cls = getattr(executor(), "agent_instance_cls", cls)
    if not (isinstance(cls, type) and issubclass(cls, AgentInstanceBase)):
        raise ValueError(f"agent_func_path: '{agent_func_path}' defines no AgentInstance(AgentInstanceBase) "
                         "and no AgentExecutor(MultiTurnAgentExecutor) with one")
    return cls


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
    done, a ``SamplingParams`` or None, the WAR turn limits. ``where`` names the agent (its file)
    in the :class:`AgentContractError` raised for anything else."""
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
        "environment_images": result.get("environment_images"),
        "done": _flag(result["done"], "done", where),
        "sampling_params": check_sampling_params(result.get("sampling_params"), where),
        WAR_TURN_LIMITS: turn_limits(result.get(WAR_TURN_LIMITS), where),
        "extra_logs": {str(k): _scalar(v, f"extra_logs.{k}", where) for k, v in extra.items()},
    }
