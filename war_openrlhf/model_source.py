"""Where a model named on the command line lives: a local directory or a Hugging Face hub id.

OpenRLHF users pass hub ids (``--actor.model_name_or_path Qwen/Qwen2.5-7B-Instruct``), which
vLLM and transformers accept. WAR's start-up checks read the model's files (``config.json``
for the KV size per token), so a name is resolved first, once per node: a directory is used
as it is; any other name goes through ``huggingface_hub.snapshot_download``, whose cache
(``HF_HOME`` / ``HF_HUB_CACHE``) makes the second resolution on a node free and
``HF_HUB_OFFLINE=1`` makes it read only what is cached. Only the files the checks and the
tokenizer need are fetched here (``config.json``, tokenizer files); the weights are left to
vLLM and transformers, which fetch them the same way.
"""

from __future__ import annotations

import functools
import os
from pathlib import Path

__all__ = ["resolve_model", "ModelNotFound"]

# What the start-up checks and tokenizers read; weights are fetched by their loaders.
_CHECK_FILES = ["config.json", "generation_config.json", "tokenizer*", "special_tokens_map.json", "vocab*",
                "merges.txt", "*.tiktoken", "chat_template*"]


class ModelNotFound(ValueError):
    """The name is neither a model directory nor a hub id this node can fetch."""


def _looks_like_hub_id(name: str) -> bool:
    parts = name.split("/")
    return 1 <= len(parts) <= 2 and all(p and not p.startswith(".") and " " not in p for p in parts) \
        and not name.startswith(("/", "~", "."))


@functools.lru_cache(maxsize=64)
def resolve_model(name: str) -> Path:
    """The local directory holding ``name``'s config and tokenizer files (fetched once per node).

    Raises :class:`ModelNotFound` naming the model, and saying whether it was looked up as a
    path or as a hub id and why that failed.
    """
    name = str(name)
    path = Path(os.path.expanduser(name))
    if path.is_dir():
        if not (path / "config.json").is_file():
            raise ModelNotFound(f"'{name}' is a directory without config.json; is it a HF model directory?")
        return path
    if not _looks_like_hub_id(name):
        raise ModelNotFound(f"'{name}' is not a directory, and not a hub id (org/name); pass a local HF model "
                            "directory or a Hugging Face hub id")
    try:
        from huggingface_hub import snapshot_download

        local = Path(snapshot_download(repo_id=name, allow_patterns=_CHECK_FILES))
    except Exception as exc:  # noqa: BLE001 - one message whatever the hub client raised
        offline = os.environ.get("HF_HUB_OFFLINE", "") not in ("", "0")
        hint = ("HF_HUB_OFFLINE is set and the model is not in this node's cache; download it once "
                "(huggingface-cli download " + name + ") or pass a local directory") if offline else \
            "check the name, the network and HF_TOKEN for gated models, or pass a local directory"
        raise ModelNotFound(f"'{name}' is not a directory and the hub could not provide it "
                            f"({type(exc).__name__}: {str(exc)[:200]}); {hint}") from exc
    if not (local / "config.json").is_file():
        raise ModelNotFound(f"hub model '{name}' has no config.json")
    return local
