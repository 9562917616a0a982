"""Parametric generator of synthetic agent workloads for the cluster simulator.

Why: a dispatch benchmark tuned on one recorded trace overfits to it (its prompt
lengths, turn counts, tool timings). :func:`generate_workload` turns a
:class:`WorkloadSpec` into :class:`GeneratedTrajectory` objects that
:func:`~war_openrlhf.simulation.cluster.simulate` replays, so the same policies can
be measured on families of workloads that differ in the dimensions that matter for
placement: shared-prefix size, group size, number of turns, response and
observation lengths, context growth and tool latency.

Structure of a generated workload
---------------------------------
* One **system prompt** of ``system_prompt_tokens`` random tokens, shared by every
  group (a fixed agent scaffold: instructions, tool schemas).
* ``n_groups`` **groups** (GRPO groups, one task each): a task prompt of
  ``task_prompt_tokens`` tokens after the system prompt. Every sample of a group
  starts from exactly that prompt (system + task); samples diverge from their first
  response token on (first response tokens are distinct within a group).
* Each **sample** (trajectory) draws its turn count from ``turns``; turn ``t`` reads
  the whole stream so far and writes ``response_tokens`` tokens; the environment then
  appends ``observation_tokens`` tokens, and waits a tool latency drawn from
  ``tool_latency_s`` (plus ``env_token_delay_s`` per observation token) before the
  next turn. The last turn has no observation (``env_token_count == 0``). Contexts
  are exact prefixes: ``context[t + 1] == context[t] + response[t] + env[t]``, and
  every array of a trajectory is a read-only int32 view of one array, as in
  :mod:`war_openrlhf.traces.turns`.
* ``max_context_tokens`` caps a turn's context + response (vLLM's ``max_model_len``):
  a trajectory ends before the turn that would not fit (the first turn's response is
  truncated to fit instead); an observation after which not even one response token
  would fit ends the trajectory there.

Token ids are uniform in ``[vocab_low, vocab_high)``: the only token-level structure
is the prefix structure above (random tokens share no suffixes, so draft proposers
learn nothing from these workloads; use recorded traces for speculation).

Determinism: everything is drawn from generators seeded with ``(seed, stream,
group, sample)``, so a workload is a pure function of its spec; group ``g`` is the
same whatever ``n_groups`` is (a scaled-up workload extends a smaller one), and the
token contents, lengths and tool latencies come from separate streams (changing the
latency distribution leaves the tokens as they were).

API
---
``LengthDist``           token counts (or turn counts, group sizes): fixed, uniform,
                         lognormal, Pareto, geometric; ``sample(rng, n)`` clips to
                         ``[floor, cap]``.
``LatencyDist``          tool latencies in seconds: fixed, uniform, lognormal, Pareto,
                         with stragglers (probability ``straggler_p``, times
                         ``straggler_mult``).
``WorkloadSpec``         the parameters (validated; ``ValueError`` names the field).
``generate_workload``    ``(spec, id_prefix="") -> list[GeneratedTrajectory]``.
``GeneratedTrajectory``  a ``TokenizedTrajectory`` with ``tool_delays_s`` (one per turn
                         but the last), which the simulator replays instead of its own
                         delay model.
``NAMED_SPECS``          five workload families for the benchmark (see below).
``scaled``               a spec with ``n_groups`` groups, or with the fewest groups that
                         give at least ``n_trajectories`` trajectories.
``workload_stats``       summary numbers of a generated workload (for reports).
"""

from __future__ import annotations

import dataclasses
import math
from dataclasses import dataclass, field
from typing import Dict, List, Optional, Sequence, Union

import numpy as np

from ..traces import TokenizedTrajectory, Turn

__all__ = [
    "GeneratedTrajectory",
    "LatencyDist",
    "LengthDist",
    "MAX_GROUP_SIZE",
    "NAMED_SPECS",
    "WorkloadSpec",
    "generate_workload",
    "group_sizes",
    "scaled",
    "workload_stats",
]

#: Largest GRPO group a spec may ask for.
MAX_GROUP_SIZE = 64

_LENGTH_KINDS = ("fixed", "uniform", "lognormal", "pareto", "geometric")
_LATENCY_KINDS = ("fixed", "uniform", "lognormal", "pareto")

# Random streams (the second seed word), so that each kind of draw is independent.
_S_SYSTEM, _S_TASK, _S_GROUP_SIZE, _S_TURNS, _S_RESP, _S_ENV, _S_DELAY, _S_TOKENS = range(8)


def _is_int(x) -> bool:
    return isinstance(x, (int, np.integer)) and not isinstance(x, bool)


def _is_num(x) -> bool:
    return isinstance(x, (int, float, np.integer, np.floating)) and not isinstance(x, bool) \
        and math.isfinite(float(x))


def _check_shape(owner: str, kind: str, kinds: Sequence[str], value, high, sigma, alpha) -> None:
    if kind not in kinds:
        raise ValueError(f"{owner}.kind must be one of {', '.join(kinds)}; got {kind!r}")
    if not _is_num(value):
        raise ValueError(f"{owner}.value must be a finite number, got {value!r}")
    if kind == "uniform":
        if not _is_num(high) or not float(high) >= float(value):
            raise ValueError(f"{owner}.high must be a number >= value ({value!r}) for a uniform "
                             f"distribution, got {high!r}")
    if kind == "lognormal" and not (_is_num(sigma) and float(sigma) > 0):
        raise ValueError(f"{owner}.sigma must be > 0 for a lognormal distribution, got {sigma!r}")
    if kind == "pareto" and not (_is_num(alpha) and float(alpha) > 0):
        raise ValueError(f"{owner}.alpha must be > 0 for a Pareto distribution, got {alpha!r}")


def _raw(kind: str, value: float, high: float, sigma: float, alpha: float,
         rng: np.random.Generator, n: int) -> np.ndarray:
    """``n`` float draws of the (unclipped) distribution."""
    if kind == "fixed":
        return np.full(n, float(value))
    if kind == "uniform":
        return rng.uniform(float(value), float(high), n)
    if kind == "lognormal":
        return np.exp(rng.normal(math.log(value), sigma, n))
    if kind == "pareto":  # classic Pareto: minimum ``value``, tail index ``alpha``
        return float(value) * (1.0 + rng.pareto(alpha, n))
    if kind == "geometric":  # support 1, 2, ...; mean ``value``
        return rng.geometric(1.0 / float(value), n).astype(np.float64)
    raise AssertionError(kind)


@dataclass(frozen=True)
class LengthDist:
    """A distribution of positive integers (token counts, turn counts, group sizes).

    ``kind`` and the meaning of ``value``:

    * ``fixed``: always ``value``;
    * ``uniform``: integers uniform in ``[value, high]`` (both included);
    * ``lognormal``: median ``value``, log-space standard deviation ``sigma``;
    * ``pareto``: heavy-tailed, minimum ``value`` and tail index ``alpha``
      (``P(X > x) = (value / x) ** alpha``; median ``value * 2 ** (1 / alpha)``);
    * ``geometric``: support 1, 2, ... with mean ``value`` (turn counts).

    Draws are rounded down (``uniform``: each integer equally likely) and clipped to
    ``[floor, cap]``. Use the class-method constructors: ``LengthDist.lognormal(90,
    0.5, cap=1024)``.
    """

    kind: str = "fixed"
    value: float = 1
    high: float = 0.0
    sigma: float = 0.0
    alpha: float = 0.0
    floor: int = 1
    cap: int = 1 << 20

    def __post_init__(self) -> None:
        _check_shape("LengthDist", self.kind, _LENGTH_KINDS, self.value, self.high, self.sigma,
                     self.alpha)
        if not _is_int(self.floor) or self.floor < 1:
            raise ValueError(f"LengthDist.floor must be an int >= 1, got {self.floor!r}")
        if not _is_int(self.cap) or self.cap < self.floor:
            raise ValueError(f"LengthDist.cap must be an int >= floor ({self.floor}), "
                             f"got {self.cap!r}")
        if self.kind in ("lognormal", "pareto", "geometric") and not float(self.value) > 0:
            raise ValueError(f"LengthDist.value must be > 0 for a {self.kind} distribution, "
                             f"got {self.value!r}")
        if self.kind == "geometric" and not float(self.value) >= 1:
            raise ValueError(f"LengthDist.value (the mean) must be >= 1 for a geometric "
                             f"distribution, got {self.value!r}")

    # -- constructors ------------------------------------------------------------------------
    @classmethod
    def fixed(cls, n: int) -> "LengthDist":
        return cls("fixed", n, cap=max(int(n), 1))

    @classmethod
    def uniform(cls, low: int, high: int) -> "LengthDist":
        return cls("uniform", low, high=high, floor=max(1, int(low)), cap=max(int(high), 1))

    @classmethod
    def lognormal(cls, median: float, sigma: float, cap: int = 1 << 20,
                  floor: int = 1) -> "LengthDist":
        return cls("lognormal", median, sigma=sigma, floor=floor, cap=cap)

    @classmethod
    def pareto(cls, minimum: float, alpha: float, cap: int = 1 << 20) -> "LengthDist":
        return cls("pareto", minimum, alpha=alpha, floor=max(1, int(minimum)), cap=cap)

    @classmethod
    def geometric(cls, mean: float, cap: int = 1 << 20, floor: int = 1) -> "LengthDist":
        return cls("geometric", mean, floor=floor, cap=cap)

    # -- sampling ----------------------------------------------------------------------------
    def sample(self, rng: np.random.Generator, n: int) -> np.ndarray:
        """``n`` draws as an int64 array, each in ``[floor, cap]``."""
        if self.kind == "uniform":
            x = rng.integers(int(math.ceil(self.value)), int(math.floor(self.high)) + 1, n)
        else:
            x = np.floor(_raw(self.kind, self.value, self.high, self.sigma, self.alpha, rng, n))
        return np.clip(x, self.floor, self.cap).astype(np.int64)

    def mean(self, n: int = 20_000, seed: int = 12345) -> float:
        """Mean of the clipped distribution (exact for fixed/uniform, else Monte Carlo)."""
        if self.kind == "fixed":
            return float(min(max(int(self.value), self.floor), self.cap))
        return float(self.sample(np.random.default_rng(seed), n).mean())


@dataclass(frozen=True)
class LatencyDist:
    """A distribution of tool latencies in seconds, with stragglers.

    ``kind``/``value``/``high``/``sigma``/``alpha`` as in :class:`LengthDist` (no
    ``geometric``; no rounding). A draw is clipped to ``[0, cap_s]``, then with
    probability ``straggler_p`` multiplied by ``straggler_mult`` (a tool call that hit a
    slow path: a build, a timeout and retry, a slow web page), so stragglers may exceed
    ``cap_s``.
    """

    kind: str = "fixed"
    value: float = 1.0
    high: float = 0.0
    sigma: float = 0.0
    alpha: float = 0.0
    cap_s: float = 600.0
    straggler_p: float = 0.0
    straggler_mult: float = 10.0

    def __post_init__(self) -> None:
        _check_shape("LatencyDist", self.kind, _LATENCY_KINDS, self.value, self.high,
                     self.sigma, self.alpha)
        if not float(self.value) >= 0:
            raise ValueError(f"LatencyDist.value must be >= 0, got {self.value!r}")
        if self.kind in ("lognormal", "pareto") and not float(self.value) > 0:
            raise ValueError(f"LatencyDist.value must be > 0 for a {self.kind} distribution, "
                             f"got {self.value!r}")
        if not _is_num(self.cap_s) or not float(self.cap_s) >= 0:
            raise ValueError(f"LatencyDist.cap_s must be a number >= 0, got {self.cap_s!r}")
        if not _is_num(self.straggler_p) or not 0 <= float(self.straggler_p) <= 1:
            raise ValueError(f"LatencyDist.straggler_p must be in [0, 1], "
                             f"got {self.straggler_p!r}")
        if not _is_num(self.straggler_mult) or not float(self.straggler_mult) >= 1:
            raise ValueError(f"LatencyDist.straggler_mult must be >= 1, "
                             f"got {self.straggler_mult!r}")

    @classmethod
    def fixed(cls, seconds: float) -> "LatencyDist":
        return cls("fixed", seconds)

    @classmethod
    def lognormal(cls, median_s: float, sigma: float, cap_s: float = 600.0,
                  straggler_p: float = 0.0, straggler_mult: float = 10.0) -> "LatencyDist":
        return cls("lognormal", median_s, sigma=sigma, cap_s=cap_s, straggler_p=straggler_p,
                   straggler_mult=straggler_mult)

    @classmethod
    def pareto(cls, minimum_s: float, alpha: float, cap_s: float = 600.0,
               straggler_p: float = 0.0, straggler_mult: float = 10.0) -> "LatencyDist":
        return cls("pareto", minimum_s, alpha=alpha, cap_s=cap_s, straggler_p=straggler_p,
                   straggler_mult=straggler_mult)

    def sample(self, rng: np.random.Generator, n: int) -> np.ndarray:
        """``n`` latencies (float64 seconds). Always draws the straggler coin flips, so
        the base draws do not depend on ``straggler_p``."""
        x = np.clip(_raw(self.kind, self.value, self.high, self.sigma, self.alpha, rng, n),
                    0.0, float(self.cap_s))
        straggle = rng.random(n) < float(self.straggler_p)
        return np.where(straggle, x * float(self.straggler_mult), x)

    def scaled(self, factor: float) -> "LatencyDist":
        """The same distribution with every latency times ``factor`` (> 0)."""
        if not (_is_num(factor) and factor > 0):
            raise ValueError(f"factor must be > 0, got {factor!r}")
        return dataclasses.replace(self, value=self.value * factor, high=self.high * factor,
                                   cap_s=self.cap_s * factor)


@dataclass(frozen=True)
class WorkloadSpec:
    """Parameters of a synthetic agent workload (see the module docstring).

    Defaults describe a medium tool-using agent: 8 groups of 4, a 1k-token shared
    system prompt, ~200-token task prompts, 2-8 turns of ~128-token responses and
    ~256-token observations, ~1 s tools, a 32k context.
    """

    n_groups: int = 8
    #: samples per GRPO group: an int, or a LengthDist drawn per group (e.g. uniform(1, 2))
    group_size: Union[int, LengthDist] = 4
    #: tokens of the system prompt shared by every group (0: none)
    system_prompt_tokens: int = 1024
    #: tokens of each group's task prompt (after the system prompt)
    task_prompt_tokens: LengthDist = LengthDist.lognormal(200, 0.5, cap=2048)
    #: model calls per trajectory, drawn per sample (before the context cap)
    turns: LengthDist = LengthDist.uniform(2, 8)
    #: tokens the model writes per turn
    response_tokens: LengthDist = LengthDist.lognormal(128, 0.7, cap=2048)
    #: tokens the environment appends after a turn (tool output, user reply)
    observation_tokens: LengthDist = LengthDist.lognormal(256, 0.8, cap=4096)
    #: seconds between a turn's end and the next turn's arrival
    tool_latency_s: LatencyDist = LatencyDist.lognormal(1.0, 0.5, cap_s=30.0)
    #: extra seconds per observation token (e.g. a simulated user writing its reply)
    env_token_delay_s: float = 0.0
    #: a turn's context + response never exceeds this (vLLM's max_model_len)
    max_context_tokens: int = 32768
    #: token ids are uniform in [vocab_low, vocab_high)
    vocab_low: int = 1000
    vocab_high: int = 150000
    seed: int = 0

    def __post_init__(self) -> None:
        def bad(name: str, what: str) -> ValueError:
            return ValueError(f"WorkloadSpec.{name} must be {what}, got {getattr(self, name)!r}")

        if not _is_int(self.n_groups) or self.n_groups < 1:
            raise bad("n_groups", "an int >= 1")
        gs = self.group_size
        if isinstance(gs, LengthDist):
            if gs.cap > MAX_GROUP_SIZE:
                raise bad("group_size", f"a LengthDist with cap <= {MAX_GROUP_SIZE}")
        elif not _is_int(gs) or not 1 <= gs <= MAX_GROUP_SIZE:
            raise bad("group_size", f"an int in [1, {MAX_GROUP_SIZE}] or a LengthDist")
        if not _is_int(self.system_prompt_tokens) or self.system_prompt_tokens < 0:
            raise bad("system_prompt_tokens", "an int >= 0")
        for name in ("task_prompt_tokens", "turns", "response_tokens", "observation_tokens"):
            if not isinstance(getattr(self, name), LengthDist):
                raise bad(name, "a LengthDist")
        if not isinstance(self.tool_latency_s, LatencyDist):
            raise bad("tool_latency_s", "a LatencyDist")
        if not _is_num(self.env_token_delay_s) or self.env_token_delay_s < 0:
            raise bad("env_token_delay_s", "a number >= 0")
        if not _is_int(self.vocab_low) or self.vocab_low < 0:
            raise bad("vocab_low", "an int >= 0")
        if not _is_int(self.vocab_high) or not self.vocab_low < self.vocab_high \
                or self.vocab_high > np.iinfo(np.int32).max:
            raise bad("vocab_high", f"an int in ({self.vocab_low}, 2**31 - 1]")
        if self.vocab_high - self.vocab_low < MAX_GROUP_SIZE:
            raise bad("vocab_high", f"at least vocab_low + {MAX_GROUP_SIZE} (group members need "
                                    f"distinct first response tokens)")
        need = self.system_prompt_tokens + self.task_prompt_tokens.cap + 1
        if not _is_int(self.max_context_tokens) or self.max_context_tokens < need:
            raise bad("max_context_tokens", f"an int >= system_prompt_tokens + "
                                            f"task_prompt_tokens.cap + 1 = {need}")
        if not _is_int(self.seed) or self.seed < 0:
            raise bad("seed", "an int >= 0")

    def group_size_dist(self) -> LengthDist:
        gs = self.group_size
        return gs if isinstance(gs, LengthDist) else LengthDist.fixed(int(gs))


@dataclass(frozen=True, eq=False)
class GeneratedTrajectory(TokenizedTrajectory):
    """A synthetic trajectory: its turns plus the tool latency after each turn but the
    last (``len(tool_delays_s) == len(turns) - 1``), which
    :func:`~war_openrlhf.simulation.cluster.simulate` waits instead of its own model."""

    tool_delays_s: tuple = field(default=())


# ---- generation ------------------------------------------------------------------------------
def _rng(spec: WorkloadSpec, stream: int, *keys: int) -> np.random.Generator:
    return np.random.default_rng([int(spec.seed), stream, *keys])


def _tokens(spec: WorkloadSpec, rng: np.random.Generator, n: int) -> np.ndarray:
    return rng.integers(spec.vocab_low, spec.vocab_high, int(n), dtype=np.int32)


def group_sizes(spec: WorkloadSpec, n_groups: Optional[int] = None) -> List[int]:
    """The size of each of the first ``n_groups`` (default ``spec.n_groups``) groups."""
    dist = spec.group_size_dist()
    n = spec.n_groups if n_groups is None else int(n_groups)
    return [int(dist.sample(_rng(spec, _S_GROUP_SIZE, g), 1)[0]) for g in range(n)]


def _plan(spec: WorkloadSpec, prompt_len: int, g: int, k: int):
    """Per-turn (context length, response length, env tokens) and delays of sample k."""
    n_turns = int(spec.turns.sample(_rng(spec, _S_TURNS, g, k), 1)[0])
    resp = spec.response_tokens.sample(_rng(spec, _S_RESP, g, k), n_turns)
    env = spec.observation_tokens.sample(_rng(spec, _S_ENV, g, k), n_turns)
    lat = spec.tool_latency_s.sample(_rng(spec, _S_DELAY, g, k), n_turns)
    cap = spec.max_context_tokens
    spans: List[List[int]] = []
    n = prompt_len
    for t in range(n_turns):
        r = int(resp[t])
        if n + r > cap:
            if t > 0:
                break
            r = cap - n  # >= 1: validated
        e = int(env[t]) if t + 1 < n_turns else 0
        if e and n + r + e + 1 > cap:  # no room for one more response token
            e = 0
        spans.append([n, r, e])
        n += r + e
        if t + 1 < n_turns and e == 0:
            break
    spans[-1][2] = 0
    delays = tuple(float(lat[t]) + spec.env_token_delay_s * spans[t][2]
                   for t in range(len(spans) - 1))
    return spans, delays


def generate_workload(spec: WorkloadSpec, id_prefix: str = "") -> List[GeneratedTrajectory]:
    """The trajectories of ``spec``: groups in order, samples of a group in order.

    Ids: group ``f"{id_prefix}g{g:05d}"``, trajectory ``f"{id_prefix}g{g:05d}s{k:02d}"``
    (give workloads distinct prefixes to replay them together)."""
    system = _tokens(spec, _rng(spec, _S_SYSTEM), spec.system_prompt_tokens)
    out: List[GeneratedTrajectory] = []
    for g, size in enumerate(group_sizes(spec)):
        task_rng = _rng(spec, _S_TASK, g)
        task = _tokens(spec, task_rng, spec.task_prompt_tokens.sample(task_rng, 1)[0])
        prompt = np.concatenate([system, task])
        gid = f"{id_prefix}g{g:05d}"
        first_tokens: set = set()
        for k in range(size):
            spans, delays = _plan(spec, len(prompt), g, k)
            c, r, e = spans[-1]
            tok_rng = _rng(spec, _S_TOKENS, g, k)
            tail = _tokens(spec, tok_rng, c + r - len(prompt))
            # Samples of a group diverge from their first response token on.
            while int(tail[0]) in first_tokens:
                tail[0] = tok_rng.integers(spec.vocab_low, spec.vocab_high)
            first_tokens.add(int(tail[0]))
            stream = np.concatenate([prompt, tail])
            stream.flags.writeable = False
            turns = [Turn(context_token_ids=stream[:c], response_token_ids=stream[c:c + r],
                          env_token_count=e) for c, r, e in spans]
            out.append(GeneratedTrajectory(f"{gid}s{k:02d}", gid, turns, tool_delays_s=delays))
    return out


def scaled(spec: WorkloadSpec, n_groups: Optional[int] = None, *,
           n_trajectories: Optional[int] = None, seed: Optional[int] = None) -> WorkloadSpec:
    """``spec`` with ``n_groups`` groups, or with the fewest groups whose sizes add up to at
    least ``n_trajectories`` (exactly one of the two), and optionally another ``seed``. The
    first groups of the result are those of ``spec`` (same seed)."""
    if (n_groups is None) == (n_trajectories is None):
        raise ValueError("scaled: give exactly one of n_groups and n_trajectories")
    changes: Dict[str, int] = {}
    if seed is not None:
        changes["seed"] = seed
    if n_trajectories is not None:
        if not _is_int(n_trajectories) or n_trajectories < 1:
            raise ValueError(f"n_trajectories must be an int >= 1, got {n_trajectories!r}")
        base = dataclasses.replace(spec, **changes)
        dist = base.group_size_dist()
        total, g = 0, 0
        while total < n_trajectories:
            total += int(dist.sample(_rng(base, _S_GROUP_SIZE, g), 1)[0])
            g += 1
        n_groups = g
    changes["n_groups"] = n_groups
    return dataclasses.replace(spec, **changes)


def workload_stats(trajectories: Sequence[TokenizedTrajectory]) -> Dict[str, float]:
    """Summary numbers of a workload: counts, mean/max lengths, tool delays."""
    turns = [len(t.turns) for t in trajectories]
    final_ctx = [len(t.turns[-1].context_token_ids) + len(t.turns[-1].response_token_ids)
                 for t in trajectories]
    resp = [len(u.response_token_ids) for t in trajectories for u in t.turns]
    env = [u.env_token_count for t in trajectories for u in t.turns[:-1]]
    delays = [d for t in trajectories for d in getattr(t, "tool_delays_s", ())]
    groups = {t.group_id for t in trajectories}
    prompt = [len(t.turns[0].context_token_ids) for t in trajectories]

    def mean(xs):
        return float(np.mean(xs)) if len(xs) else 0.0

    return {
        "trajectories": len(trajectories),
        "groups": len(groups),
        "turns": int(sum(turns)),
        "turns_mean": mean(turns),
        "prompt_tokens_mean": mean(prompt),
        "response_tokens_mean": mean(resp),
        "response_tokens_total": int(sum(resp)),
        "observation_tokens_mean": mean(env),
        "final_context_mean": mean(final_ctx),
        "final_context_max": int(max(final_ctx)) if final_ctx else 0,
        "tool_delay_mean_s": mean(delays),
        "tool_delay_p99_s": float(np.percentile(delays, 99)) if delays else 0.0,
    }


# ---- named workload families -------------------------------------------------------------
NAMED_SPECS: Dict[str, WorkloadSpec] = {
    # tau-bench (airline/retail) customer-service agent talking to an LLM-simulated user:
    # a long policy document + tool schemas shared by every task, ~14 short turns of
    # tool calls / replies with short tool results and user messages; the "tool" is often
    # the simulated user, an LLM call of a second or two.
    "tau_like": WorkloadSpec(
        n_groups=8, group_size=4,
        system_prompt_tokens=4096,
        task_prompt_tokens=LengthDist.lognormal(120, 0.4, cap=512),
        turns=LengthDist.uniform(8, 20),
        response_tokens=LengthDist.lognormal(90, 0.5, cap=1024),
        observation_tokens=LengthDist.lognormal(150, 0.6, cap=2048),
        tool_latency_s=LatencyDist.lognormal(1.5, 0.4, cap_s=20.0),
        max_context_tokens=32768),
    # SWE-bench-style coding agent (SWE-agent, OpenHands): an issue as the task, 30-50
    # turns of thought + shell command, heavy-tailed observations (file views, test logs;
    # up to 8k), contexts growing past 32k; tools run tests and builds (stragglers); small
    # groups (1-2) because episodes are expensive.
    "swe_like": WorkloadSpec(
        n_groups=8, group_size=LengthDist.uniform(1, 2),
        system_prompt_tokens=2048,
        task_prompt_tokens=LengthDist.lognormal(600, 0.6, cap=4096),
        turns=LengthDist.uniform(30, 50),
        response_tokens=LengthDist.lognormal(200, 0.6, cap=2048),
        observation_tokens=LengthDist.pareto(150, 1.1, cap=8192),
        tool_latency_s=LatencyDist.lognormal(2.0, 0.8, cap_s=60.0, straggler_p=0.05,
                                             straggler_mult=10.0),
        max_context_tokens=65536),
    # Math RL with a code interpreter (ToRL / ReTool style): a short system prompt, a
    # problem statement, 1-4 turns of reasoning + code, short interpreter output, fast
    # sandboxed execution; large GRPO groups (16).
    "math_tool": WorkloadSpec(
        n_groups=4, group_size=16,
        system_prompt_tokens=256,
        task_prompt_tokens=LengthDist.lognormal(150, 0.5, cap=1024),
        turns=LengthDist.uniform(1, 4),
        response_tokens=LengthDist.lognormal(300, 0.6, cap=4096),
        observation_tokens=LengthDist.lognormal(40, 0.8, cap=512),
        tool_latency_s=LatencyDist.lognormal(0.15, 0.3, cap_s=5.0),
        max_context_tokens=16384),
    # Search agent (Search-R1 / deep-research style): a short question, ~5 rounds of
    # query + retrieved passages (~600 tokens of top-k snippets), retrieval and web fetches
    # of under a second with stragglers (slow pages, timeouts and retries).
    "search_agent": WorkloadSpec(
        n_groups=8, group_size=8,
        system_prompt_tokens=512,
        task_prompt_tokens=LengthDist.lognormal(60, 0.4, cap=512),
        turns=LengthDist.geometric(5, cap=12, floor=2),
        response_tokens=LengthDist.lognormal(150, 0.5, cap=1024),
        observation_tokens=LengthDist.lognormal(600, 0.4, cap=2048),
        tool_latency_s=LatencyDist.lognormal(0.8, 0.6, cap_s=10.0, straggler_p=0.08,
                                             straggler_mult=8.0),
        max_context_tokens=16384),
    # Long-reasoning model with few tool calls (chain-of-thought dialogue, verifier
    # feedback): 1-3 turns whose responses are heavy-tailed, 200 to 4000 tokens (median
    # ~430), so decode length, not prefill, dominates and groups straggle on their longest
    # sample.
    "chatty_long_responses": WorkloadSpec(
        n_groups=8, group_size=8,
        system_prompt_tokens=512,
        task_prompt_tokens=LengthDist.lognormal(200, 0.6, cap=2048),
        turns=LengthDist.uniform(1, 3),
        response_tokens=LengthDist.pareto(200, 0.9, cap=4000),
        observation_tokens=LengthDist.lognormal(100, 0.6, cap=1024),
        tool_latency_s=LatencyDist.lognormal(0.5, 0.5, cap_s=10.0),
        max_context_tokens=16384),
}
