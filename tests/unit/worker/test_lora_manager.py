"""The worker's LoRA slots and host cache, and the per-step token grouping, on the tiny
Llama (the outputs themselves are checked against PEFT in tests/e2e/test_lora_llm.py)."""

from __future__ import annotations

import numpy as np
import pytest
import torch

from kvserve.services.worker.lora.layers import LoRALinear
from kvserve.services.worker.lora.manager import LoRAManager
from kvserve.services.worker.models import load_model
from kvserve.shared.config import LoRAConfig
from kvserve.shared.lora import LoRARequest
from tests.support.lora import make_peft_adapter
from tests.support.models import build_tiny_llama


@pytest.fixture(scope="module")
def setup(tmp_path_factory):
    root = tmp_path_factory.mktemp("lora_manager")
    model_dir = build_tiny_llama(str(root / "model"))
    loras = [
        LoRARequest(name, i + 1, make_peft_adapter(model_dir, str(root / name), seed=i, rank=4))
        for i, name in enumerate("abc")
    ]
    return model_dir, loras


def make_manager(model_dir: str, **lora) -> LoRAManager:
    model, _ = load_model(model_dir, torch.float32, "cpu")
    config = LoRAConfig(enable_lora=True, max_lora_rank=8, **lora)
    return LoRAManager(model, config, max_num_reqs=8, dtype=torch.float32, device="cpu")


def test_every_target_linear_is_wrapped(setup):
    manager = make_manager(setup[0], max_loras=2)
    names = {name.split(".", 3)[-1] for name in manager.layers}
    assert names == {"self_attn.qkv_proj", "self_attn.o_proj", "mlp.gate_up_proj", "mlp.down_proj"}
    qkv = manager.layers["model.layers.0.self_attn.qkv_proj"]
    assert [name for name, _ in qkv.slices] == ["q_proj", "k_proj", "v_proj"]
    assert qkv.lora_a.shape == (2, 3 * 8, 64)  # slots x (3 slices x padded rank) x in
    assert all(isinstance(m, LoRALinear) for m in manager.layers.values())


def test_slots_are_pinned_reused_and_evicted_least_recently_used(setup):
    model_dir, (a, b, c) = setup
    manager = make_manager(model_dir, max_loras=2, max_cpu_loras=2)
    manager.add_request(0, a)
    manager.add_request(1, b)
    manager.add_request(2, a)  # a's slot again
    manager.add_request(3, None)
    assert manager.slot_lora_ids == [1, 2]
    assert list(manager.slot_of_row[:4]) == [0, 1, 0, -1]
    with pytest.raises(RuntimeError, match="all 2 LoRA slots are in use"):
        manager.add_request(4, c)
    manager.remove_request(1)  # b unpinned, stays loaded
    manager.add_request(1, b)
    assert manager.slot_lora_ids == [1, 2]
    manager.remove_request(1)
    manager.add_request(4, c)  # evicts b, the only unpinned slot
    assert manager.slot_lora_ids == [1, 3]
    # The host LRU of two keeps the last used, b and c; a lives on in its slot.
    assert list(manager.cpu_cache) == [2, 3]
    slot_c = manager.layers["model.layers.1.mlp.down_proj"].lora_b[1]
    assert slot_c.abs().sum() > 0


def test_prepare_step_groups_tokens_by_slot(setup):
    model_dir, (a, b, _) = setup
    manager = make_manager(model_dir, max_loras=2)
    for row, lora in enumerate([a, None, a, b]):
        manager.add_request(row, lora)
    # rows 0 0 | 1 | 2 2 | 3: slot 0 twice apart (indices), slot 1 once (a slice)
    manager.prepare_step(np.array([0, 0, 1, 2, 2, 3]))
    (slot0, rows0), (slot1, rows1) = manager.step.segments
    assert (slot0, rows0.tolist()) == (0, [0, 1, 3, 4])
    assert (slot1, rows1) == (1, slice(5, 6))
    manager.prepare_step(np.array([1, 1]))
    assert manager.step.segments == []  # base-model tokens only: the wrappers add nothing
