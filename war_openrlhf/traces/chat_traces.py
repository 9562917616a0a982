"""Agent traces in OpenAI chat format, loaded and validated strictly.

Why strict: the simulations replay these traces token by token, so a record that
is silently skipped or half-parsed would bias every number measured on them.
Every malformed file, record, message or tool call therefore raises
:class:`TraceFormatError` with a message that names the file, the record index,
the message index and the field, e.g.::

    tau.json: record 12: field 'traj' must be a list of messages, got dict
    tau.json: record 3: message 5: role 'foo' is not one of system, user, assistant, tool

Accepted record layout (tau-bench ``historical_trajectories``)::

    {"task_id": int, "trial": int, "reward": float, "info": {...}, "traj": [message, ...]}

Messages are OpenAI chat messages: ``system``/``user`` (string ``content``),
``assistant`` (string ``content``, or ``null`` when it has ``tool_calls``; optional
``tool_calls`` list of ``{"id", "type": "function", "function": {"name",
"arguments"}}``, ``arguments`` being a JSON string that encodes an object, or that
object itself) and ``tool`` (string ``content`` and the ``tool_call_id`` of a call
made earlier in the same trajectory). Only what the chat template reads is kept:
other record keys (``info``) and other message keys (``refusal``, ...) are not.
"""

from __future__ import annotations

import json
import math
import os
from dataclasses import dataclass
from typing import Any, Iterable, Mapping, Union

__all__ = [
    "ROLES",
    "ChatMessage",
    "ChatTrajectory",
    "ToolCall",
    "TraceFormatError",
    "load_chat_traces",
]

PathLike = Union[str, "os.PathLike[str]"]

#: The message roles of the OpenAI chat format that agent traces use.
ROLES = ("system", "user", "assistant", "tool")


class TraceFormatError(ValueError):
    """A trace file, record, message or tool call does not follow the chat format."""


@dataclass(frozen=True)
class ToolCall:
    """One function call requested by an assistant message."""

    id: str
    name: str
    #: The decoded arguments object; the chat template re-serialises it.
    arguments: dict[str, Any]


@dataclass(frozen=True)
class ChatMessage:
    """One validated chat message.

    ``content`` is always a string: an assistant message whose content was
    ``null`` (a pure tool call) gets ``""``, which the chat template treats the same.
    """

    role: str
    content: str
    tool_calls: tuple[ToolCall, ...] = ()
    tool_call_id: str | None = None
    name: str | None = None


@dataclass(frozen=True)
class ChatTrajectory:
    """One agent trajectory: the trial-th sample of a task, with its reward."""

    task_id: int
    trial: int
    reward: float
    messages: tuple[ChatMessage, ...]

    @property
    def group_id(self) -> str:
        """All trials of one task share a prompt, like the samples of a GRPO group."""
        return f"task{self.task_id}"

    @property
    def trajectory_id(self) -> str:
        return f"task{self.task_id}/trial{self.trial}"

    @property
    def model_turns(self) -> int:
        """The model's turns (assistant messages): what a replay of this trajectory generates."""
        return sum(m.role == "assistant" for m in self.messages)


def load_chat_traces(paths: PathLike | Iterable[PathLike]) -> list[ChatTrajectory]:
    """Load and validate the trajectories of one trace file or of several, in order.

    Raises :class:`TraceFormatError` on any malformed file, record or message and on
    a ``(task_id, trial)`` pair that occurs twice; a missing file raises ``OSError``.
    """
    if isinstance(paths, (str, os.PathLike)):
        paths = [paths]
    else:
        paths = list(paths)
    if not paths:
        raise TraceFormatError("no trace files given")
    trajectories: list[ChatTrajectory] = []
    first_seen: dict[tuple[int, int], str] = {}
    for path in paths:
        for index, record in enumerate(_read_records(path)):
            where = f"{os.fspath(path)}: record {index}"
            trajectory = _parse_record(record, where)
            key = (trajectory.task_id, trajectory.trial)
            if key in first_seen:
                raise TraceFormatError(
                    f"{where}: duplicate trajectory task_id={key[0]} trial={key[1]} "
                    f"(already in {first_seen[key]})"
                )
            first_seen[key] = where
            trajectories.append(trajectory)
    return trajectories


def _read_records(path: PathLike) -> list[Any]:
    name = os.fspath(path)
    with open(path, "rb") as f:
        raw = f.read()
    try:
        data = json.loads(raw)
    except (UnicodeDecodeError, json.JSONDecodeError) as e:
        raise TraceFormatError(f"{name}: not valid JSON: {e}") from None
    except RecursionError:
        raise TraceFormatError(f"{name}: JSON nested too deeply to read") from None
    except ValueError as e:  # e.g. an integer of more than 4,300 digits
        raise TraceFormatError(f"{name}: JSON holds a value Python cannot read: {str(e)[:160]}") from None
    if not isinstance(data, list):
        raise TraceFormatError(
            f"{name}: top level must be a list of trajectory records, got {_kind(data)}"
        )
    return data


def _kind(value: Any) -> str:
    """The JSON-ish name of a value's type, for error messages."""
    if value is None:
        return "null"
    return {dict: "object", list: "list", str: "string", bool: "bool"}.get(
        type(value), type(value).__name__
    )


def _is_int(value: Any) -> bool:
    return isinstance(value, int) and not isinstance(value, bool)


def _parse_record(record: Any, where: str) -> ChatTrajectory:
    if not isinstance(record, dict):
        raise TraceFormatError(f"{where}: must be an object, got {_kind(record)}")
    for key in ("task_id", "trial", "reward", "traj"):
        if key not in record:
            raise TraceFormatError(f"{where}: missing required field '{key}'")
    for key in ("task_id", "trial"):
        if not _is_int(record[key]):
            raise TraceFormatError(
                f"{where}: field '{key}' must be an integer, got {_kind(record[key])}"
            )
    reward = record["reward"]
    try:
        finite = (_is_int(reward) or isinstance(reward, float)) and math.isfinite(reward)
    except OverflowError:  # an integer too large for a float
        finite = False
    if not finite:
        raise TraceFormatError(f"{where}: field 'reward' must be a finite number, got {str(reward)[:40]}")
    traj = record["traj"]
    if not isinstance(traj, list):
        raise TraceFormatError(f"{where}: field 'traj' must be a list of messages, got {_kind(traj)}")
    if not traj:
        raise TraceFormatError(f"{where}: field 'traj' must be a non-empty list of messages")
    messages: list[ChatMessage] = []
    issued_call_ids: set[str] = set()
    for index, raw in enumerate(traj):
        message = _parse_message(raw, f"{where}: message {index}", issued_call_ids)
        issued_call_ids.update(call.id for call in message.tool_calls)
        messages.append(message)
    return ChatTrajectory(
        task_id=record["task_id"],
        trial=record["trial"],
        reward=float(reward),
        messages=tuple(messages),
    )


def _parse_message(raw: Any, where: str, issued_call_ids: set[str]) -> ChatMessage:
    if not isinstance(raw, dict):
        raise TraceFormatError(f"{where}: must be an object with a 'role', got {_kind(raw)}")
    if "role" not in raw:
        raise TraceFormatError(f"{where}: missing required field 'role'")
    role = raw["role"]
    if role not in ROLES:
        raise TraceFormatError(f"{where}: role {role!r} is not one of {', '.join(ROLES)}")
    if raw.get("function_call") is not None:
        raise TraceFormatError(
            f"{where}: field 'function_call' (legacy OpenAI format) is not supported; use 'tool_calls'"
        )
    name = raw.get("name")
    if name is not None and not isinstance(name, str):
        raise TraceFormatError(f"{where}: field 'name' must be a string, got {_kind(name)}")

    tool_calls: tuple[ToolCall, ...] = ()
    raw_calls = raw.get("tool_calls")
    if raw_calls is not None:
        if role != "assistant":
            raise TraceFormatError(f"{where}: field 'tool_calls' is only allowed on assistant messages")
        if not isinstance(raw_calls, list):
            raise TraceFormatError(
                f"{where}: field 'tool_calls' must be a list of tool calls, got {_kind(raw_calls)}"
            )
        tool_calls = tuple(
            _parse_tool_call(call, f"{where}: tool_calls[{i}]") for i, call in enumerate(raw_calls)
        )

    if "content" not in raw:
        raise TraceFormatError(f"{where}: missing required field 'content'")
    content = raw["content"]
    if content is None and role == "assistant" and tool_calls:
        content = ""
    if not isinstance(content, str):
        detail = " without tool calls" if role == "assistant" else ""
        raise TraceFormatError(
            f"{where}: field 'content' of a {role} message{detail} must be a string, got {_kind(content)}"
        )

    tool_call_id = None
    if role == "tool":
        tool_call_id = raw.get("tool_call_id")
        if not isinstance(tool_call_id, str):
            raise TraceFormatError(
                f"{where}: field 'tool_call_id' of a tool message must be a string, got {_kind(tool_call_id)}"
            )
        if tool_call_id not in issued_call_ids:
            raise TraceFormatError(
                f"{where}: field 'tool_call_id' {tool_call_id!r} does not match any earlier tool call"
            )
    return ChatMessage(
        role=role, content=content, tool_calls=tool_calls, tool_call_id=tool_call_id, name=name
    )


def _parse_tool_call(raw: Any, where: str) -> ToolCall:
    if not isinstance(raw, dict):
        raise TraceFormatError(f"{where}: must be an object, got {_kind(raw)}")
    call_id = raw.get("id")
    if not isinstance(call_id, str):
        raise TraceFormatError(f"{where}: field 'id' must be a string, got {_kind(call_id)}")
    if raw.get("type", "function") != "function":
        raise TraceFormatError(f"{where}: field 'type' must be 'function', got {raw['type']!r}")
    function = raw.get("function")
    if not isinstance(function, Mapping):
        raise TraceFormatError(f"{where}: field 'function' must be an object, got {_kind(function)}")
    name = function.get("name")
    if not isinstance(name, str) or not name:
        raise TraceFormatError(f"{where}: field 'function.name' must be a non-empty string, got {name!r}")
    arguments = function.get("arguments")
    if isinstance(arguments, str):
        try:
            arguments = json.loads(arguments)
        except json.JSONDecodeError as e:
            raise TraceFormatError(f"{where}: field 'function.arguments' is not valid JSON: {e}") from None
        except (ValueError, RecursionError) as e:
            raise TraceFormatError(f"{where}: field 'function.arguments' cannot be read "
                                   f"({type(e).__name__}: {str(e)[:120]})") from None
    if not isinstance(arguments, dict):
        raise TraceFormatError(
            f"{where}: field 'function.arguments' must be a JSON object (or a string encoding one), "
            f"got {_kind(arguments)}"
        )
    return ToolCall(id=call_id, name=name, arguments=arguments)
