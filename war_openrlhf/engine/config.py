"""Engine configuration, validated before any vLLM engine is built.

A bad setting found by vLLM surfaces minutes later as a deep stack trace from an
engine-core subprocess; the checks here fail at once and say what to change.
"""

from __future__ import annotations

import json
import os
from dataclasses import asdict, dataclass, field
from pathlib import Path
from typing import Any

from ..config_checks import check_int, dataclass_from_dict, load_yaml
from ..model_source import ModelNotFound, resolve_model
from ..speculation.index import SuffixIndexConfig
from .drafting import Drafting, drafting_for
from .spec_switch import SpecSwitchConfig

DTYPES = ("auto", "bfloat16", "float16", "float32")
SPECULATION_MODES = ("auto", "on", "off", "none", "vllm_suffix")
# vLLM 0.29's ModelConfig.logprobs_mode choices (OpenRLHF's --algo.advantage.is_correction_level
# asks for processed_logprobs: the sampler's log-probs after temperature / top-p)
LOGPROBS_MODES = ("raw_logprobs", "raw_logits", "processed_logprobs", "processed_logits")
_DTYPE_BYTES = {"bfloat16": 2, "float16": 2, "float32": 4}


@dataclass
class EngineConfig:
    """One rollout engine (defaults in configs/engine.yaml).

    ``speculation``: ``auto`` (WAR index, the load-aware switch decides), ``on`` /
    ``off`` (WAR index, forced), ``none`` (a plain vLLM engine: no speculative config, so
    nothing paid for drafting), ``vllm_suffix`` (vLLM's own per-engine suffix method).
    """

    model: str = ""
    dtype: str = "auto"
    max_model_len: int = 4096
    enforce_eager: bool = False
    enable_prefix_caching: bool = True
    gpu_memory_utilization: float = 0.85
    kv_cache_space_gib: float = 1.0  # CPU only (VLLM_CPU_KVCACHE_SPACE)
    kv_capacity_tokens: int | None = None  # exact usable KV (num_gpu_blocks_override + null block); None: memory
    cpu_core: int | None = None  # CPU only: the core the engine's threads are bound to
    seed: int = 0
    num_speculative_tokens: int = 16
    speculation: str = "auto"
    index: SuffixIndexConfig = field(default_factory=SuffixIndexConfig)
    switch: SpecSwitchConfig = field(default_factory=SpecSwitchConfig)
    sync_max_lag_records: int = 64
    sync_max_lag_seconds: float = 0.25
    tensor_parallel_size: int = 1  # GPUs per engine (vLLM's Ray executor inside the actor when > 1)
    enable_sleep_mode: bool = False  # vLLM sleep mode: free weights + KV while the trainer runs (CUDA)
    logprobs_mode: str | None = None  # vLLM's logprobs_mode; None: vLLM's default (raw_logprobs)
    full_determinism: bool = False  # vLLM in-process engine core (VLLM_ENABLE_V1_MULTIPROCESSING=0), as OpenRLHF
    start_timeout_s: float = 1800.0  # an engine not serving by then failed to start (model download included)
    kv_events: bool = False  # publish vLLM's KV-cache events, read back for the pool (engine/kv_events.py)
    trust_remote_code: bool | None = None  # run the model directory's own code; None: no, but yes in war-train
                                           # (as OpenRLHF's engines); an explicit false is kept
    # the dtype the trainer's weight sync sends (war-train: --ds.param_dtype). OpenRLHF's WorkerWrap
    # asserts it equals the engine's, so on CUDA ``auto`` becomes it and another dtype is refused
    weight_sync_dtype: str | None = None
    # vLLM's scheduling_policy: fcfs, or priority (requests carry a priority, lower first; the pool's
    # turn_priority longest_first sends the predicted stragglers' turns first)
    scheduling_policy: str = "fcfs"

    def __post_init__(self) -> None:
        if isinstance(self.index, dict):
            self.index = SuffixIndexConfig.from_dict(self.index, source="EngineConfig.index")
        if isinstance(self.switch, dict):
            self.switch = SpecSwitchConfig(**self.switch)
        if self.dtype not in DTYPES:
            raise ValueError(f"EngineConfig.dtype: '{self.dtype}' is not one of {', '.join(DTYPES)}")
        if self.weight_sync_dtype is not None and self.weight_sync_dtype not in DTYPES[1:]:
            raise ValueError(f"EngineConfig.weight_sync_dtype: '{self.weight_sync_dtype}' is not one of "
                             f"{', '.join(DTYPES[1:])} (or null)")
        if self.scheduling_policy not in ("fcfs", "priority"):
            raise ValueError(f"EngineConfig.scheduling_policy: '{self.scheduling_policy}' is not one of fcfs, priority")
        if self.speculation not in SPECULATION_MODES:
            raise ValueError(
                f"EngineConfig.speculation: '{self.speculation}' is not one of {', '.join(SPECULATION_MODES)}"
            )
        if self.logprobs_mode is not None and self.logprobs_mode not in LOGPROBS_MODES:
            raise ValueError(f"EngineConfig.logprobs_mode: '{self.logprobs_mode}' is not one of "
                             f"{', '.join(LOGPROBS_MODES)}")
        for name in ("max_model_len", "num_speculative_tokens", "sync_max_lag_records", "tensor_parallel_size"):
            check_int("EngineConfig", name, getattr(self, name), 1)
        check_int("EngineConfig", "cpu_core", self.cpu_core, 0, nullable=True)
        check_int("EngineConfig", "kv_capacity_tokens", self.kv_capacity_tokens, 1, nullable=True)
        if self.kv_capacity_tokens is not None and self.kv_capacity_tokens < self.max_model_len:
            raise ValueError(f"EngineConfig.kv_capacity_tokens: {self.kv_capacity_tokens} cannot hold one "
                             f"max_model_len={self.max_model_len} sequence; a vLLM engine's KV always holds one "
                             "(raise it, or lower max_model_len)")
        if not 0 < self.gpu_memory_utilization <= 1:
            raise ValueError(f"EngineConfig.gpu_memory_utilization: must be in (0, 1], got {self.gpu_memory_utilization}")
        if not self.kv_cache_space_gib > 0:
            raise ValueError(f"EngineConfig.kv_cache_space_gib: must be > 0, got {self.kv_cache_space_gib}")
        if not self.start_timeout_s > 0:
            raise ValueError(f"EngineConfig.start_timeout_s: must be > 0, got {self.start_timeout_s}")
        if self.kv_events and not self.enable_prefix_caching:
            raise ValueError("EngineConfig.kv_events: vLLM reports KV-cache events only with prefix caching; "
                             "set enable_prefix_caching: true")
        if self.sync_max_lag_seconds < 0:
            raise ValueError(f"EngineConfig.sync_max_lag_seconds: must be >= 0, got {self.sync_max_lag_seconds}")

    @property
    def drafting(self) -> Drafting:
        """What this engine drafts from (:mod:`.drafting`): WAR's index or vLLM's own suffix method."""
        return drafting_for(self.speculation)

    @classmethod
    def from_dict(cls, data: dict[str, Any], source: str = "EngineConfig") -> "EngineConfig":
        """Build from a mapping; an unknown key or a wrong type names the key and ``source``."""
        return dataclass_from_dict(cls, data, source, nested={
            "index": SuffixIndexConfig.from_dict,
            "switch": lambda value, src: dataclass_from_dict(SpecSwitchConfig, value, src),
        })

    @classmethod
    def from_yaml(cls, path: str | Path, **overrides: Any) -> "EngineConfig":
        data = load_yaml(path)
        return cls.from_dict({**data, **overrides}, source=str(path))

    def as_dict(self) -> dict[str, Any]:
        return asdict(self)


def kv_bytes_per_token(model_dir: Path, dtype: str) -> int:
    """layers x kv_heads x head_dim x 2 (K and V) x bytes per element, from config.json."""
    cfg = json.loads((model_dir / "config.json").read_text())
    cfg = cfg.get("text_config", cfg)
    layers = int(cfg["num_hidden_layers"])
    heads = int(cfg["num_attention_heads"])
    kv_heads = int(cfg.get("num_key_value_heads") or heads)
    head_dim = int(cfg.get("head_dim") or cfg["hidden_size"] // heads)
    if dtype == "auto":
        dtype = str(cfg.get("torch_dtype") or cfg.get("dtype") or "bfloat16").replace("torch.", "")
    return layers * kv_heads * head_dim * 2 * _DTYPE_BYTES.get(dtype, 2)


def check_startup(config: EngineConfig, *, cuda: bool, taken_cores: set[int] | None = None) -> None:
    """Raise ``ValueError`` naming the setting to change, before vLLM starts."""
    if not config.model:
        raise ValueError("EngineConfig.model: no model given; pass a local model directory or a hub id")
    try:
        model_dir = resolve_model(config.model)  # a hub id is fetched (config + tokenizer) once per node
    except ModelNotFound as exc:
        raise ValueError(f"EngineConfig.model: {exc}") from None
    if cuda and config.weight_sync_dtype and config.dtype not in ("auto", config.weight_sync_dtype):
        raise ValueError(f"EngineConfig.dtype: {config.dtype}, but the trainer sends its weights as "
                         f"{config.weight_sync_dtype} (--ds.param_dtype) and OpenRLHF's weight sync asserts they "
                         f"match; use dtype auto or {config.weight_sync_dtype}")
    if not cuda:
        if config.enable_sleep_mode:
            raise ValueError("EngineConfig.enable_sleep_mode: vLLM's sleep mode needs CUDA (its cumem allocator); "
                             "on CPU drop --vllm.enable_sleep")
        if config.tensor_parallel_size != 1:
            raise ValueError(f"EngineConfig.tensor_parallel_size: {config.tensor_parallel_size} on CPU; a CPU "
                             "engine runs on one core, use 1 (tensor parallelism is for GPU engines)")
        if config.dtype == "float16":
            raise ValueError("EngineConfig.dtype: float16 is not supported by vLLM on CPU; use bfloat16 or float32")
        need = kv_bytes_per_token(model_dir, config.dtype) * config.max_model_len
        have = config.kv_cache_space_gib * 2**30
        if need > have:
            raise ValueError(
                f"EngineConfig.kv_cache_space_gib: {config.kv_cache_space_gib} GiB holds "
                f"{int(have // kv_bytes_per_token(model_dir, config.dtype))} tokens, less than one "
                f"max_model_len={config.max_model_len} sequence ({need / 2**30:.2f} GiB); raise "
                "kv_cache_space_gib or lower max_model_len"
            )
        cores = os.cpu_count() or 1
        if config.cpu_core is not None:
            if not 0 <= config.cpu_core < cores:
                raise ValueError(
                    f"EngineConfig.cpu_core: core {config.cpu_core} does not exist (this machine has {cores}); "
                    "use one engine per core"
                )
            if taken_cores and config.cpu_core in taken_cores:
                raise ValueError(
                    f"EngineConfig.cpu_core: core {config.cpu_core} is already used by another engine; "
                    f"free cores: {sorted(set(range(cores)) - taken_cores) or 'none'} (fewer engines, or more cores)"
                )
