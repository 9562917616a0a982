"""A turn's ``action_text``: the text vLLM returns for it (``CompletionOutput.text``).

OpenRLHF's executor hands the agent ``request_output.outputs[0].text`` (openrlhf/utils/agent.py:105),
detokenized in the engine by vLLM 0.29's incremental detokenizer (vllm/v1/engine/detokenizer.py).
WAR's engines send that text with each turn (``generate_tokens``'s ``text``) and the episode uses
it. For an engine that sends token ids only, the pool rebuilds the text here, the way vLLM builds it
(and tests check the two agree):

* streamed after the turn's context (``DecodeStream(ids=context)``, detokenizer.py:184), so a
  token's text depends on what precedes it (a leading space, a UTF-8 sequence split across turns);
* with the request's ``skip_special_tokens`` (OpenRLHF's own requests keep them:
  openrlhf/trainer/ppo_utils/samples_generator.py:205) and ``spaces_between_special_tokens``;
* without the stop token that ended the turn (EOS or ``stop_token_ids``; detokenizer.py:96-144)
  and cut at a stop string, unless ``include_stop_str_in_output``; empty if ``detokenize=False``.

The token ids themselves are never changed: the trajectory keeps every sampled token.
"""

from __future__ import annotations

from typing import Any, Sequence

_INVALID_PREFIX = "Invalid prefix encountered"  # tokenizers' error vLLM recovers from (detokenizer.py:28)


class _FastStream:
    """vLLM's ``FastIncrementalDetokenizer.decode_next`` (detokenizer.py:168-248) on a fast tokenizer."""

    def __init__(self, backend: Any, context: Sequence[int], params: Any) -> None:
        from tokenizers.decoders import DecodeStream

        self._new = DecodeStream
        self.backend, self.skip = backend, bool(params.skip_special_tokens)
        self.stream = DecodeStream(ids=list(context), skip_special_tokens=self.skip)
        self.spaces = self.skip or bool(params.spaces_between_special_tokens)
        self.added: dict[int, str] = {}
        if not self.spaces:
            self.added = {tid: t.content for tid, t in backend.get_added_tokens_decoder().items()}
            self.spaces = not self.added
        self.last_special = False

    def next(self, token_id: int) -> str:
        try:
            text = self.stream.step(self.backend, token_id)
        except (OverflowError, TypeError):
            text = None
        except Exception as exc:  # noqa: BLE001 - vLLM restarts the stream on exactly this error
            if not str(exc).startswith(_INVALID_PREFIX):
                raise
            self.stream = self._new(skip_special_tokens=self.skip)
            text = self.stream.step(self.backend, token_id)
        if not self.spaces:
            special = self.added.get(token_id)
            if special is not None and self.last_special:
                text = special
            self.last_special = special is not None
        return text or ""


class _PrefixStream:
    """Any other tokenizer: each token's text is what it adds to the decoded turn so far."""

    def __init__(self, tokenizer: Any, params: Any) -> None:
        self.tokenizer, self.skip = tokenizer, bool(params.skip_special_tokens)
        self.ids: list[int] = []
        self.text = ""

    def next(self, token_id: int) -> str:
        self.ids.append(token_id)
        full = self.tokenizer.decode(self.ids, skip_special_tokens=self.skip)
        new = full[len(self.text):] if full.startswith(self.text) else full
        self.text = full
        return new


def _stream(tokenizer: Any, context: Sequence[int], params: Any):
    from tokenizers import Tokenizer

    backend = getattr(tokenizer, "_tokenizer", None)
    if isinstance(backend, Tokenizer):  # vLLM's test: a transformers fast tokenizer (detokenizer.py:61)
        return _FastStream(backend, context, params)
    return _PrefixStream(tokenizer, params)


def _stop_string(text: str, new_chars: int, stops: list[str], include: bool) -> int | None:
    """Where vLLM cuts ``text`` for a stop string completed in its last ``new_chars`` characters
    (``check_stop_strings``, detokenizer.py:310-362); None when none completes there."""
    if not new_chars:
        return None
    best_start, best_end = None, None
    for stop in stops:
        start = text.find(stop, 1 - new_chars - len(stop))
        if start != -1 and (best_end is None or start + len(stop) < best_end):
            best_start, best_end = start, start + len(stop)
    if best_end is None:
        return None
    return best_end if include else best_start


def action_text(tokenizer: Any, context: Sequence[int], token_ids: Sequence[int], finish_reason: str | None,
                params: Any) -> str:
    """The ``.text`` vLLM returns for a turn that generated ``token_ids`` after ``context`` with the
    ``SamplingParams`` ``params`` and ended with ``finish_reason``.

    A turn that finished with ``"stop"`` ended at a stop token (left out of the text) or at a stop
    string. The engine does not say which: a last token that is the tokenizer's EOS or one of
    ``stop_token_ids`` is a stop token (vllm/v1/core/sched/utils.py:100-108 checks those first);
    any other is one only if no stop string completes with it (the model's generation config may
    add EOS ids the tokenizer does not name)."""
    if not params.detokenize:
        return ""
    stops = [params.stop] if isinstance(params.stop, str) else list(params.stop or [])
    include = bool(params.include_stop_str_in_output)
    ids = [int(t) for t in token_ids]
    last = None
    if finish_reason == "stop" and ids and not include:
        ids, last = ids[:-1], ids[-1]
    stream = _stream(tokenizer, context, params)
    min_tokens = int(params.min_tokens or 0)
    text = ""
    for n, tok in enumerate(ids, 1):  # BaseIncrementalDetokenizer.update, one token per step
        checked = len(text)
        text += stream.next(tok)
        if min_tokens and n <= min_tokens:
            checked = len(text)
        if stops and n > min_tokens:
            cut = _stop_string(text, len(text) - checked, stops, include)
            if cut is not None:
                return text[:cut]
    stop_ids = set(params.stop_token_ids or ())
    if not params.ignore_eos and getattr(tokenizer, "eos_token_id", None) is not None:
        stop_ids.add(tokenizer.eos_token_id)
    if last is not None and last not in stop_ids and stops and len(ids) + 1 > min_tokens:
        with_last = text + stream.next(last)
        cut = _stop_string(with_last, len(with_last) - len(text), stops, include)
        if cut is not None:  # a stop string, not a stop token, ended the turn
            return with_last[:cut]
    return text
