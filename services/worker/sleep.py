"""--enable-sleep-mode on one worker: what /sleep frees and /wake_up restores.

    level 1   the KV cache is freed (every reference: the layers', the CUDA graphs', the
              native decode stack's); on CUDA the weights move to pinned host memory and
              their device memory is freed; on CPU the weights already are in host memory
              and stay where they are.
    level 2   the KV cache and the whole model runner are dropped; waking loads the
              weights from the checkpoint again.
    wake_up   "weights" first (copied back, or loaded again), then "kv_cache" (a new cache
              bound as at start-up, CUDA graphs captured again over the new addresses).

The scheduler's side (no request in flight, every block free, no cached prefix) is the
engine core's (EngineCore.sleep).
"""

from __future__ import annotations

import ctypes
import ctypes.util
import gc

import torch
from torch import nn


class HostWeights:
    """A module's parameters and buffers, moved to pinned host memory (level 1 on CUDA);
    `restore` copies them back to `device` into the same Parameter objects (tied weights
    stay tied: each tensor moves once)."""

    def __init__(self, model: nn.Module):
        self.saved: dict[int, tuple[torch.Tensor, torch.Tensor]] = {}  # id -> (tensor, host)
        for tensor in _tensors(model):
            if id(tensor) in self.saved or tensor.device.type != "cuda":
                continue
            host = torch.empty(tensor.shape, dtype=tensor.dtype, pin_memory=True)
            host.copy_(tensor.data)
            self.saved[id(tensor)] = (tensor, host)
            tensor.data = torch.empty(0, dtype=tensor.dtype, device=tensor.device)
        torch.cuda.synchronize()

    @property
    def num_bytes(self) -> int:
        return sum(host.numel() * host.element_size() for _, host in self.saved.values())

    def restore(self, device: torch.device) -> None:
        for tensor, host in self.saved.values():
            tensor.data = host.to(device, non_blocking=True)
        torch.cuda.synchronize(device)
        self.saved.clear()


def _tensors(model: nn.Module) -> list[torch.Tensor]:
    tensors: list[torch.Tensor] = []
    for module in model.modules():
        tensors.extend(p for p in module._parameters.values() if p is not None)
        tensors.extend(b for b in module._buffers.values() if b is not None)
    return tensors


def release_memory(device: torch.device) -> None:
    """Return what dropped references held: to the allocator, the device's cache, and on
    glibc the heap's free pages to the OS (malloc_trim), so the process's RSS shows it."""
    gc.collect()
    if device.type == "cuda":
        torch.cuda.empty_cache()
    try:
        libc = ctypes.CDLL(ctypes.util.find_library("c") or "libc.so.6")
        libc.malloc_trim(0)
    except (OSError, AttributeError):  # not glibc: the allocator keeps its free pages
        pass
