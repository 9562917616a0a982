"""Wire format for the driver <-> worker RPCs: log entries and tensors as msgpack- and
pickle-safe data.

Why it exists: the driver's arguments reach the worker through two serialisers
(msgpack, then pickle) that do not round-trip numpy arrays, tensors or dataclasses,
so both sides encode and decode through this one module. It holds no state and
imports nothing of vLLM; it runs in the driver (encoding) and in the worker
(decoding), in whichever process each of those lives.

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

from typing import Any, Iterable, Mapping

import numpy as np

from war_openrlhf.speculation.log import LogEntry
from war_openrlhf.speculation.records import CompletedSequence, InflightChunk

__all__ = [
    "entries_from_wire",
    "entries_to_wire",
    "tensors_from_wire",
    "tensors_to_wire",
    "tokens_from_wire",
    "tokens_to_bytes",
]

_WIRE_DTYPE = np.dtype("<i4")


def tokens_to_bytes(tokens: np.ndarray) -> bytes:
    """Token ids as little-endian int32 ``bytes``."""
    return np.ascontiguousarray(tokens, dtype=_WIRE_DTYPE).tobytes()


def tokens_from_wire(value: Any, field: str) -> np.ndarray:
    """Inverse of :func:`tokens_to_bytes` (arrays and lists pass through); ``field``
    names the value in errors."""
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
                "prompt_token_ids": tokens_to_bytes(r.prompt_token_ids),
                "response_token_ids": tokens_to_bytes(r.response_token_ids),
            }
        if e.chunk is not None:
            c = e.chunk
            item["chunk"] = {"key": c.key, "trajectory_id": c.trajectory_id, "group_id": c.group_id,
                             "offset": int(c.offset), "token_ids": tokens_to_bytes(c.token_ids)}
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
                tokens_from_wire(rec["prompt_token_ids"], f"entries[{i}].record.prompt_token_ids"),
                tokens_from_wire(rec["response_token_ids"], f"entries[{i}].record.response_token_ids"),
            )
        ch = item.get("chunk")
        chunk = None
        if ch is not None:
            chunk = InflightChunk.create(ch["key"], ch["trajectory_id"], ch["group_id"], ch["offset"],
                                         tokens_from_wire(ch["token_ids"], f"entries[{i}].chunk.token_ids"))
        out.append(LogEntry(seq=int(item["seq"]), record=record, policy_version=item.get("policy_version"),
                            chunk=chunk))
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
    """Inverse of :func:`tensors_to_wire`."""
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
