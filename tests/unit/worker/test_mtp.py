"""MTP (spec_decode/mtp.py): DeepSeek-V3's multi-token-prediction layer read from the target's
own checkpoint (every tensor where it belongs, none of them in the target), its forward over
the paged cache against a plain reading of its definition, a layer built to guess a
`successor` target's next tokens guessing them, and clear start-up errors for a checkpoint
without the layer."""

from __future__ import annotations

import json
import os

import numpy as np
import pytest
import torch
from safetensors.numpy import load_file, save_file

from kvserve.services.worker.models import load_model
from kvserve.services.worker.spec_decode.mtp import MtpHead, load_mtp_head
from kvserve.shared.spec_config import SpeculativeConfig
from tests.support.model_steps import BLOCK_SIZE, bind_kv_caches, build_step
from tests.support.models import build_tiny_deepseek_v3, build_tiny_llama, tiny_successor

MTP = "model.layers.2."  # the tiny V3 has 2 layers: its MTP layer is checkpoint layer 2


@pytest.fixture(scope="module")
def random_dir(tmp_path_factory) -> str:
    return build_tiny_deepseek_v3(str(tmp_path_factory.mktemp("random")), seed=4)


@pytest.fixture(scope="module")
def successor_dir(tmp_path_factory) -> str:
    return build_tiny_deepseek_v3(str(tmp_path_factory.mktemp("successor")), successor=True)


def _target(model_dir: str):
    model, _ = load_model(model_dir, torch.float32, "cpu")
    return model


def _head(model_dir: str, target=None) -> MtpHead:
    draft = load_mtp_head(model_dir, target or _target(model_dir), torch.float32, "cpu")
    assert isinstance(draft.module, MtpHead)
    return draft.module


def test_the_layer_loads_from_the_target_checkpoint_and_the_target_holds_none_of_it(random_dir):
    saved = load_file(os.path.join(random_dir, "model.safetensors"))
    target = _target(random_dir)
    head = _head(random_dir, target)
    assert head.layer_index == 2
    # The target's loader skipped layer 2: it has 2 layers and no parameter of a third.
    assert len(target.model.layers) == 2
    target_params = dict(target.named_parameters())
    assert not any(".layers.2." in name for name in target_params)
    params = dict(head.named_parameters())
    for name in ("enorm.weight", "hnorm.weight", "eh_proj.weight", "shared_head.norm.weight",
                 "shared_head.head.weight"):  # fmt: skip
        np.testing.assert_array_equal(params[name].detach().numpy(), saved[MTP + name])
    block = head.mtp_block
    np.testing.assert_array_equal(
        block.self_attn.kv_b_proj.weight.detach().numpy(), saved[MTP + "self_attn.kv_b_proj.weight"]
    )
    gate = block.mlp.gate
    np.testing.assert_array_equal(
        gate.e_score_correction_bias.detach().numpy(),
        saved[MTP + "mlp.gate.e_score_correction_bias"],
    )
    # Expert 3's gate and up rows, fused; its down projection.
    experts = block.mlp.experts
    expected = np.concatenate(
        [saved[MTP + f"mlp.experts.3.{n}_proj.weight"] for n in ("gate", "up")]
    )
    np.testing.assert_array_equal(experts.w13_weight[3].detach().numpy(), expected)
    np.testing.assert_array_equal(
        experts.w2_weight[3].detach().numpy(), saved[MTP + "mlp.experts.3.down_proj.weight"]
    )
    # The embedding is the target's (the checkpoint's copy is not loaded), not a parameter.
    assert not any("embed" in name for name in params)
    ids = torch.tensor([3, 200])
    torch.testing.assert_close(
        head.embed_tokens(ids), target.model.embed_tokens(ids), rtol=0, atol=0
    )


def _reference_forward(head: MtpHead, input_ids, features) -> torch.Tensor:
    """The layer's definition read plainly, over all pairs in one whole-sequence step (its
    block's attention over a fresh cache of its own)."""
    embeds = head.enorm(head.embed_tokens(input_ids))
    z = head.eh_proj(torch.cat([embeds, head.hnorm(features)], -1))
    _, positions, metadata = build_step([(input_ids.tolist(), 0, [7, 8, 9])])
    hidden, residual = head.mtp_block(positions, z, None, metadata)
    return hidden + residual


@torch.no_grad()
def test_paged_forward_one_pair_a_step_matches_the_definition(random_dir):
    # Drafting k > 1 tokens runs the one layer again, one pair a step, over its own cache.
    head = _head(random_dir)
    bind_kv_caches(head)
    generator = torch.Generator().manual_seed(0)
    num_pairs, num_prefill = 11, 6
    input_ids = torch.randint(0, 256, (num_pairs,), generator=generator)
    features = torch.randn(num_pairs, head.config.hidden_size, generator=generator)
    expected = _reference_forward(head, input_ids, features)
    blocks = [2, 0, 5]
    ids, positions, metadata = build_step([(input_ids[:num_prefill].tolist(), 0, blocks)])
    got = [head(ids, features[:num_prefill], positions, metadata)]
    for p in range(num_prefill, num_pairs):
        ids, positions, metadata = build_step([([int(input_ids[p])], p, blocks)])
        got.append(head(ids, features[p : p + 1], positions, metadata))
    torch.testing.assert_close(torch.cat(got), expected, rtol=0, atol=1e-4)
    assert BLOCK_SIZE * len(blocks) >= num_pairs


@torch.no_grad()
def test_a_built_layer_guesses_the_successor_of_the_pairs_token(successor_dir):
    head = _head(successor_dir)
    bind_kv_caches(head)
    token_ids = list(b"the quick brown fox")
    features = torch.randn(len(token_ids), head.config.hidden_size)
    ids, positions, metadata = build_step([(token_ids, 0, [0, 1, 2, 3, 4])])
    guesses = head.guess(head(ids, features, positions, metadata))
    assert guesses.tolist() == tiny_successor()[token_ids].tolist()


def _rewrite_config(model_dir: str, **changes) -> None:
    path = os.path.join(model_dir, "config.json")
    with open(path) as f:
        raw = json.load(f)
    with open(path, "w") as f:
        json.dump({**raw, **changes}, f)


def test_a_checkpoint_without_the_layer_is_refused_by_name(tmp_path):
    # num_nextn_predict_layers 0: no MTP layer to run.
    no_layers = build_tiny_deepseek_v3(str(tmp_path / "none"), mtp=False)
    with pytest.raises(ValueError, match=r"num_nextn_predict_layers=0\) has none"):
        _head(no_layers)
    # The config names one, but the weights were saved without it.
    _rewrite_config(no_layers, num_nextn_predict_layers=1)
    with pytest.raises(ValueError, match=r"hold no model\.layers\.2\.\* tensors"):
        _head(no_layers)
    # Another family has no MTP layers at all.
    llama = build_tiny_llama(str(tmp_path / "llama"))
    with pytest.raises(ValueError, match=r"LlamaForCausalLM, num_nextn_predict_layers=0"):
        _head(llama)


def test_a_layer_missing_a_tensor_is_refused_naming_it(tmp_path):
    model_dir = build_tiny_deepseek_v3(str(tmp_path / "m"))
    path = os.path.join(model_dir, "model.safetensors")
    tensors = load_file(path)
    del tensors[MTP + "eh_proj.weight"]
    save_file(tensors, path, metadata={"format": "pt"})
    with pytest.raises(ValueError, match=r"the MTP layer model\.layers\.2\.\*: .*eh_proj\.weight"):
        _head(model_dir)


@pytest.mark.parametrize("method", ["mtp", "deepseek_mtp"])
def test_the_method_takes_no_model_and_writes_lookahead_slots(method):
    spec = SpeculativeConfig(method=method, num_speculative_tokens=3)
    assert spec.uses_lookahead_slots and not spec.proposes_in_scheduler
    with pytest.raises(ValueError, match="takes no model"):
        SpeculativeConfig(method=method, num_speculative_tokens=3, model="/some/folder")
