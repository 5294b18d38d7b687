"""Medusa heads: both published checkpoint layouts, our own writer, target checks, and a
tiny `train-draft` run through the real training code."""

from __future__ import annotations

import json
import os
from types import SimpleNamespace

import pytest
import torch
import torch.nn.functional as F
from torch import nn

from kvserve.services.worker.spec_decode.medusa import (
    MedusaConfig,
    MedusaHeads,
    MedusaProposer,
    load_medusa,
    save_medusa,
)
from tests.support.models import TINY_KV_CACHE_MEMORY, build_tiny_llama

HIDDEN, VOCAB, NUM_HEADS, NUM_LAYERS = 16, 40, 3, 2


class _Target(nn.Module):
    """The part of a target model a proposer uses: its config and compute_logits."""

    def __init__(self, hidden: int = HIDDEN, vocab: int = VOCAB):
        super().__init__()
        self.config = SimpleNamespace(hidden_size=hidden, vocab_size=vocab)
        self.lm_weight = torch.randn(vocab, hidden, generator=torch.Generator().manual_seed(7))

    def compute_logits(self, hidden_states: torch.Tensor) -> torch.Tensor:
        return F.linear(hidden_states, self.lm_weight).float()


def _random_tensors(seed: int, vocab: int = VOCAB, bias: bool = True) -> dict:
    """head -> {"layers": [(W, b)], "lm": weight} drawn with `seed`."""
    generator = torch.Generator().manual_seed(seed)
    heads = []
    for _ in range(NUM_HEADS):
        layers = [
            (
                torch.randn(HIDDEN, HIDDEN, generator=generator) * 0.3,
                torch.randn(HIDDEN, generator=generator) * 0.3 if bias else None,
            )
            for _ in range(NUM_LAYERS)
        ]
        heads.append({"layers": layers, "lm": torch.randn(vocab, HIDDEN, generator=generator)})
    return {"heads": heads}


def _reference_logits(weights: dict, hidden: torch.Tensor, shared_lm=None) -> torch.Tensor:
    """[B, K, V]: the Medusa-1 formula written out with plain torch."""
    out = []
    for head in weights["heads"]:
        x = hidden
        for weight, bias in head["layers"]:
            x = x + F.silu(x @ weight.T + (0 if bias is None else bias))
        lm = head["lm"] if shared_lm is None else shared_lm
        out.append(x @ lm.T)
    return torch.stack(out, dim=1)


def _write_fasterdecoding(folder, weights: dict, as_pt: bool) -> None:
    os.makedirs(folder, exist_ok=True)
    tensors = {}
    for i, head in enumerate(weights["heads"]):
        for j, (weight, bias) in enumerate(head["layers"]):
            tensors[f"{i}.{j}.linear.weight"] = weight
            tensors[f"{i}.{j}.linear.bias"] = bias
        tensors[f"{i}.{NUM_LAYERS}.weight"] = head["lm"]
    if as_pt:
        torch.save(tensors, os.path.join(folder, "medusa_lm_head.pt"))
    else:
        from safetensors.torch import save_file

        save_file(tensors, os.path.join(folder, "medusa_lm_head.safetensors"))
    config = {
        "medusa_num_heads": NUM_HEADS,
        "medusa_num_layers": NUM_LAYERS,
        "base_model_name_or_path": "tiny/base",
    }
    with open(os.path.join(folder, "config.json"), "w") as f:
        json.dump(config, f)


def _write_vllm(folder, weights: dict, **config_fields) -> None:
    from safetensors.torch import save_file

    os.makedirs(folder, exist_ok=True)
    tensors = {}
    for i, head in enumerate(weights["heads"]):
        for j, (weight, bias) in enumerate(head["layers"]):
            tensors[f"blocks.{i}.layers.{j}.weight"] = weight
            if bias is not None:
                tensors[f"blocks.{i}.layers.{j}.bias"] = bias
        if not config_fields.get("original_lm_head") or i == 0:
            tensors[f"lm_heads.{i}.weight"] = head["lm"]
    if "token_map" in weights:
        tensors["token_map"] = weights["token_map"]
    save_file(tensors, os.path.join(folder, "model.safetensors"))
    config = {
        "model_type": "medusa",
        "architectures": ["MedusaModel"],
        "num_heads": NUM_HEADS,
        "num_hidden_layers": NUM_LAYERS,
        "hidden_size": HIDDEN,
        "vocab_size": VOCAB,
        **config_fields,
    }
    with open(os.path.join(folder, "config.json"), "w") as f:
        json.dump(config, f)


def _check_proposer(folder, expected_logits: torch.Tensor, hidden: torch.Tensor, target=None):
    proposer = MedusaProposer.load(str(folder), target or _Target(), torch.float32, "cpu")
    assert proposer.num_heads == NUM_HEADS
    heads = proposer.heads
    logits = heads.compute_logits(heads(hidden), (target or _Target()).compute_logits)
    torch.testing.assert_close(logits, expected_logits, rtol=1e-5, atol=1e-4)
    for num_spec in (1, NUM_HEADS):
        tokens = proposer.propose(hidden, num_spec)
        assert tokens.dtype == torch.int64 and tokens.shape == (hidden.shape[0], num_spec)
    return proposer


@pytest.mark.parametrize("as_pt", [False, True], ids=["safetensors", "pt"])
def test_fasterdecoding_layout_loads(tmp_path, as_pt):
    weights = _random_tensors(seed=1)
    _write_fasterdecoding(tmp_path, weights, as_pt)
    hidden = torch.randn(5, HIDDEN)
    expected = _reference_logits(weights, hidden)
    proposer = _check_proposer(tmp_path, expected, hidden)
    assert proposer.heads.config.lm_head == "per_head"
    assert proposer.heads.config.base_model == "tiny/base"
    assert torch.equal(proposer.propose(hidden, NUM_HEADS), expected.argmax(-1))


@pytest.mark.parametrize("bias", [True, False])
def test_vllm_layout_loads(tmp_path, bias):
    weights = _random_tensors(seed=2, bias=bias)
    _write_vllm(tmp_path, weights, medusa_fc_bias=bias)
    hidden = torch.randn(4, HIDDEN)
    expected = _reference_logits(weights, hidden)
    proposer = _check_proposer(tmp_path, expected, hidden)
    assert proposer.heads.config.fc_bias == bias
    assert torch.equal(proposer.propose(hidden, 2), expected.argmax(-1)[:, :2])


def test_vllm_original_lm_head_serves_every_head(tmp_path):
    weights = _random_tensors(seed=3)
    _write_vllm(tmp_path, weights, original_lm_head=True)
    hidden = torch.randn(3, HIDDEN)
    expected = _reference_logits(weights, hidden, shared_lm=weights["heads"][0]["lm"])
    proposer = _check_proposer(tmp_path, expected, hidden)
    assert proposer.heads.config.lm_head == "single"


def test_vllm_truncated_vocab_maps_draft_ids(tmp_path):
    truncated = 10
    weights = _random_tensors(seed=4, vocab=truncated)
    weights["token_map"] = torch.randperm(VOCAB, generator=torch.Generator().manual_seed(0))[
        :truncated
    ]
    _write_vllm(tmp_path, weights, truncated_vocab_size=truncated)
    hidden = torch.randn(6, HIDDEN)
    expected = _reference_logits(weights, hidden)
    proposer = _check_proposer(tmp_path, expected, hidden)
    assert torch.equal(
        proposer.propose(hidden, NUM_HEADS), weights["token_map"][expected.argmax(-1)]
    )


@pytest.mark.parametrize("lm_head", ["target", "per_head"])
def test_save_medusa_round_trips(tmp_path, lm_head):
    config = MedusaConfig(HIDDEN, VOCAB, NUM_HEADS, NUM_LAYERS, lm_head=lm_head)
    heads = MedusaHeads(config)
    with torch.no_grad():
        for param in heads.parameters():
            param.normal_(0.0, 0.3)
    save_medusa(heads, str(tmp_path), base_model="tiny/base")
    with open(tmp_path / "config.json") as f:
        assert json.load(f)["model_type"] == "medusa"
    target = _Target()
    hidden = torch.randn(5, HIDDEN)
    expected = heads.compute_logits(heads(hidden), target.compute_logits).detach()
    proposer = _check_proposer(tmp_path, expected, hidden, target)
    assert proposer.heads.config == MedusaConfig(
        HIDDEN, VOCAB, NUM_HEADS, NUM_LAYERS, lm_head=lm_head, base_model="tiny/base"
    )
    if lm_head == "target":  # no lm weights stored: the target's LM head is used
        assert not any("lm_heads" in name for name in proposer.heads.state_dict())


def test_mismatched_target_is_refused(tmp_path):
    _write_vllm(tmp_path, _random_tensors(seed=5))
    with pytest.raises(ValueError, match="hidden size 16, the target model 32"):
        MedusaProposer.load(str(tmp_path), _Target(hidden=32), torch.float32, "cpu")
    with pytest.raises(ValueError, match="vocabulary 40, the target model 41"):
        MedusaProposer.load(str(tmp_path), _Target(vocab=41), torch.float32, "cpu")


def test_unknown_or_inconsistent_checkpoint_is_refused(tmp_path):
    with open(tmp_path / "config.json", "w") as f:
        json.dump({"model_type": "llama"}, f)
    with pytest.raises(ValueError, match="names neither"):
        load_medusa(str(tmp_path))
    _write_vllm(tmp_path, _random_tensors(seed=6), num_hidden_layers=NUM_LAYERS + 1)
    with pytest.raises(ValueError, match="do not fit its config"):
        load_medusa(str(tmp_path))


def test_train_draft_beats_a_random_head(tmp_path):
    from kvserve.shared.launch_options import TrainDraftOptions
    from kvserve.training.train_draft import score_heads, train_draft

    model_dir = build_tiny_llama(str(tmp_path / "model"))
    options = TrainDraftOptions(
        model=model_dir,
        output=str(tmp_path / "heads"),
        num_heads=2,
        num_prompts=20,
        max_tokens=24,
        epochs=10,
        batch_size=32,
    )
    run = train_draft(options, kv_cache_memory=TINY_KV_CACHE_MEMORY)

    random_heads = MedusaHeads(run.heads.config)
    with torch.no_grad():
        for param in random_heads.parameters():
            param.normal_(0.0, 1.0)
    random_score = score_heads(random_heads, run.held_out, run.target_logits)
    assert run.score.num_positions > 0
    assert run.score.mean_acceptance_length > random_score.mean_acceptance_length + 0.2
    assert run.score.top1[0] > random_score.top1[0]
    # What was written loads back as the same heads.
    loaded = load_medusa(options.output)
    rows = run.held_out.hidden_states[:8]
    torch.testing.assert_close(loaded(rows), run.heads(rows).detach())
