"""Completed-sequence records: the unit that flows from rollouts into the global index.

A record is one finished *turn* of a trajectory (or a whole trajectory): the prompt
the engine saw and the tokens the model produced. Records are validated once, here,
so every replica can trust what it applies.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any, Mapping, Sequence

import numpy as np

_INT32_MAX = np.iinfo(np.int32).max

RECORD_FIELDS = (
    "trajectory_id",
    "group_id",
    "policy_version",
    "prompt_token_ids",
    "response_token_ids",
)


def as_token_array(value: Any, field: str, *, allow_empty: bool = False) -> np.ndarray:
    """Validate token ids and return them as a contiguous int32 array.

    Raises ``ValueError`` naming ``field`` for: a non-sequence, an empty sequence
    (unless ``allow_empty``), non-integer values (floats, bools, strings), negative
    ids, or ids beyond int32.
    """
    if type(value) is np.ndarray and value.dtype == np.int32 and value.ndim == 1 and value.size:
        # fast path (hot: every speculate call): int32 cannot overflow, only check sign
        if value.min() < 0:
            i = int(np.argmax(value < 0))
            raise ValueError(f"{field}[{i}]: token ids must be >= 0, got {int(value[i])}")
        if value.flags.c_contiguous and value.flags.writeable:
            return value
    if isinstance(value, (str, bytes)) or value is None:
        raise ValueError(f"{field}: expected a sequence of token ids (ints), got {type(value).__name__}")
    if isinstance(value, np.ndarray):
        arr = value
        if arr.ndim != 1:
            raise ValueError(f"{field}: expected a 1-D sequence of token ids, got an array of shape {arr.shape}")
        if arr.size and not np.issubdtype(arr.dtype, np.integer):
            raise ValueError(f"{field}: token ids must be integers, got dtype {arr.dtype}")
    else:
        try:
            items = list(value)
        except TypeError:
            raise ValueError(
                f"{field}: expected a sequence of token ids (ints), got {type(value).__name__}"
            ) from None
        for i, tok in enumerate(items):
            if isinstance(tok, (bool, np.bool_)) or not isinstance(tok, (int, np.integer)):
                raise ValueError(
                    f"{field}[{i}]: token ids must be integers, got {tok!r} ({type(tok).__name__})"
                )
        arr = np.asarray(items, dtype=np.int64) if items else np.zeros(0, dtype=np.int64)
    if arr.size == 0:
        if allow_empty:
            return np.zeros(0, dtype=np.int32)
        raise ValueError(f"{field}: must contain at least one token id, got an empty sequence")
    lo, hi = int(arr.min()), int(arr.max())
    if lo < 0:
        i = int(np.argmax(arr < 0))
        raise ValueError(f"{field}[{i}]: token ids must be >= 0, got {int(arr[i])}")
    if hi > _INT32_MAX:
        i = int(np.argmax(arr > _INT32_MAX))
        raise ValueError(f"{field}[{i}]: token id {int(arr[i])} does not fit in int32")
    out = np.ascontiguousarray(arr, dtype=np.int32)
    # arctic's nanobind bindings take writable buffers only
    return out if out.flags.writeable else out.copy()


def _check_id(value: Any, field: str) -> str:
    if isinstance(value, (bool, np.bool_)) or not isinstance(value, (str, int, np.integer)):
        raise ValueError(f"{field}: expected a string (or int) identifier, got {type(value).__name__}")
    text = str(value)
    if not text:
        raise ValueError(f"{field}: must be a non-empty identifier")
    return text


def _check_version(value: Any, field: str = "policy_version") -> int:
    if isinstance(value, (bool, np.bool_)) or not isinstance(value, (int, np.integer)):
        raise ValueError(f"{field}: expected a non-negative int, got {value!r}")
    if int(value) < 0:
        raise ValueError(f"{field}: expected a non-negative int, got {int(value)}")
    return int(value)


@dataclass(frozen=True)
class CompletedSequence:
    """One completed turn (or trajectory) as the model generated it.

    ``prompt_token_ids`` is everything the engine was given (for a multi-turn agent:
    the whole conversation so far); ``response_token_ids`` is what it sampled.
    Construct through :meth:`create` (or :meth:`from_mapping`) to get validation.
    """

    trajectory_id: str
    group_id: str
    policy_version: int
    prompt_token_ids: np.ndarray
    response_token_ids: np.ndarray

    @classmethod
    def create(
        cls,
        trajectory_id: str | int,
        group_id: str | int,
        policy_version: int,
        prompt_token_ids: Sequence[int] | np.ndarray,
        response_token_ids: Sequence[int] | np.ndarray,
    ) -> "CompletedSequence":
        return cls(
            trajectory_id=_check_id(trajectory_id, "trajectory_id"),
            group_id=_check_id(group_id, "group_id"),
            policy_version=_check_version(policy_version),
            prompt_token_ids=as_token_array(prompt_token_ids, "prompt_token_ids"),
            response_token_ids=as_token_array(response_token_ids, "response_token_ids"),
        )

    @classmethod
    def from_mapping(cls, data: Mapping[str, Any]) -> "CompletedSequence":
        """Build from a dict with exactly the record fields; a missing field is named."""
        if not isinstance(data, Mapping):
            raise ValueError(f"record: expected a mapping with fields {RECORD_FIELDS}, got {type(data).__name__}")
        missing = [f for f in RECORD_FIELDS if f not in data]
        if missing:
            raise ValueError(f"record is missing field '{missing[0]}' (required: {', '.join(RECORD_FIELDS)})")
        unknown = sorted(set(data) - set(RECORD_FIELDS))
        if unknown:
            raise ValueError(f"record has unknown field '{unknown[0]}' (allowed: {', '.join(RECORD_FIELDS)})")
        return cls.create(**{f: data[f] for f in RECORD_FIELDS})

    @property
    def num_tokens(self) -> int:
        return int(self.prompt_token_ids.size + self.response_token_ids.size)


@dataclass(frozen=True)
class InflightChunk:
    """New tokens of a turn still generating, for its GRPO siblings on other engines to draft from.

    ``key`` names the turn (unique per turn and engine: the engine's request id, prefixed with the
    engine); ``offset`` is how many of the turn's tokens earlier chunks carried, so a replica can
    tell a continuation from a repeat. The turn's :class:`CompletedSequence` closes it."""

    key: str
    trajectory_id: str
    group_id: str
    offset: int
    token_ids: np.ndarray

    @classmethod
    def create(cls, key: str, trajectory_id: str | int, group_id: str | int, offset: int,
               token_ids: Sequence[int] | np.ndarray) -> "InflightChunk":
        return cls(key=_check_id(key, "key"), trajectory_id=_check_id(trajectory_id, "trajectory_id"),
                   group_id=_check_id(group_id, "group_id"), offset=_check_version(offset, "offset"),
                   token_ids=as_token_array(token_ids, "token_ids"))
