"""Every engine step's work and time, recorded where vLLM schedules it.

The simulator's machine model is only as good as the step costs it is fitted to. Synthetic
shapes (``tools/fit_serving_costs.py``) price a step below what a rollout's engines pay: in a
rollout the engines share the host with their front-ends, the Ray actors and the driver, and
their batches mix contexts, prefills and drafts as no synthetic shape does. This recorder
writes the steps a real rollout ran, so that :func:`war_openrlhf.simulation.fit_steps.fit_rollout_steps`
fits the cost model to them (``tools/fit_rollout_costs.py``), on the machine and engines the
user will run.

Set ``WAR_STEP_RECORD_DIR`` before the engines start (the variable reaches their processes
through Ray and vLLM's process spawning). The ``war_step_record`` vLLM general plugin then wraps
``Scheduler.schedule`` and ``Scheduler.update_from_output`` in each engine-core process: the
first counts the step's work exactly as the simulator's engines do
(:meth:`war_openrlhf.simulation.cluster_engine.SimEngine.plan_step`: decoding sequences, the
context each scheduled request attends, prefill tokens and attention pairs, draft tokens and
the context they attend), the second stamps the step's end and whether requests remained
(the next step then starts at once, so the time between two step ends is a step's period,
scheduling and output handling included; with vLLM's async scheduling, where steps overlap,
that period is what a step costs). Rows go to ``steps-<host>-<pid>-<n>.csv`` in that directory,
one header line of JSON (engine kind, drafter and limits), then one CSV row per step; they are
written whenever the engine runs out of requests (off the critical path) or every
``_FLUSH_ROWS`` steps. Unset, nothing is patched and nothing is paid.
"""

from __future__ import annotations

import atexit
import itertools
import json
import os
import socket
import threading
import time
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import numpy as np

__all__ = ["ENV", "FIELDS", "EngineSteps", "StepRecorder", "drafter_of", "install", "read_step_records", "register"]

#: Directory to write step records into (unset: no recording).
ENV = "WAR_STEP_RECORD_DIR"
#: One CSV row per step, in this order.
FIELDS = ("t_start", "t_end", "busy_before", "decode_seqs", "context_tokens", "prefill_tokens", "prefill_pairs",
          "draft_tokens", "draft_context_tokens", "requests")
_FLUSH_ROWS = 1024
_MARK = "_war_step_record"
_LOCK = threading.Lock()
_SERIAL = itertools.count()  # a process with two engine cores writes two files


def step_work(scheduler: Any, out: Any) -> tuple[int, int, int, float, int, int, int]:
    """``(decode_seqs, context_tokens, prefill_tokens, prefill_pairs, draft_tokens,
    draft_context_tokens, requests)`` of the step ``out`` that ``scheduler`` just scheduled
    (``num_computed_tokens`` already advanced by it), counted as the simulator counts a step."""
    spec = out.scheduled_spec_decode_tokens
    requests = scheduler.requests
    dec = ctx = pre = drafts = dctx = 0
    pairs = 0.0
    for rid, n in out.num_scheduled_tokens.items():
        req = requests.get(rid)
        if req is None:
            continue
        before = req.num_computed_tokens - n
        if before < req.num_prompt_tokens:  # a prefill chunk (the prompt is the turn's whole context)
            pre += n
            pairs += n * (before + n / 2)
            ctx += before + n
        else:
            d = len(spec.get(rid, ())) if spec else 0
            dec += 1
            ctx += before
            drafts += d
            dctx += d * before
    return dec, ctx, pre, pairs, drafts, dctx, len(out.num_scheduled_tokens)


class StepRecorder:
    """One engine-core process's rows, buffered and appended to its file."""

    def __init__(self, directory: str | os.PathLike, header: dict[str, Any]) -> None:
        self.path = Path(directory) / f"steps-{socket.gethostname()}-{os.getpid()}-{next(_SERIAL)}.csv"
        self.path.parent.mkdir(parents=True, exist_ok=True)
        self.rows: list[tuple] = []
        self.pending: dict[int, tuple] = {}
        self.busy = False
        with self.path.open("w") as fh:
            fh.write("# " + json.dumps(header) + "\n" + ",".join(FIELDS) + "\n")
        atexit.register(self.flush)

    def scheduled(self, scheduler: Any, out: Any) -> None:
        if out.total_num_scheduled_tokens > 0:
            self.pending[id(out)] = (time.monotonic(), self.busy, *step_work(scheduler, out))

    def updated(self, scheduler: Any, out: Any) -> None:
        started = self.pending.pop(id(out), None)
        now = time.monotonic()
        self.busy = bool(scheduler.has_requests())
        if started is not None:
            self.rows.append((started[0], now, *started[1:]))
        if len(self.rows) >= _FLUSH_ROWS or (self.rows and not self.busy):
            self.flush()

    def flush(self) -> None:
        with _LOCK:
            rows, self.rows = self.rows, []
            if not rows:
                return
            with self.path.open("a") as fh:
                fh.write("".join(",".join(_fmt(v) for v in r) + "\n" for r in rows))


def _fmt(v: Any) -> str:
    if isinstance(v, bool):
        return "1" if v else "0"
    if isinstance(v, float):
        return repr(v)
    return str(v)


def drafter_of(vllm_config: Any) -> str | None:
    """Who drafts in an engine built with ``vllm_config``: ``None`` (no speculative config),
    ``war_index`` (WAR's replica behind vLLM's suffix drafter: WAR's worker extension) or
    ``vllm_<method>`` (vLLM's own, e.g. ``vllm_suffix``). Their per-step costs differ, so the
    fit prices each apart (:func:`war_openrlhf.simulation.fit_steps.fit_rollout_steps`)."""
    spec = getattr(vllm_config, "speculative_config", None)
    if spec is None:
        return None
    ext = str(getattr(getattr(vllm_config, "parallel_config", None), "worker_extension_cls", "") or "")
    if ext.startswith("war_openrlhf."):
        return "war_index"
    return f"vllm_{getattr(spec, 'method', None) or 'unknown'}"


def _header(scheduler: Any) -> dict[str, Any]:
    cfg = getattr(scheduler, "vllm_config", None)
    spec = getattr(cfg, "speculative_config", None)
    block = int(getattr(scheduler, "block_size", 0) or 0)
    kv_cfg = getattr(scheduler, "kv_cache_config", None)
    blocks = int(getattr(kv_cfg, "num_blocks", 0) or 0)
    model = getattr(getattr(cfg, "model_config", None), "model", None)
    return {"pid": os.getpid(), "host": socket.gethostname(), "clock": "monotonic", "model": model,
            "engine_kind": "speculative" if spec is not None else "plain", "drafter": drafter_of(cfg),
            "async_scheduling": bool(getattr(getattr(cfg, "scheduler_config", None), "async_scheduling", False)),
            "block_size": block, "kv_capacity_tokens": blocks * block,
            "max_num_seqs": int(getattr(scheduler, "max_num_running_reqs", 0) or 0),
            "max_num_batched_tokens": int(getattr(scheduler, "max_num_scheduled_tokens", 0) or 0)}


def install(directory: str | os.PathLike | None = None) -> bool:
    """Wrap vLLM's scheduler so every engine core of this process records its steps into
    ``directory`` (default: ``$WAR_STEP_RECORD_DIR``); False when there is no directory or no
    vLLM. Idempotent."""
    directory = directory or os.environ.get(ENV)
    if not directory:
        return False
    try:
        from vllm.v1.core.sched.scheduler import Scheduler
    except ImportError:
        return False
    with _LOCK:
        if getattr(Scheduler, _MARK, None) is not None:
            return True
        schedule, update = Scheduler.schedule, Scheduler.update_from_output

        def recorder(self) -> StepRecorder:
            rec = self.__dict__.get(_MARK)
            if rec is None:
                rec = self.__dict__[_MARK] = StepRecorder(directory, _header(self))
            return rec

        def recorded_schedule(self, *args, **kwargs):
            out = schedule(self, *args, **kwargs)
            recorder(self).scheduled(self, out)
            return out

        def recorded_update(self, scheduler_output, *args, **kwargs):
            result = update(self, scheduler_output, *args, **kwargs)
            recorder(self).updated(self, scheduler_output)
            return result

        Scheduler.schedule = recorded_schedule
        Scheduler.update_from_output = recorded_update
        setattr(Scheduler, _MARK, (schedule, update))
    return True


def register() -> None:
    """vLLM general-plugin entry point (every vLLM process): records steps when ``WAR_STEP_RECORD_DIR`` is set."""
    install()


@dataclass
class EngineSteps:
    """One engine's recorded steps: its header and a column per :data:`FIELDS` entry."""

    path: Path
    header: dict[str, Any]
    columns: dict[str, np.ndarray]

    def __len__(self) -> int:
        return len(self.columns["t_end"])


def read_step_records(directory: str | os.PathLike) -> list[EngineSteps]:
    """Every engine's records in ``directory``; ValueError naming the file and line of a malformed one."""
    directory = Path(directory)
    files = sorted(directory.glob("steps-*.csv"))
    if not files:
        raise ValueError(f"step records: no steps-*.csv in {directory} (was {ENV} set for the run?)")
    out = []
    for path in files:
        lines = path.read_text().splitlines()
        if len(lines) < 2 or not lines[0].startswith("# "):
            raise ValueError(f"{path}: line 1: expected '# ' and a JSON header")
        try:
            header = json.loads(lines[0][2:])
        except ValueError as exc:
            raise ValueError(f"{path}: line 1: header is not JSON ({exc})") from exc
        if tuple(lines[1].split(",")) != FIELDS:
            raise ValueError(f"{path}: line 2: expected the columns {','.join(FIELDS)}")
        rows = []
        for i, line in enumerate(lines[2:], start=3):
            parts = line.split(",")
            if len(parts) != len(FIELDS):
                raise ValueError(f"{path}: line {i}: {len(parts)} fields, expected {len(FIELDS)}")
            try:
                rows.append([float(p) for p in parts])
            except ValueError as exc:
                raise ValueError(f"{path}: line {i}: {exc}") from exc
        a = np.array(rows, dtype=np.float64).reshape(-1, len(FIELDS))
        out.append(EngineSteps(path, header, {f: a[:, j] for j, f in enumerate(FIELDS)}))
    return out
