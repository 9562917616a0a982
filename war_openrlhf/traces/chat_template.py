"""The Qwen2.5-Instruct chat template, rendered to text in plain Python.

Why: token counts, prefix-cache hits and suffix matches depend on the exact text
the model is fed, so this reproduces the official Qwen2.5-Instruct Jinja template
(``tokenizer_config.json`` of Qwen/Qwen2.5-*-Instruct) character for character,
as transformers renders it:

- every message is a block ``<|im_start|>{role}\\n{content}<|im_end|>\\n``; when the
  first message is not a system message the template's default system prompt
  comes first;
- an assistant message with tool calls is ``<|im_start|>assistant``, then
  ``\\n{content}`` if the content is non-empty, then one
  ``\\n<tool_call>\\n{"name": "...", "arguments": {...}}\\n</tool_call>`` per call,
  then ``<|im_end|>\\n``; the arguments object is serialised like the template's
  ``tojson`` filter in transformers (``json.dumps`` with ``ensure_ascii=False``),
  after decoding the OpenAI JSON string as vLLM does;
- a run of consecutive ``tool`` messages is one ``<|im_start|>user`` block holding
  one ``\\n<tool_response>\\n{content}\\n</tool_response>`` per message;
- the generation prompt is ``<|im_start|>assistant\\n``.

Not rendered: the ``# Tools`` section with the tools' JSON schemas that the
template adds to the system prompt when it is given ``tools=``. The traces do not
carry the schemas, so this is the template's ``tools=None`` branch; the system
prompt of a real rollout would be longer by that (constant, per-task) section.
"""

from __future__ import annotations

import json
from dataclasses import dataclass
from typing import Sequence

from .chat_traces import ChatMessage, ToolCall

__all__ = [
    "DEFAULT_SYSTEM_PROMPT",
    "GENERATION_PROMPT",
    "IM_END",
    "IM_START",
    "ChatBlock",
    "render_assistant_response",
    "render_blocks",
    "render_chat",
]

IM_START = "<|im_start|>"
IM_END = "<|im_end|>"
#: What the template appends with ``add_generation_prompt=True``; the model generates after it.
GENERATION_PROMPT = IM_START + "assistant\n"
#: The template's system prompt when the conversation does not start with one.
DEFAULT_SYSTEM_PROMPT = "You are Qwen, created by Alibaba Cloud. You are a helpful assistant."


@dataclass(frozen=True)
class ChatBlock:
    """One ``<|im_start|>...<|im_end|>\\n`` block of a rendered conversation.

    It renders ``messages[start:stop]``: one message, a run of tool messages
    (``role == "user"``, as the template writes it), or none for the default
    system prompt (``start == stop == 0``). Blocks begin and end at special
    tokens, so tokenizing them one by one gives the tokens of the whole text.
    """

    role: str
    start: int
    stop: int
    text: str


def _render_tool_call(call: ToolCall) -> str:
    arguments = json.dumps(call.arguments, ensure_ascii=False)
    return '\n<tool_call>\n{"name": "' + call.name + '", "arguments": ' + arguments + "}\n</tool_call>"


def _render_assistant_block(message: ChatMessage) -> str:
    if not message.tool_calls:
        return GENERATION_PROMPT + message.content + IM_END + "\n"
    text = IM_START + "assistant"
    if message.content:
        text += "\n" + message.content
    text += "".join(_render_tool_call(call) for call in message.tool_calls)
    return text + IM_END + "\n"


def render_assistant_response(message: ChatMessage) -> str:
    """The text the model generates for an assistant message, after the generation
    prompt: content, tool-call blocks and the closing ``<|im_end|>``."""
    if message.role != "assistant":
        raise ValueError(f"not an assistant message: role {message.role!r}")
    block = _render_assistant_block(message)
    # Both template branches start with the generation prompt: the tool-call branch
    # adds "\n" before the content or, without content, before the first <tool_call>.
    assert block.startswith(GENERATION_PROMPT) and block.endswith(IM_END + "\n")
    return block[len(GENERATION_PROMPT) : -1]


def render_blocks(messages: Sequence[ChatMessage]) -> list[ChatBlock]:
    """Split the rendered conversation into its ``<|im_start|>`` blocks, in order."""
    blocks: list[ChatBlock] = []
    if not messages or messages[0].role != "system":
        text = IM_START + "system\n" + DEFAULT_SYSTEM_PROMPT + IM_END + "\n"
        blocks.append(ChatBlock("system", 0, 0, text))
    i = 0
    while i < len(messages):
        message = messages[i]
        if message.role == "tool":
            j = i
            while j < len(messages) and messages[j].role == "tool":
                j += 1
            responses = "".join(
                "\n<tool_response>\n" + m.content + "\n</tool_response>" for m in messages[i:j]
            )
            blocks.append(ChatBlock("user", i, j, IM_START + "user" + responses + IM_END + "\n"))
            i = j
            continue
        if message.role == "assistant":
            text = _render_assistant_block(message)
        else:
            text = IM_START + message.role + "\n" + message.content + IM_END + "\n"
        blocks.append(ChatBlock(message.role, i, i + 1, text))
        i += 1
    return blocks


def render_chat(messages: Sequence[ChatMessage], add_generation_prompt: bool = False) -> str:
    """The whole conversation as the Qwen2.5 template renders it (without tools)."""
    text = "".join(block.text for block in render_blocks(messages))
    return text + GENERATION_PROMPT if add_generation_prompt else text
