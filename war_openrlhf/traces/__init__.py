"""OpenAI-chat agent traces, validated and tokenized into turns.

``load_chat_traces`` reads trace files (tau-bench style records whose ``traj`` is an
OpenAI chat transcript) into :class:`ChatTrajectory` objects and rejects any
malformed input with a :class:`TraceFormatError` that says where it is;
``render_chat`` renders a conversation with the Qwen2.5-Instruct chat template;
``tokenize_traces`` turns each trajectory into one :class:`Turn` per assistant
message (the prompt of that model call, its response, and the environment
tokens that follow), with the Qwen2.5 tokenizer by default, such that every
context is an exact token prefix of the next; ``group_trajectories`` collects the
trials of a task, which behave like the samples of one GRPO group.
"""

from .chat_template import (
    DEFAULT_SYSTEM_PROMPT,
    GENERATION_PROMPT,
    ChatBlock,
    render_assistant_response,
    render_blocks,
    render_chat,
)
from .chat_traces import ROLES, ChatMessage, ChatTrajectory, ToolCall, TraceFormatError, load_chat_traces
from .turns import (
    QWEN25_SPECIAL_TOKENS,
    TokenizedTrajectory,
    Tokenizer,
    Turn,
    group_trajectories,
    qwen25_tokenizer,
    task_halves,
    tokenize_traces,
)

__all__ = [
    "DEFAULT_SYSTEM_PROMPT",
    "GENERATION_PROMPT",
    "QWEN25_SPECIAL_TOKENS",
    "ROLES",
    "ChatBlock",
    "ChatMessage",
    "ChatTrajectory",
    "TokenizedTrajectory",
    "Tokenizer",
    "ToolCall",
    "TraceFormatError",
    "Turn",
    "group_trajectories",
    "task_halves",
    "load_chat_traces",
    "qwen25_tokenizer",
    "render_assistant_response",
    "render_blocks",
    "render_chat",
    "tokenize_traces",
]
