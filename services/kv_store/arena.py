"""The store's slots: fixed-size blocks in POSIX shared memory (or CUDA memory), one arena per
pool (layout fingerprint).

    arena of a pool:  | slot 0 | slot 1 | ... | slot S-1 |      slot_bytes = fingerprint.block_bytes
    one slot:         | layer 0: K V | layer 1: K V | ... |      [num_layers, 2, block_elements]

A slot is one contiguous byte range, so a run of consecutive slots is one contiguous buffer:
the tcp path sends it as a single zero-copy frame, and a client copies a run with one
index_select / index_copy_ per layer (services/kv_store/blocks.py).

The store creates the segment and registers it with Python's resource tracker, which unlinks
it even when the store is killed with SIGKILL; clients map it with shm_open + mmap and stay
out of the tracker (theirs would unlink the store's segment when they exit).
"""

from __future__ import annotations

import _posixshmem  # CPython's POSIX shm module, what multiprocessing.shared_memory uses
import contextlib
import hashlib
import mmap
import os
from collections.abc import Sequence
from multiprocessing import resource_tracker
from typing import Any

import numpy as np

from kvserve.shared.messages import KvCudaArenaHandle, KvHostArenaHandle

_PAGE = mmap.PAGESIZE


def arena_shm_name(address: str, pool_key: bytes) -> str:
    """A segment name derived from the store's address and the pool, plus the store's pid so a
    restarted store never meets the segment of its killed predecessor (still being unlinked)."""
    where = hashlib.sha256(address.encode()).hexdigest()[:12]
    return f"kvserve-kv-{where}-{pool_key.hex()[:8]}-{os.getpid()}"


def slot_runs(slots: Sequence[int]) -> list[tuple[int, int, int]]:
    """(position in the batch, first slot, length) of each run of consecutive slots.

    >>> slot_runs([7, 8, 9, 3, 4])
    [(0, 7, 3), (3, 3, 2)]
    """
    if not slots:
        return []
    slots_np = np.asarray(slots, dtype=np.int64)
    starts = np.flatnonzero(np.diff(slots_np) != 1) + 1
    bounds = [0, *starts.tolist(), len(slots_np)]
    return [(a, int(slots_np[a]), b - a) for a, b in zip(bounds, bounds[1:])]


class HostArena:
    """Slots in a shared-memory segment; the store's side owns (and unlinks) it.

    Build it with `HostArena.create(...)` (store) or `HostArena.attach(handle)` (client).

    Args:
        handle: segment name and geometry.
        mapping: the mmap of the whole segment.
        owner: whether close() unlinks the segment.
    """

    def __init__(self, handle: KvHostArenaHandle, mapping: mmap.mmap, owner: bool):
        self.handle = handle
        self.owner = owner
        self._mmap: mmap.mmap | None = mapping
        # [num_slots, slot_bytes] uint8, the store's view (numpy: the store needs no torch).
        self.slots_np = np.frombuffer(mapping, dtype=np.uint8).reshape(
            handle.num_slots, handle.slot_bytes
        )

    @classmethod
    def create(cls, name: str, num_slots: int, slot_bytes: int) -> HostArena:
        handle = KvHostArenaHandle(name, num_slots, slot_bytes)
        fd = _posixshmem.shm_open("/" + name, os.O_CREAT | os.O_EXCL | os.O_RDWR, mode=0o600)
        try:
            # Sparse: tmpfs allocates a page when it is first written, not here.
            os.ftruncate(fd, num_slots * slot_bytes)
            mapping = mmap.mmap(fd, num_slots * slot_bytes)
        except BaseException:
            _posixshmem.shm_unlink("/" + name)
            raise
        finally:
            os.close(fd)
        resource_tracker.register("/" + name, "shared_memory")
        return cls(handle, mapping, owner=True)

    @classmethod
    def attach(cls, handle: KvHostArenaHandle) -> HostArena:
        fd = _posixshmem.shm_open("/" + handle.shm_name, os.O_RDWR, mode=0o600)
        try:
            mapping = mmap.mmap(fd, handle.num_slots * handle.slot_bytes)
        finally:
            os.close(fd)
        return cls(handle, mapping, owner=False)

    @property
    def buffer(self) -> mmap.mmap:
        assert self._mmap is not None, "arena closed"
        return self._mmap

    def read_run(self, first_slot: int, num_slots: int) -> memoryview:
        """Slots [first_slot, first_slot + num_slots) as one buffer, without a copy."""
        return self.slots_np[first_slot : first_slot + num_slots].data

    def write_run(self, first_slot: int, data: np.ndarray) -> None:
        """Copy `data` (uint8 [num_slots, slot_bytes]) into slots from first_slot on."""
        self.slots_np[first_slot : first_slot + len(data)] = data

    def slot_buffer(self, slot: int) -> memoryview:
        """The slot's bytes, writable in place (a disk read lands here directly)."""
        return self.slots_np[slot].data

    def release_pages(self, slot: int) -> None:
        """Give a free slot's memory back to the OS (the whole pages inside it), so pools of
        several layouts together stay within the store's --size."""
        if self._mmap is None:
            return
        start = slot * self.handle.slot_bytes
        first = -(-start // _PAGE) * _PAGE
        last = (start + self.handle.slot_bytes) // _PAGE * _PAGE
        if last > first:
            self._mmap.madvise(mmap.MADV_REMOVE, first, last - first)

    def close(self) -> None:
        """Unmap (and, for the store, unlink). Views still alive keep the mapping until they go."""
        if self._mmap is None:
            return
        mapping, self._mmap = self._mmap, None
        del self.slots_np
        with contextlib.suppress(BufferError):  # a torch view outlives us: GC unmaps later
            mapping.close()
        if self.owner:
            with contextlib.suppress(FileNotFoundError):
                _posixshmem.shm_unlink("/" + self.handle.shm_name)
            resource_tracker.unregister("/" + self.handle.shm_name, "shared_memory")


# ------------------------------------------------------------------------------- CUDA IPC

# torch's UntypedStorage._share_cuda_() returns, in this order:
#   (device, storage handle, size bytes, offset bytes, ref-counter handle, ref-counter offset,
#    event handle, event sync required)
_CUDA_SHARE_FIELDS = 8


def pack_cuda_handle(shared: tuple[Any, ...], num_slots: int, slot_bytes: int) -> KvCudaArenaHandle:
    """The wire form of `storage._share_cuda_()`'s tuple."""
    if len(shared) != _CUDA_SHARE_FIELDS:
        raise ValueError(f"_share_cuda_() gave {len(shared)} fields, expected {_CUDA_SHARE_FIELDS}")
    device, handle, size, offset, ref_handle, ref_offset, event, sync = shared
    return KvCudaArenaHandle(
        device=int(device),
        storage_handle=bytes(handle),
        storage_size_bytes=int(size),
        storage_offset_bytes=int(offset),
        ref_counter_handle=bytes(ref_handle),
        ref_counter_offset=int(ref_offset),
        event_handle=bytes(event),
        event_sync_required=bool(sync),
        num_slots=num_slots,
        slot_bytes=slot_bytes,
    )


def unpack_cuda_handle(handle: KvCudaArenaHandle) -> tuple[Any, ...]:
    """The arguments of `torch.UntypedStorage._new_shared_cuda(*args)`: the inverse of
    pack_cuda_handle."""
    return (
        handle.device,
        handle.storage_handle,
        handle.storage_size_bytes,
        handle.storage_offset_bytes,
        handle.ref_counter_handle,
        handle.ref_counter_offset,
        handle.event_handle,
        handle.event_sync_required,
    )


class CudaArena:
    """Slots in the store's CUDA memory, exported to clients on its host with CUDA IPC.

    Args:
        device: the CUDA device index.
        num_slots: slots in the arena.
        slot_bytes: bytes of one slot.
    """

    def __init__(self, device: int, num_slots: int, slot_bytes: int):
        import torch

        if not torch.cuda.is_available():
            raise ValueError("--device cuda needs a CUDA device; use --device cpu")
        self.slots = torch.empty(num_slots, slot_bytes, dtype=torch.uint8, device=f"cuda:{device}")
        shared = self.slots.untyped_storage()._share_cuda_()
        self.handle = pack_cuda_handle(shared, num_slots, slot_bytes)

    @staticmethod
    def attach(handle: KvCudaArenaHandle) -> Any:
        """The arena as a uint8 tensor [num_slots, slot_bytes] on the store's device."""
        import torch

        storage = torch.UntypedStorage._new_shared_cuda(*unpack_cuda_handle(handle))
        flat = torch.empty(0, dtype=torch.uint8, device=f"cuda:{handle.device}")
        flat.set_(storage)
        return flat[: handle.num_slots * handle.slot_bytes].view(
            handle.num_slots, handle.slot_bytes
        )

    def read_run(self, first_slot: int, num_slots: int) -> memoryview:
        return self.slots[first_slot : first_slot + num_slots].cpu().numpy().data

    def write_run(self, first_slot: int, data: np.ndarray) -> None:
        import torch

        self.slots[first_slot : first_slot + len(data)].copy_(torch.from_numpy(data))

    def slot_buffer(self, slot: int) -> None:
        return None  # device memory: a disk read goes through a host buffer

    def release_pages(self, slot: int) -> None:
        pass  # device memory is allocated up front

    def close(self) -> None:
        del self.slots
