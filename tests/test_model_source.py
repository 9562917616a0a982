"""Model names: a local directory as it is, a hub id through the hub client's cache (local
files only here: a cache laid out as huggingface_hub writes it, read with HF_HUB_OFFLINE=1)."""

from __future__ import annotations

import json

import pytest

from war_openrlhf.engine.config import EngineConfig, check_startup
from war_openrlhf.model_source import ModelNotFound, resolve_model


def _fake_hub_cache(root, repo_id: str, files: dict[str, str]):
    """The layout huggingface_hub's snapshot_download reads offline: refs/main -> snapshot."""
    repo = root / ("models--" + repo_id.replace("/", "--"))
    rev = "0123456789abcdef0123456789abcdef01234567"
    (repo / "refs").mkdir(parents=True)
    (repo / "refs" / "main").write_text(rev)
    snap = repo / "snapshots" / rev
    snap.mkdir(parents=True)
    for name, text in files.items():
        (snap / name).write_text(text)
    return snap


def test_a_hub_id_resolves_through_the_cache_and_passes_the_engine_checks(tmp_path, monkeypatch):
    from war_openrlhf.fixtures.tiny_model import build_tiny_model

    local = build_tiny_model(tmp_path / "tiny")
    files = {p.name: p.read_text() for p in local.iterdir() if p.suffix in (".json", ".jinja") or p.name == "tokenizer.json"}
    snap = _fake_hub_cache(tmp_path / "hub", "acme/tiny-agent", files)
    monkeypatch.setenv("HF_HUB_CACHE", str(tmp_path / "hub"))
    monkeypatch.setenv("HF_HUB_OFFLINE", "1")
    import huggingface_hub.constants as c

    monkeypatch.setattr(c, "HF_HUB_CACHE", str(tmp_path / "hub"))
    monkeypatch.setattr(c, "HF_HUB_OFFLINE", True)
    resolve_model.cache_clear()
    assert resolve_model("acme/tiny-agent") == snap
    assert json.loads((snap / "config.json").read_text())["model_type"] == "llama"
    check_startup(EngineConfig(model="acme/tiny-agent", dtype="float32", max_model_len=256), cuda=False)
    # not cached, offline: one message naming the model and what to do
    with pytest.raises(ModelNotFound, match="'acme/missing' is not a directory and the hub could not provide it.*"
                                            "HF_HUB_OFFLINE is set"):
        resolve_model("acme/missing")
    resolve_model.cache_clear()


def test_paths_that_are_not_model_directories_say_so(tmp_path):
    with pytest.raises(ModelNotFound, match="is not a directory, and not a hub id"):
        resolve_model(str(tmp_path / "nope"))
    (tmp_path / "empty").mkdir()
    with pytest.raises(ModelNotFound, match="a directory without config.json"):
        resolve_model(str(tmp_path / "empty"))
    with pytest.raises(ValueError, match="EngineConfig.model: .* is not a directory"):
        check_startup(EngineConfig(model="./relative/missing"), cuda=False)
