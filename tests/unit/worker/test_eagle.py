"""EAGLE-1 head: the published layout read and written, our paged-cache forward against the
plain-torch training module, target checks, and a tiny `train-draft --method eagle` run."""

from __future__ import annotations

import json
import os

import pytest
import torch

from kvserve.services.worker.models import load_model
from kvserve.services.worker.spec_decode.eagle import EagleConfig, load_eagle, save_eagle
from kvserve.training.train_eagle import (
    EagleSequence,
    EagleTrainModel,
    draft_chains,
    eagle_config_of,
    score_eagle,
)
from tests.support.model_steps import BLOCK_SIZE, build_step
from tests.support.models import TINY_KV_CACHE_MEMORY, build_tiny_llama

NUM_BLOCKS = 16


@pytest.fixture(scope="module")
def target(tiny_checkpoint):
    """(our tiny Llama, its HF twin) in float32."""
    folder, hf_model = tiny_checkpoint("llama")
    model, _ = load_model(folder, torch.float32, "cpu")
    return model, hf_model


def _random_train_model(target_model, seed: int = 0, **config_changes) -> EagleTrainModel:
    from dataclasses import replace

    config = replace(eagle_config_of(target_model.config), **config_changes)
    model = EagleTrainModel(config, target_model.model.embed_tokens.weight)
    generator = torch.Generator().manual_seed(seed)
    with torch.no_grad():
        for name, param in model.named_parameters():
            mean = 1.0 if "norm" in name else 0.0
            param.copy_(mean + 0.15 * torch.randn(param.shape, generator=generator))
    return model.eval()


def _loaded_head(tmp_path, target_model, train_model):
    save_eagle(train_model.state_dict(), str(tmp_path), "tiny/base", train_model.config)
    head = load_eagle(str(tmp_path), target_model, torch.float32, "cpu")
    (attn,) = head.attention_layers
    attn.kv_cache = torch.zeros(2, NUM_BLOCKS, BLOCK_SIZE, attn.num_kv_heads, attn.head_size)
    return head


def _sequence(vocab: int, hidden: int, num_tokens: int, seed: int):
    generator = torch.Generator().manual_seed(seed)
    token_ids = torch.randint(0, vocab, (num_tokens,), generator=generator)
    return token_ids, torch.randn(num_tokens, hidden, generator=generator)


def test_published_layout_round_trips(tmp_path, target):
    target_model, _ = target
    train_model = _random_train_model(
        target_model, rope_parameters={"rope_type": "default", "rope_theta": 5e4}
    )
    save_eagle(train_model.state_dict(), str(tmp_path), "tiny/base", train_model.config)
    with open(tmp_path / "config.json") as f:
        raw = json.load(f)
    assert raw["num_hidden_layers"] == 1 and raw["bias"] is True and raw["rope_theta"] == 5e4
    from safetensors.torch import load_file

    saved = load_file(str(tmp_path / "model.safetensors"))
    expected = {
        "fc.weight", "fc.bias", "layers.0.post_attention_layernorm.weight",
        *(f"layers.0.self_attn.{n}_proj.weight" for n in "qkvo"),
        *(f"layers.0.mlp.{n}_proj.weight" for n in ("gate", "up", "down")),
    }  # fmt: skip
    assert set(saved) == expected
    head = load_eagle(str(tmp_path), target_model)
    assert head.config == EagleConfig.from_dict(raw)
    assert head.config.base_model == "tiny/base"
    published = head.published_state_dict()
    assert set(published) == expected
    for name in expected:
        torch.testing.assert_close(published[name], saved[name], rtol=0, atol=0)
    # EAGLE's own files: pytorch_model.bin, with a copy of the target's embedding.
    bin_dir = tmp_path / "bin"
    os.makedirs(bin_dir)
    torch.save(
        dict(saved, **{"embed_tokens.weight": target_model.model.embed_tokens.weight.clone()}),
        bin_dir / "pytorch_model.bin",
    )
    with open(bin_dir / "config.json", "w") as f:
        json.dump(raw, f)
    again = load_eagle(str(bin_dir), target_model).published_state_dict()
    for name in expected:
        torch.testing.assert_close(again[name], saved[name], rtol=0, atol=0)


@torch.no_grad()
def test_paged_forward_matches_the_training_module(tmp_path, target):
    target_model, _ = target
    train_model = _random_train_model(target_model)
    head = _loaded_head(tmp_path, target_model, train_model)
    config = train_model.config
    token_ids, features = _sequence(config.vocab_size, config.hidden_size, 15, seed=1)
    num_pairs, num_prefill = len(token_ids) - 1, 9
    next_ids = token_ids[1:]
    expected = train_model(next_ids[None], features[None, :-1])[0]
    block_ids = [3, 7, 1, 12]
    # One prefill of the first pairs, then one pair per step.
    input_ids, positions, metadata = build_step([(next_ids[:num_prefill].tolist(), 0, block_ids)])
    got = [head(input_ids, features[:num_prefill], positions, metadata)]
    for p in range(num_prefill, num_pairs):
        input_ids, positions, metadata = build_step([([int(next_ids[p])], p, block_ids)])
        got.append(head(input_ids, features[p : p + 1], positions, metadata))
    torch.testing.assert_close(torch.cat(got), expected, rtol=0, atol=1e-4)


@torch.no_grad()
def test_scoring_chain_is_the_runners_chain(tmp_path, target):
    """draft_chains (batched, masked) equals drafting with EagleHead: true pairs 0..p, then
    the head's own h and argmax token fed back one position at a time."""
    target_model, _ = target
    train_model = _random_train_model(target_model, seed=2)
    head = _loaded_head(tmp_path, target_model, train_model)
    config = train_model.config
    token_ids, features = _sequence(config.vocab_size, config.hidden_size, 14, seed=3)
    seq = EagleSequence(token_ids, features, prompt_len=5)
    starts, depth = torch.tensor([4, 7, 9]), 3
    chains = draft_chains(train_model, seq, starts, depth, target_model.compute_logits)
    block_ids = [2, 5, 8, 11, 14]
    for start, chain in zip(starts.tolist(), chains):
        step = build_step([(token_ids[1 : start + 2].tolist(), 0, block_ids)])
        h = head(step[0], features[: start + 1], *step[1:])[-1:]
        drafts = []
        for j in range(depth):
            drafts.append(int(target_model.compute_logits(h).argmax(-1)))
            if j + 1 < depth:
                step = build_step([([drafts[-1]], start + j + 1, block_ids)])
                h = head(step[0], h, *step[1:])
        assert drafts == chain.tolist()


def test_mismatched_target_or_checkpoint_is_refused(tmp_path, target):
    target_model, _ = target
    train_model = _random_train_model(target_model)
    save_eagle(train_model.state_dict(), str(tmp_path), config=train_model.config)
    for field, value, message in (
        ("hidden_size", 32, "hidden size 32, the target model 64"),
        ("vocab_size", 97, "vocabulary 97, the target model 96"),
        ("num_hidden_layers", 2, "one decoder layer"),
    ):
        with open(tmp_path / "config.json") as f:
            raw = json.load(f)
        raw[field] = value
        bad = tmp_path / field
        os.makedirs(bad)
        os.link(tmp_path / "model.safetensors", bad / "model.safetensors")
        with open(bad / "config.json", "w") as f:
            json.dump(raw, f)
        with pytest.raises(ValueError, match=message):
            load_eagle(str(bad), target_model)
    from safetensors.torch import load_file, save_file

    tensors = load_file(str(tmp_path / "model.safetensors"))
    save_file(dict(tensors, **{"embed_tokens.weight": torch.zeros(5, 64)}),
              str(tmp_path / "model.safetensors"))  # fmt: skip
    with pytest.raises(ValueError, match="embed_tokens.weight is"):
        load_eagle(str(tmp_path), target_model)
    del tensors["fc.bias"]
    save_file(tensors, str(tmp_path / "model.safetensors"))
    with pytest.raises(ValueError, match="lacks 1 parameters"):
        load_eagle(str(tmp_path), target_model)


def test_train_draft_eagle_beats_an_untrained_head(tmp_path):
    from kvserve.shared.launch_options import TrainDraftOptions
    from kvserve.training.train_draft import HFTarget
    from kvserve.training.train_eagle import eagle_loss, make_eagle, train_eagle

    model_dir = build_tiny_llama(str(tmp_path / "model"))
    options = TrainDraftOptions(
        model=model_dir,
        output=str(tmp_path / "eagle"),
        method="eagle",
        num_prompts=20,
        max_tokens=24,
        epochs=6,
        lr=3e-3,
        batch_size=2,
        num_spec_tokens=3,
    )
    run = train_eagle(options, kv_cache_memory=TINY_KV_CACHE_MEMORY)
    assert run.score.num_positions > 0
    # The random model's generations repeat themselves, so a head that passes f_p through
    # (the untrained start) already scores; the held-out loss and a random head are the
    # baselines that mean something here.
    untrained = make_eagle(HFTarget(model_dir))
    with torch.no_grad():
        trained_loss = eagle_loss(run.model, run.held_out, run.target_logits)[0]
        untrained_loss = eagle_loss(untrained, run.held_out, run.target_logits)[0]
    assert trained_loss < untrained_loss - 0.2  # mostly the flat targets' own entropy
    random_score = score_eagle(_random_train_model_like(run.model), run.held_out,
                               run.target_logits, 3)  # fmt: skip
    assert run.score.mean_acceptance_length > random_score.mean_acceptance_length
    assert run.score.chain[0] > random_score.chain[0]
    # What was written loads back into our EagleHead as the same weights.
    target_model, _ = load_model(model_dir, torch.float32, "cpu")
    head = load_eagle(options.output, target_model)
    published = head.published_state_dict()
    for name, tensor in run.model.state_dict().items():
        torch.testing.assert_close(published[name], tensor.detach(), rtol=0, atol=0)


def _random_train_model_like(model: EagleTrainModel) -> EagleTrainModel:
    random_model = EagleTrainModel(model.config, model.embed_weight)
    with torch.no_grad():
        for name, param in random_model.named_parameters():
            param.normal_(1.0 if "norm" in name else 0.0, 0.15)
    return random_model.eval()
