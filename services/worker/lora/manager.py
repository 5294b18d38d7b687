"""The worker's adapters: max_loras slots on the device, an LRU of max_cpu_loras on the host.

    request arrives (NewRequestData.lora_request)
        └─ slot holding its id?  ─yes─▶ pin it (one more live request)
           no ─▶ host cache (else read the PEFT folder) ─▶ a free slot: empty first, else the
                 one unused longest ─▶ copy A and B into every wrapped layer ─▶ pin it
    request finishes or is preempted ─▶ unpin (the adapter stays in its slot for later)

The scheduler keeps the distinct adapters of its running requests (the ones the worker
holds) at max_loras at most, so a pinned-full set of slots means a broken invariant.
Every TP / PP rank sees the same requests in the same order, so every rank picks the same
slots.
"""

from __future__ import annotations

import itertools
from collections import OrderedDict

import numpy as np
import torch
from torch import nn

from kvserve.services.worker.lora.adapter import LoRAAdapter, load_adapter
from kvserve.services.worker.lora.layers import LoRALinear, Rows, wrap_linear_layers
from kvserve.shared.config import LoRAConfig
from kvserve.shared.logging import init_logger
from kvserve.shared.lora import LoRARequest

logger = init_logger(__name__)

_NO_SLOT = -1


class LoRAManager:
    """Adapter slots of one model, and the per-step token grouping its layers read.

    Args:
        model: the built model; its linear layers are wrapped here.
        config: max_loras, max_lora_rank, max_cpu_loras.
        max_num_reqs: rows of the input batch (requests the worker holds at most).
        dtype, device: of the slot weights.
    """

    def __init__(
        self,
        model: nn.Module,
        config: LoRAConfig,
        max_num_reqs: int,
        dtype: torch.dtype,
        device: torch.device,
    ):
        self.config = config
        self.device = device
        self.layers, self.step = wrap_linear_layers(
            model, config.max_loras, config.max_lora_rank, dtype, device
        )
        self._layer_indices = {
            int(name.split(".")[2]) for name in self.layers if name.startswith("model.layers.")
        }
        self.slot_lora_ids: list[int | None] = [None] * config.max_loras
        self.slot_num_reqs = [0] * config.max_loras
        self._slot_last_used = [0] * config.max_loras
        self._clock = itertools.count(1)
        self.slot_of_row = np.full(max_num_reqs, _NO_SLOT, dtype=np.int64)
        self.cpu_cache: OrderedDict[int, LoRAAdapter] = OrderedDict()

    # ------------------------------------------------------------------ requests

    def add_request(self, row: int, lora_request: LoRARequest | None) -> None:
        """A request took batch row `row`: pin its adapter's slot (loading it if need be)."""
        slot = _NO_SLOT if lora_request is None else self._acquire(lora_request)
        self.slot_of_row[row] = slot

    def remove_request(self, row: int) -> None:
        slot = int(self.slot_of_row[row])
        if slot != _NO_SLOT:
            self.slot_num_reqs[slot] -= 1
            assert self.slot_num_reqs[slot] >= 0, f"slot {slot} unpinned twice"
        self.slot_of_row[row] = _NO_SLOT

    def _acquire(self, lora_request: LoRARequest) -> int:
        lora_id = lora_request.lora_int_id
        if lora_id in self.slot_lora_ids:
            slot = self.slot_lora_ids.index(lora_id)
            if lora_id in self.cpu_cache:  # a use keeps it in the host cache too
                self.cpu_cache.move_to_end(lora_id)
        else:
            slot = self._free_slot()
            self._load_into_slot(slot, self._host_adapter(lora_request))
        self.slot_num_reqs[slot] += 1
        self._slot_last_used[slot] = next(self._clock)
        return slot

    def _free_slot(self) -> int:
        unused = [s for s, n in enumerate(self.slot_num_reqs) if n == 0]
        if not unused:
            raise RuntimeError(
                f"all {self.config.max_loras} LoRA slots are in use: the scheduler admitted "
                f"more distinct adapters than max_loras"
            )
        empty = [s for s in unused if self.slot_lora_ids[s] is None]
        return empty[0] if empty else min(unused, key=lambda s: self._slot_last_used[s])

    def _host_adapter(self, lora_request: LoRARequest) -> LoRAAdapter:
        adapter = self.cpu_cache.get(lora_request.lora_int_id)
        if adapter is not None:
            self.cpu_cache.move_to_end(lora_request.lora_int_id)
            return adapter
        adapter = load_adapter(lora_request, self.config.max_lora_rank)
        self._check_modules(adapter, lora_request)
        self.cpu_cache[lora_request.lora_int_id] = adapter
        while len(self.cpu_cache) > self.config.cpu_cache_size:
            self.cpu_cache.popitem(last=False)
        logger.info(
            "LoRA adapter %s (id %d, rank %d) loaded from %s",
            lora_request.lora_name,
            lora_request.lora_int_id,
            adapter.rank,
            lora_request.lora_path,
        )
        return adapter

    def _check_modules(self, adapter: LoRAAdapter, lora_request: LoRARequest) -> None:
        known = {
            f"{name.rpartition('.')[0]}.{hf_name}"
            for name, layer in self.layers.items()
            for hf_name, _ in layer.slices
        }
        for module in adapter.weights:
            if module in known:
                continue
            parts = module.split(".")
            on_other_stage = (
                len(parts) > 2 and parts[1] == "layers" and int(parts[2]) not in self._layer_indices
            )
            if not on_other_stage:
                raise ValueError(
                    f"LoRA adapter {lora_request.lora_name!r}: {module} is no linear layer "
                    f"of this model that LoRA can change"
                )

    def _load_into_slot(self, slot: int, adapter: LoRAAdapter) -> None:
        for name, layer in self.layers.items():
            prefix = name.rpartition(".")[0]
            pairs = [adapter.weights.get(f"{prefix}.{hf_name}") for hf_name, _ in layer.slices]
            layer.set_slot(slot, pairs, adapter.scaling)
        self.slot_lora_ids[slot] = adapter.lora_int_id

    # ------------------------------------------------------------------ one step

    def prepare_step(self, token_rows: np.ndarray) -> None:
        """Group the step's tokens by slot for the wrapped layers.

        Args:
            token_rows: [T] the batch row of each token of the flattened step.

        Example: slots of rows [3, -1, 3] (rows 0, 1, 2), 2 + 1 + 2 tokens
            token slots [3 3 | -1 | 3 3] -> segments [(3, tensor([0, 1, 3, 4]))]
        """
        token_slots = self.slot_of_row[token_rows]
        segments: list[tuple[int, Rows]] = []
        if (token_slots != _NO_SLOT).any():
            for slot in np.unique(token_slots[token_slots != _NO_SLOT]):
                indices = np.flatnonzero(token_slots == slot)
                first, last = int(indices[0]), int(indices[-1])
                if last - first + 1 == len(indices):
                    segments.append((int(slot), slice(first, last + 1)))
                else:
                    segments.append((int(slot), torch.from_numpy(indices).to(self.device)))
        self.step.segments = segments

    def clear_step(self) -> None:
        self.step.segments = []

    @property
    def wrapped_layers(self) -> list[LoRALinear]:
        return list(self.layers.values())
