"""Hub ids resolve from the local Hugging Face cache, offline, as vLLM finds them."""

from __future__ import annotations

import os
import time

import pytest

from kvserve.services.worker.model_loader import hub_cache_dir, resolve_model


def _snapshot(cache: str, repo_id: str, commit: str, with_config: bool = True) -> str:
    """A snapshot laid out as huggingface_hub writes one (files link into blobs/)."""
    repo = os.path.join(cache, "models--" + repo_id.replace("/", "--"))
    snapshot = os.path.join(repo, "snapshots", commit)
    os.makedirs(snapshot)
    os.makedirs(os.path.join(repo, "blobs"), exist_ok=True)
    if with_config:
        blob = os.path.join(repo, "blobs", commit + "-config")
        with open(blob, "w") as f:
            f.write("{}")
        os.symlink(blob, os.path.join(snapshot, "config.json"))
    return snapshot


def _ref(cache: str, repo_id: str, commit: str) -> None:
    refs = os.path.join(cache, "models--" + repo_id.replace("/", "--"), "refs")
    os.makedirs(refs, exist_ok=True)
    with open(os.path.join(refs, "main"), "w") as f:
        f.write(commit)


def test_hub_id_resolves_to_the_main_ref_snapshot(tmp_path, monkeypatch):
    cache = str(tmp_path / "hub")
    monkeypatch.setenv("HF_HUB_CACHE", cache)
    main = _snapshot(cache, "Qwen/Qwen2.5-0.5B-Instruct", "aaaa")
    _snapshot(cache, "Qwen/Qwen2.5-0.5B-Instruct", "bbbb")  # newer, but not main
    _ref(cache, "Qwen/Qwen2.5-0.5B-Instruct", "aaaa")
    assert resolve_model("Qwen/Qwen2.5-0.5B-Instruct") == main


def test_without_a_ref_the_newest_complete_snapshot_is_taken(tmp_path, monkeypatch):
    cache = str(tmp_path / "hub")
    monkeypatch.setenv("HF_HUB_CACHE", cache)
    old = _snapshot(cache, "org/model", "old")
    newest_incomplete = _snapshot(cache, "org/model", "partial", with_config=False)
    now = time.time()
    os.utime(old, (now - 100, now - 100))
    os.utime(newest_incomplete, (now, now))
    assert resolve_model("org/model") == old


def test_hf_home_is_the_fallback_cache(tmp_path, monkeypatch):
    monkeypatch.delenv("HF_HUB_CACHE", raising=False)
    monkeypatch.setenv("HF_HOME", str(tmp_path / "home"))
    assert hub_cache_dir() == str(tmp_path / "home" / "hub")
    snapshot = _snapshot(hub_cache_dir(), "gpt2", "cccc")
    assert resolve_model("gpt2") == snapshot


def test_a_missing_id_names_the_cache_it_searched(tmp_path, monkeypatch):
    cache = str(tmp_path / "hub")
    monkeypatch.setenv("HF_HUB_CACHE", cache)
    with pytest.raises(ValueError) as exc:
        resolve_model("meta-llama/Llama-3.2-1B")
    message = str(exc.value)
    assert cache in message and "models--meta-llama--Llama-3.2-1B" in message
    assert "never downloads" in message


def test_a_missing_path_is_not_taken_for_a_hub_id(tmp_path):
    with pytest.raises(ValueError, match="neither a folder nor a .gguf file"):
        resolve_model(str(tmp_path / "no" / "such" / "folder"))
