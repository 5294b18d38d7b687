"""KV store test helpers: a real `kvserve kv-store` process, tiny layouts, random caches."""

from __future__ import annotations

import os
import signal
import subprocess
import sys
import tempfile
import uuid

import torch

from kvserve.shared.messages import KvFingerprint
from tests.support.ports import free_port


class StoreProcess:
    """A `kvserve kv-store` subprocess bound to a fresh ipc:// path and a tcp:// port; its
    output goes to `log_path` when given (else to the test's own)."""

    def __init__(self, *args: str, log_path: str | None = None):
        base = os.path.join(tempfile.gettempdir(), f"kvserve-kvtest-{uuid.uuid4().hex[:10]}")
        self.ipc = f"ipc://{base}"
        self.tcp = f"tcp://127.0.0.1:{free_port()}"
        self.args = args
        self.log_path = log_path
        self.proc = self._start()

    def _start(self) -> subprocess.Popen:
        command = [sys.executable, "-m", "kvserve.cli", "kv-store"]
        command += ["--address", f"{self.ipc},{self.tcp}", *self.args]
        if self.log_path is None:
            return subprocess.Popen(command)
        with open(self.log_path, "a") as log:
            return subprocess.Popen(command, stdout=log, stderr=subprocess.STDOUT)

    def restart(self) -> None:
        self.proc = self._start()

    def kill(self) -> None:
        self.proc.send_signal(signal.SIGKILL)
        self.proc.wait(5)

    def stop(self) -> int:
        if self.proc.poll() is None:
            self.proc.send_signal(signal.SIGTERM)
        return self.proc.wait(10)


def tiny_fingerprint(dtype: str = "float32", **changes) -> KvFingerprint:
    """2 layers, 2 KV heads of 8, blocks of 4 tokens: 1 KiB per block in float32."""
    fields = dict(model="tiny", dtype=dtype, block_size=4, num_layers=2, num_kv_heads=2)
    return KvFingerprint(**{**fields, "head_size": 8, **changes})


def random_caches(fp: KvFingerprint, num_blocks: int, seed: int = 0) -> list[torch.Tensor]:
    """Paged caches of layout `fp`, as ModelRunner.initialize_kv_cache shapes them."""
    generator = torch.Generator().manual_seed(seed)
    shape = (2, num_blocks, fp.block_size, fp.num_kv_heads, fp.head_size)
    dtype = getattr(torch, fp.dtype)
    return [torch.randn(shape, generator=generator).to(dtype) for _ in range(fp.num_layers)]


def chain(tag: str, num_blocks: int) -> list[bytes]:
    """Distinct 32-byte block hashes named by `tag`."""
    return [f"{tag}-{i}".encode().ljust(32, b".") for i in range(num_blocks)]
