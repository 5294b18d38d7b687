"""EAGLE-3 head (spec_decode/eagle3.py): the published layout read and written, the target's
aux hidden states against HF's per-layer hidden states, the head's forward against a plain
reading of its definition, guesses mapped through d2t, and clear errors for bad folders."""

from __future__ import annotations

import json
import os

import pytest
import torch
import torch.nn.functional as F

from kvserve.kernels import decode_stack
from kvserve.services.worker.models import load_model
from kvserve.services.worker.models.native_decode import bind_decode_stack
from kvserve.services.worker.spec_decode.eagle3 import (
    Eagle3Config,
    default_aux_layer_ids,
    load_eagle3,
    save_eagle3,
)
from tests.support.model_steps import BLOCK_SIZE, bind_kv_caches, build_step
from tests.support.models import build_tiny_eagle3, build_tiny_llama

PUBLISHED = {
    "fc.weight", "norm.weight", "lm_head.weight", "d2t", "t2d",
    *(f"midlayer.{n}.weight" for n in
      ("input_layernorm", "hidden_norm", "post_attention_layernorm")),
    *(f"midlayer.self_attn.{n}_proj.weight" for n in "qkvo"),
    *(f"midlayer.mlp.{n}_proj.weight" for n in ("gate", "up", "down")),
}  # fmt: skip


@pytest.fixture(scope="module")
def tiny_target(tmp_path_factory) -> str:
    return build_tiny_llama(str(tmp_path_factory.mktemp("target")), successor=True)


def _target(folder: str):
    model, _ = load_model(folder, torch.float32, "cpu")
    return model


def _rewrite_config(folder: str, **changes) -> None:
    path = os.path.join(folder, "config.json")
    with open(path) as f:
        raw = json.load(f)
    with open(path, "w") as f:
        json.dump({**raw, **changes}, f)


def test_published_layout_round_trips(tmp_path, tiny_target):
    from safetensors.torch import load_file

    folder = build_tiny_eagle3(str(tmp_path / "a"), tiny_target, draft_vocab_size=100)
    saved = load_file(os.path.join(folder, "model.safetensors"))
    assert set(saved) == PUBLISHED
    head = load_eagle3(folder, _target(tiny_target))
    assert head.config.draft_vocab_size == 100 and head.aux_layer_ids == (0, 1, 2)
    save_eagle3(head, str(tmp_path / "b"))
    again = load_file(str(tmp_path / "b" / "model.safetensors"))
    assert set(again) == PUBLISHED - {"t2d"}
    for name in PUBLISHED - {"t2d"}:
        torch.testing.assert_close(again[name], saved[name], rtol=0, atol=0)
    with open(tmp_path / "b" / "config.json") as f:
        assert Eagle3Config.from_dict(json.load(f)) == head.config


def test_default_layers_and_an_own_embedding(tmp_path, tiny_target):
    assert default_aux_layer_ids(32) == (2, 16, 29)
    folder = build_tiny_eagle3(str(tmp_path), tiny_target)
    target = _target(tiny_target)
    shared = load_eagle3(folder, target)
    assert shared.embed_tokens is None  # the target's
    from safetensors.torch import load_file, save_file

    tensors = load_file(os.path.join(folder, "model.safetensors"))
    own = torch.randn(target.config.vocab_size, target.config.hidden_size)
    save_file({**tensors, "embed_tokens.weight": own}, os.path.join(folder, "model.safetensors"))
    head = load_eagle3(folder, target)
    assert head.embed_tokens is not None
    ids = torch.tensor([3, 70])
    torch.testing.assert_close(head.embed(ids), own[ids], rtol=0, atol=0)


@torch.no_grad()
def test_aux_hidden_states_are_the_hf_layer_inputs(tiny_checkpoint):
    folder, hf_model = tiny_checkpoint("llama")
    model = _target(folder)
    model.model.aux_hidden_state_layers = (1, 0, 2)
    bind_kv_caches(model)
    token_ids = [5, 17, 3, 44, 9, 60, 2]
    input_ids, positions, metadata = build_step([(token_ids, 0, [0, 1])])
    final = model(input_ids, positions, metadata)
    hf = hf_model(torch.tensor([token_ids]), output_hidden_states=True).hidden_states
    aux = model.model.aux_hidden_states[: len(token_ids)].split(model.config.hidden_size, -1)
    torch.testing.assert_close(aux[0], hf[1][0], rtol=0, atol=1e-4)  # entering layer 1
    torch.testing.assert_close(aux[1], hf[0][0], rtol=0, atol=1e-4)  # the embeddings
    # Index 2 of 2 layers: the last layer's output, before the final norm.
    torch.testing.assert_close(model.model.norm(aux[2]), final, rtol=0, atol=1e-5)


@pytest.mark.skipif(not decode_stack.available(torch.float32), reason="needs the C kernels")
@torch.no_grad()
def test_aux_hidden_states_on_the_native_stack_are_the_modules(tiny_checkpoint):
    """The stack runs the layers between the aux layers (one call per run): the same aux
    states and output as the modules."""
    folder, _ = tiny_checkpoint("llama")
    models = [_target(folder), _target(folder)]
    for model, rows in zip(models, (8, 0)):
        model.model.aux_hidden_state_layers = (1, 0, 2)
        bind_kv_caches(model)
        bind_decode_stack(model, torch.float32, rows, tokens_per_request=4)
    assert models[0].model.decode_stack is not None and models[1].model.decode_stack is None
    steps = [[([5, 17, 3], 0, [0, 1]), ([9, 2], 0, [2])], [([44], 3, [0, 1]), ([60, 8], 2, [2])]]
    for requests in steps:
        outs, auxes = [], []
        for model in models:
            input_ids, positions, metadata = build_step(requests)
            outs.append(model(input_ids, positions, metadata))
            auxes.append(model.model.aux_hidden_states[: len(input_ids)].clone())
        torch.testing.assert_close(outs[0], outs[1], rtol=0, atol=1e-5)
        torch.testing.assert_close(auxes[0], auxes[1], rtol=0, atol=1e-5)


def _reference_forward(head, input_ids, features, positions) -> torch.Tensor:
    """The head's definition, read plainly: dense causal attention over all pairs."""
    layer = head.midlayer
    attn = layer.self_attn
    embeds = head.embed(input_ids)
    normed = layer.hidden_norm(features)
    x = torch.cat([layer.input_layernorm(embeds), normed], -1)
    q, k, v = attn.qkv_proj(x).split([attn.q_size, attn.kv_size, attn.kv_size], -1)
    q, k = attn.rotary_emb(positions, q, k)
    heads, kv_heads, dim = (
        attn.q_size // attn.head_dim,
        attn.kv_size // attn.head_dim,
        attn.head_dim,
    )
    q = q.view(-1, heads, dim).transpose(0, 1)
    k = k.view(-1, kv_heads, dim).transpose(0, 1).repeat_interleave(heads // kv_heads, 0)
    v = v.view(-1, kv_heads, dim).transpose(0, 1).repeat_interleave(heads // kv_heads, 0)
    out = F.scaled_dot_product_attention(q, k, v, is_causal=True).transpose(0, 1).flatten(1)
    residual = normed if head.config.norm_before_residual else features
    r = attn.o_proj(out) + residual
    return layer.mlp(layer.post_attention_layernorm(r)) + r


@torch.no_grad()
def test_paged_forward_matches_the_definition(tmp_path, tiny_target):
    folder = build_tiny_eagle3(str(tmp_path), tiny_target, seed=2)
    head = load_eagle3(folder, _target(tiny_target))
    bind_kv_caches(head)
    generator = torch.Generator().manual_seed(0)
    num_pairs, num_prefill, hidden = 11, 6, head.config.layer.hidden_size
    input_ids = torch.randint(0, 256, (num_pairs,), generator=generator)
    features = torch.randn(num_pairs, hidden, generator=generator)
    expected = _reference_forward(head, input_ids, features, torch.arange(num_pairs))
    blocks = [2, 0, 5]
    ids, positions, metadata = build_step([(input_ids[:num_prefill].tolist(), 0, blocks)])
    got = [head(ids, features[:num_prefill], positions, metadata)]
    for p in range(num_prefill, num_pairs):  # one pair per step, as drafting does
        ids, positions, metadata = build_step([([int(input_ids[p])], p, blocks)])
        got.append(head(ids, features[p : p + 1], positions, metadata))
    torch.testing.assert_close(torch.cat(got), expected, rtol=0, atol=1e-4)
    assert BLOCK_SIZE * len(blocks) >= num_pairs


@torch.no_grad()
def test_guesses_are_target_ids_through_d2t(tmp_path, tiny_target):
    folder = build_tiny_eagle3(str(tmp_path), tiny_target, draft_vocab_size=40, seed=1)
    head = load_eagle3(folder, _target(tiny_target))
    kept = torch.arange(40) + head.d2t
    assert kept.max() >= 40  # a reduced vocabulary spread over the target's
    hidden = torch.randn(64, head.config.layer.hidden_size)
    draft_ids = head.lm_head(head.norm(hidden)).argmax(-1)
    torch.testing.assert_close(head.guess(hidden), kept[draft_ids], rtol=0, atol=0)


@pytest.mark.parametrize(
    ("change", "message"),
    [
        ({"architectures": ["LlamaForCausalLM"]}, "an EAGLE-3 head is one of"),
        ({"eagle_aux_hidden_state_layer_ids": None}, r"layers \[2, 1, -1\] for a target of 2"),
        ({"hidden_size": 32}, "hidden size 32, the target model 64"),
        ({"draft_vocab_size": 50}, r"(d2t is \(40,\)|tensor 'lm_head.weight')"),
        ({"num_hidden_layers": 2}, "one decoder layer"),
    ],
)
def test_bad_folders_are_refused(tmp_path, tiny_target, change, message):
    folder = build_tiny_eagle3(str(tmp_path), tiny_target, draft_vocab_size=40)
    _rewrite_config(folder, **change)
    with pytest.raises(ValueError, match=f"eagle3 checkpoint {folder}: .*{message}"):
        load_eagle3(folder, _target(tiny_target))


def test_a_reduced_vocabulary_without_d2t_is_refused(tmp_path, tiny_target):
    from safetensors.torch import load_file, save_file

    folder = build_tiny_eagle3(str(tmp_path), tiny_target, draft_vocab_size=40)
    path = os.path.join(folder, "model.safetensors")
    tensors = load_file(path)
    del tensors["d2t"]
    save_file(tensors, path)
    with pytest.raises(ValueError, match="draft_vocab_size 40 < vocab_size 257 needs d2t"):
        load_eagle3(folder, _target(tiny_target))
