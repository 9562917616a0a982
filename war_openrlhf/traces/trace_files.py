"""A user's agent trajectories, in the formats they have, as turns the simulator replays.

``war-predict`` answers "what would WAR gain on *my* workload" from trajectories a team already
has. Three kinds of file are read, chosen by name and content:

* **OpenAI chat** (``.json``: a list of records; ``.jsonl``: one record a line): tau-bench's
  records (``task_id``, ``trial``, ``reward``, ``traj``; :mod:`.chat_traces` validates them) or
  plain ``{"messages": [...]}`` records (optional ``group_id``: trajectories of one prompt, a GRPO
  group). Tokenized with the Qwen2.5 chat template (:mod:`.turns`) or a tokenizer given.
* **SWE-agent** ``.traj`` files: ``history`` (the model's conversation) and ``trajectory`` (its
  steps, whose ``execution_time`` is the tool's latency). The file's name (SWE-agent writes
  ``<instance_id>.traj``) is the group: runs of one instance are siblings.
* **war-train rollout dumps** (``rollout_*.jsonl``, ``RolloutConfig.dump_dir``): token ids, each
  turn's span and tool seconds, group ids, exactly as the engines saw them.

Every trajectory keeps its tool latencies when the file records them (``tool_delays_s``; None
otherwise: the caller supplies one). A file that cannot be read raises
:class:`~.chat_traces.TraceFormatError` naming the file, the record and the field; nothing is
skipped silently.
"""

from __future__ import annotations

import json
import math
import os
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Iterable

import numpy as np

from .chat_traces import ChatMessage, ChatTrajectory, TraceFormatError, _kind, _parse_message, _parse_record
from .turns import Tokenizer, Turn, _PieceCache, _tokenize_trajectory

__all__ = ["ReplayTrajectory", "TraceSet", "load_trace_files", "trace_summary"]


@dataclass(frozen=True, eq=False)
class ReplayTrajectory:
    """One trajectory as the simulator replays it: its turns (tokens) and, when recorded, the
    seconds its tools took after each turn."""

    trajectory_id: str
    group_id: str
    turns: list[Turn]
    tool_delays_s: list[float] | None = None
    source: str = ""


@dataclass
class TraceSet:
    """What :func:`load_trace_files` read: trajectories and, per file, its format and counts."""

    trajectories: list[ReplayTrajectory] = field(default_factory=list)
    files: list[dict[str, Any]] = field(default_factory=list)

    @property
    def recorded_tool_delays(self) -> list[float]:
        return [d for t in self.trajectories if t.tool_delays_s for d in t.tool_delays_s]


def load_trace_files(paths: str | os.PathLike | Iterable[str | os.PathLike],
                     tokenizer: Tokenizer | None = None) -> TraceSet:
    """Read every file (see the module docstring); ``tokenizer`` (``encode``/``decode``) for chat
    formats, default the Qwen2.5 tokenizer."""
    if isinstance(paths, (str, os.PathLike)):
        paths = [paths]
    paths = [Path(p) for p in paths]
    if not paths:
        raise TraceFormatError("no trace files given")
    encode = None
    out = TraceSet()
    for path in paths:
        if not path.is_file():
            raise TraceFormatError(f"{path}: no such file")
        kind, records = _read(path)
        if kind == "rollout_dump":
            trajs = [_from_dump(r, f"{path}: line {i + 1}") for i, r in records]
        else:
            if encode is None:
                from .turns import qwen25_tokenizer

                encode = _PieceCache(tokenizer if tokenizer is not None else qwen25_tokenizer())
            trajs = []
            for where, tid, gid, chat, delays in _chat_records(path, kind, records):
                tok = _tokenize_trajectory(chat, encode)
                if not tok.turns:
                    raise TraceFormatError(f"{where}: no assistant message (a trajectory needs one model turn)")
                trajs.append(ReplayTrajectory(tid, gid, tok.turns, _fit_delays(delays, len(tok.turns), where),
                                              str(path)))
        seen = {t.trajectory_id for t in out.trajectories}
        for t in trajs:
            if t.trajectory_id in seen:
                raise TraceFormatError(f"{path}: trajectory {t.trajectory_id!r} occurs twice")
            seen.add(t.trajectory_id)
        out.trajectories.extend(trajs)
        out.files.append({"path": str(path), "format": kind, "trajectories": len(trajs),
                          "turns": sum(len(t.turns) for t in trajs),
                          "with_tool_latency": sum(t.tool_delays_s is not None for t in trajs)})
    return out


# ---------------------------------------------------------------- reading and detecting
def _read(path: Path) -> tuple[str, list]:
    raw = path.read_bytes()
    if path.suffix == ".traj":
        return "swe_agent", [(0, _json(raw, str(path)))]
    if path.suffix == ".jsonl":
        records = []
        for i, line in enumerate(raw.splitlines()):
            if line.strip():
                records.append((i, _json(line, f"{path}: line {i + 1}")))
        if not records:
            raise TraceFormatError(f"{path}: empty file")
        first = records[0][1]
        if isinstance(first, dict) and "token_ids" in first and "turns" in first:
            return "rollout_dump", records
        return "chat_jsonl", records
    data = _json(raw, str(path))
    if isinstance(data, dict) and "history" in data and "trajectory" in data:
        return "swe_agent", [(0, data)]
    if not isinstance(data, list):
        raise TraceFormatError(f"{path}: top level must be a list of trajectory records (or a SWE-agent "
                               f".traj object), got {_kind(data)}")
    if not data:
        raise TraceFormatError(f"{path}: no records")
    return "chat_json", list(enumerate(data))


def _json(raw: bytes, where: str) -> Any:
    try:
        return json.loads(raw)
    except (UnicodeDecodeError, json.JSONDecodeError) as exc:
        raise TraceFormatError(f"{where}: not valid JSON: {exc}") from None
    except (RecursionError, ValueError) as exc:
        raise TraceFormatError(f"{where}: JSON Python cannot read: {str(exc)[:160]}") from None


def _chat_records(path: Path, kind: str, records: list):
    """(where, trajectory id, group id, ChatTrajectory, tool delays or None) per record."""
    for index, record in records:
        place = f"line {index + 1}" if kind == "chat_jsonl" else f"record {index}"
        where = f"{path}: {place}"
        if kind == "swe_agent":  # SWE-agent names the file <instance_id>.traj: runs of one instance are siblings
            chat, delays = _swe_agent(record, str(path))
            yield str(path), str(path), path.name.removesuffix(".traj"), chat, delays
        elif isinstance(record, dict) and "traj" in record:
            chat = _parse_record(record, where)
            yield where, f"{path}:{chat.trajectory_id}", chat.group_id, chat, None
        elif isinstance(record, dict) and "messages" in record:
            chat, group = _messages_record(record, index, where)
            yield where, f"{path}:{place}", group, chat, _delays_field(record, where)
        else:
            got = sorted(record)[:8] if isinstance(record, dict) else _kind(record)
            raise TraceFormatError(f"{where}: a chat record needs 'traj' (tau-bench) or 'messages', got {got}")


def _messages_record(record: dict, index: int, where: str) -> tuple[ChatTrajectory, str]:
    raw = record["messages"]
    if not isinstance(raw, list) or not raw:
        raise TraceFormatError(f"{where}: field 'messages' must be a non-empty list of messages, got {_kind(raw)}")
    issued: set[str] = set()
    messages = []
    for i, m in enumerate(raw):
        msg = _parse_message(m, f"{where}: message {i}", issued)
        issued.update(c.id for c in msg.tool_calls)
        messages.append(msg)
    group = record.get("group_id", f"record{index}")
    if not isinstance(group, (str, int)) or isinstance(group, bool):
        raise TraceFormatError(f"{where}: field 'group_id' must be a string or an integer, got {_kind(group)}")
    return ChatTrajectory(task_id=index, trial=0, reward=0.0, messages=tuple(messages)), str(group)


def _delays_field(record: dict, where: str) -> list[float] | None:
    delays = record.get("tool_latency_s")
    if delays is None:
        return None
    if not isinstance(delays, list) or not all(_finite_nonneg(d) for d in delays):
        raise TraceFormatError(f"{where}: field 'tool_latency_s' must be a list of seconds >= 0")
    return [float(d) for d in delays]


def _finite_nonneg(x: Any) -> bool:
    return isinstance(x, (int, float)) and not isinstance(x, bool) and math.isfinite(x) and x >= 0


def _text(content: Any, where: str) -> str:
    """SWE-agent content: a string, or a list of ``{"type": "text", "text": ...}`` blocks."""
    if content is None:
        return ""
    if isinstance(content, str):
        return content
    if isinstance(content, list):
        parts = []
        for j, block in enumerate(content):
            if isinstance(block, dict) and isinstance(block.get("text"), str):
                parts.append(block["text"])
            elif isinstance(block, str):
                parts.append(block)
            else:
                raise TraceFormatError(f"{where}: content block {j} has no 'text' string")
        return "".join(parts)
    raise TraceFormatError(f"{where}: field 'content' must be a string or a list of text blocks, got {_kind(content)}")


def _swe_agent(data: Any, name: str) -> tuple[ChatTrajectory, list[float] | None]:
    """A SWE-agent trajectory: its history as chat messages (tool results and observations as
    user text, tool calls as text of the assistant turn) and its steps' execution times."""
    if not isinstance(data, dict):
        raise TraceFormatError(f"{name}: a .traj file must hold an object, got {_kind(data)}")
    history, steps = data.get("history"), data.get("trajectory")
    if not isinstance(history, list) or not history:
        raise TraceFormatError(f"{name}: field 'history' must be a non-empty list of messages, got {_kind(history)}")
    if not isinstance(steps, list):
        raise TraceFormatError(f"{name}: field 'trajectory' must be a list of steps, got {_kind(steps)}")
    messages = []
    for i, m in enumerate(history):
        where = f"{name}: history message {i}"
        if not isinstance(m, dict):
            raise TraceFormatError(f"{where}: must be an object, got {_kind(m)}")
        role = m.get("role")
        if role not in ("system", "user", "assistant", "tool"):
            raise TraceFormatError(f"{where}: role {role!r} is not one of system, user, assistant, tool")
        text = _text(m.get("content"), where)
        if role == "assistant":
            calls = m.get("tool_calls") or []
            if not isinstance(calls, list):
                raise TraceFormatError(f"{where}: field 'tool_calls' must be a list, got {_kind(calls)}")
            text += "".join("\n" + json.dumps(c.get("function", c) if isinstance(c, dict) else c) for c in calls)
            messages.append(ChatMessage("assistant", text))
        else:
            messages.append(ChatMessage("system" if role == "system" else "user", text))
    delays = []
    for j, step in enumerate(steps):
        t = step.get("execution_time") if isinstance(step, dict) else None
        if t is None:
            delays = None
            break
        if not _finite_nonneg(t):
            raise TraceFormatError(f"{name}: trajectory step {j}: field 'execution_time' must be seconds >= 0, "
                                   f"got {str(t)[:40]}")
        delays.append(float(t))
    chat = ChatTrajectory(task_id=0, trial=0, reward=0.0, messages=tuple(messages))
    return chat, delays


def _fit_delays(delays: list[float] | None, turns: int, where: str) -> list[float] | None:
    """The tool seconds after each turn but the last, when the record gives one per tool call."""
    if delays is None:
        return None
    if len(delays) < turns - 1:
        raise TraceFormatError(f"{where}: {len(delays)} tool latencies for {turns} model turns (need {turns - 1} "
                               "or more: one after each turn but the last)")
    return [float(d) for d in delays[:max(turns - 1, 0)]]


# ---------------------------------------------------------------- war-train's own record
def _from_dump(record: Any, where: str) -> ReplayTrajectory:
    """A trajectory ``RolloutConfig.dump_dir`` wrote (``Trajectory.to_dict``): its tokens, each
    turn's span, and the tool seconds after it."""
    if not isinstance(record, dict):
        raise TraceFormatError(f"{where}: must be an object, got {_kind(record)}")
    for key in ("trajectory_id", "group_id", "token_ids", "turns"):
        if key not in record:
            raise TraceFormatError(f"{where}: missing required field '{key}'")
    ids = record["token_ids"]
    if not isinstance(ids, list) or not all(isinstance(x, int) and not isinstance(x, bool) and 0 <= x < 2**31
                                            for x in ids):
        raise TraceFormatError(f"{where}: field 'token_ids' must be a list of token ids")
    tokens = np.asarray(ids, dtype=np.int32)
    tokens.flags.writeable = False
    raw_turns = record["turns"]
    if not isinstance(raw_turns, list) or not raw_turns:
        raise TraceFormatError(f"{where}: field 'turns' must be a non-empty list, got {_kind(raw_turns)}")
    spans, delays = [], []
    for k, t in enumerate(raw_turns):
        if not isinstance(t, dict) or not all(isinstance(t.get(f), int) for f in ("start", "end")):
            raise TraceFormatError(f"{where}: turn {k}: fields 'start' and 'end' must be integers")
        start, end = t["start"], t["end"]
        prev_end = spans[-1][1] if spans else 1
        if not (prev_end <= start <= end <= len(tokens)) or start < 1:
            raise TraceFormatError(f"{where}: turn {k}: span [{start}, {end}) is not inside the tokens after the "
                                   f"previous turn ({len(tokens)} tokens)")
        spans.append((start, end))
        tool = t.get("tool_s")
        delays.append(float(tool) if _finite_nonneg(tool) else None)
    turns = []
    for k, (start, end) in enumerate(spans):
        nxt = spans[k + 1][0] if k + 1 < len(spans) else end
        turns.append(Turn(tokens[:start], tokens[start:end], int(nxt - end)))
    recorded = delays[:-1]
    return ReplayTrajectory(str(record["trajectory_id"]), str(record["group_id"]), turns,
                            None if any(d is None for d in recorded) else recorded, where.split(": ")[0])


def trace_summary(trace_set: TraceSet) -> dict[str, Any]:
    """Counts a prediction reports beside its numbers: what it was computed from."""
    turns = [len(t.turns) for t in trace_set.trajectories]
    resp = [int(x.response_token_ids.size) for t in trace_set.trajectories for x in t.turns]
    delays = trace_set.recorded_tool_delays
    return {"trajectories": len(turns), "groups": len({t.group_id for t in trace_set.trajectories}),
            "turns": int(sum(turns)), "turns_per_trajectory_median": float(np.median(turns)) if turns else 0.0,
            "response_tokens_median": float(np.median(resp)) if resp else 0.0,
            "recorded_tool_latency_median_s": float(np.median(delays)) if delays else None,
            "files": trace_set.files}

