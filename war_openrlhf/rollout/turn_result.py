"""One turn's result as the pool hands it to an episode: typed, built once from the engine's answer."""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any, Mapping

__all__ = ["TurnResult"]


@dataclass
class TurnResult:
    """What one turn generated and how: the engine's answer plus what the pool knows of the dispatch.

    ``weight_versions``: the first and last weight version that produced the turn (two when a weight
    sync landed mid-turn). ``estimated_cached_tokens``: the dispatcher's estimate of the engine's
    cached prefix before it chose (``record_cache_estimates``), None otherwise. ``queue_s`` /
    ``prefill_s`` / ``decode_s``: the engine's own timing, when it reports it."""

    token_ids: list[int]
    logprobs: list[float]
    finish_reason: str | None
    engine: int
    num_prompt_tokens: int
    num_cached_tokens: int = 0
    weight_versions: tuple[int, int] = (0, 0)
    attempts: int = 1
    seconds: float = 0.0
    request_id: str = ""
    estimated_cached_tokens: int | None = None
    queue_s: float | None = None
    prefill_s: float | None = None
    decode_s: float | None = None
    text: str | None = None  # vLLM's detokenized turn (``CompletionOutput.text``), when the engine sends it
    extra: dict[str, Any] = field(default_factory=dict)  # anything else the engine reported

    _FIELDS = ("token_ids", "logprobs", "finish_reason", "num_prompt_tokens", "num_cached_tokens",
               "weight_versions", "seconds", "request_id", "queue_s", "prefill_s", "decode_s", "text")

    @classmethod
    def from_engine(cls, answer: Mapping[str, Any], *, engine: int, prompt_tokens: int, attempts: int = 1,
                    estimated_cached_tokens: int | None = None) -> "TurnResult":
        """From :meth:`WarEngine.generate_tokens`'s dict (the one conversion of a turn's answer)."""
        if "token_ids" not in answer:
            raise ValueError(f"engine {engine}: a turn's answer has no token_ids (keys: {sorted(answer)})")
        versions = answer.get("weight_versions") or (0, 0)
        return cls(
            token_ids=list(answer["token_ids"]),
            logprobs=list(answer.get("logprobs") or []),
            finish_reason=answer.get("finish_reason"),
            engine=int(engine),
            num_prompt_tokens=int(answer.get("num_prompt_tokens", prompt_tokens)),
            num_cached_tokens=int(answer.get("num_cached_tokens") or 0),
            weight_versions=(int(min(versions)), int(max(versions))),
            attempts=int(attempts),
            seconds=float(answer.get("seconds", 0.0)),
            request_id=str(answer.get("request_id", "")),
            estimated_cached_tokens=estimated_cached_tokens,
            queue_s=answer.get("queue_s"),
            prefill_s=answer.get("prefill_s"),
            decode_s=answer.get("decode_s"),
            text=answer.get("text") if isinstance(answer.get("text"), str) else None,
            extra={k: v for k, v in answer.items() if k not in cls._FIELDS and k != "engine"},
        )
