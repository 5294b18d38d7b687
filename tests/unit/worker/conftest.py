"""Fixtures of the worker tests: tiny random HF checkpoints, a tiny GGUF, the real model."""

from __future__ import annotations

import os

import numpy as np
import pytest
import torch



def pytest_configure(config):
    config.addinivalue_line("markers", "slow: takes more than 20 s (real model)")


def make_tiny_hf_model(kind: str, seed: int = 0):
    """A 2-layer HF model of `kind` with random weights large enough to give peaked logits."""
    from transformers import LlamaConfig, LlamaForCausalLM, Qwen2Config, Qwen2ForCausalLM

    common = dict(vocab_size=96, hidden_size=64, intermediate_size=96, num_hidden_layers=2,
                  num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=128,
                  rms_norm_eps=1e-6)
    if kind == "llama":
        config = LlamaConfig(**common, rope_theta=10000.0, tie_word_embeddings=False)
        model_class = LlamaForCausalLM
    elif kind == "llama3_rope":
        rope = {"rope_type": "llama3", "rope_theta": 500000.0, "factor": 8.0,
                "low_freq_factor": 1.0, "high_freq_factor": 4.0,
                "original_max_position_embeddings": 32}
        config = LlamaConfig(**common, rope_parameters=rope, tie_word_embeddings=True)
        model_class = LlamaForCausalLM
    elif kind == "qwen2":
        config = Qwen2Config(**common, rope_theta=1000000.0, tie_word_embeddings=True)
        model_class = Qwen2ForCausalLM
    else:
        raise AssertionError(kind)
    config._attn_implementation = "eager"
    torch.manual_seed(seed)
    model = model_class(config).eval()
    with torch.no_grad():
        for name, param in model.named_parameters():
            if "norm" in name:
                param.normal_(1.0, 0.1)
            else:
                param.normal_(0.0, 0.15)
    return model


@pytest.fixture(scope="session")
def tiny_checkpoint(tmp_path_factory):
    """kind -> (folder saved with save_pretrained, the HF model it holds), built once."""
    cache = {}

    def get(kind: str):
        if kind not in cache:
            model = make_tiny_hf_model(kind)
            model_dir = tmp_path_factory.mktemp(f"tiny-{kind}")
            model.save_pretrained(model_dir)
            cache[kind] = (str(model_dir), model)
        return cache[kind]

    return get


def _llama_cpp_permute(weight: np.ndarray, num_heads: int) -> np.ndarray:
    # What llama.cpp's convert_hf_to_gguf does to attn_q / attn_k rows.
    return (weight.reshape(num_heads, 2, weight.shape[0] // num_heads // 2, *weight.shape[1:])
            .swapaxes(1, 2).reshape(weight.shape))


_GGUF_LAYER_NAMES = {
    "input_layernorm": "attn_norm", "post_attention_layernorm": "ffn_norm",
    "self_attn.q_proj": "attn_q", "self_attn.k_proj": "attn_k", "self_attn.v_proj": "attn_v",
    "self_attn.o_proj": "attn_output", "mlp.gate_proj": "ffn_gate", "mlp.up_proj": "ffn_up",
    "mlp.down_proj": "ffn_down",
}
_GGUF_GLOBAL_NAMES = {"model.embed_tokens.weight": "token_embd.weight",
                      "model.norm.weight": "output_norm.weight", "lm_head.weight": "output.weight"}


def write_llama_gguf(path: str, hf_model, quantize: bool) -> None:
    """Write hf_model (a tiny LlamaForCausalLM) as llama.cpp would: permuted q/k rows,
    a gpt2-style tokenizer, and Q8_0 matrices when `quantize`."""
    import gguf

    config = hf_model.config
    head_dim = config.hidden_size // config.num_attention_heads
    writer = gguf.GGUFWriter(path, "llama")
    writer.add_name("tiny-llama")
    writer.add_block_count(config.num_hidden_layers)
    writer.add_context_length(config.max_position_embeddings)
    writer.add_embedding_length(config.hidden_size)
    writer.add_feed_forward_length(config.intermediate_size)
    writer.add_head_count(config.num_attention_heads)
    writer.add_head_count_kv(config.num_key_value_heads)
    writer.add_rope_freq_base(10000.0)
    writer.add_rope_dimension_count(head_dim)
    writer.add_layer_norm_rms_eps(config.rms_norm_eps)
    writer.add_vocab_size(config.vocab_size)
    letters = [chr(c) for c in range(ord("a"), ord("z") + 1)]
    tokens = ["<unk>", "<s>", "</s>"] + letters + ["ab", "abc", "Ġ", "Ġa"]
    tokens += [f"<extra_{i}>" for i in range(config.vocab_size - len(tokens))]
    writer.add_tokenizer_model("gpt2")
    writer.add_tokenizer_pre("default")
    writer.add_token_list(tokens)
    writer.add_token_types([3, 3, 3] + [1] * (len(tokens) - 3))
    writer.add_token_merges(["a b", "ab c", "Ġ a"])
    writer.add_bos_token_id(1)
    writer.add_eos_token_id(2)
    writer.add_chat_template("{% for m in messages %}<{{ m['role'] }}>{{ m['content'] }}"
                             "{% endfor %}")
    for name, tensor in hf_model.state_dict().items():
        if name in _GGUF_GLOBAL_NAMES:
            gguf_name = _GGUF_GLOBAL_NAMES[name]
        else:
            layer, sub = name.split(".")[2], ".".join(name.split(".")[3:-1])
            gguf_name = f"blk.{layer}.{_GGUF_LAYER_NAMES[sub]}.weight"
        array = tensor.detach().numpy().astype(np.float32)
        if ".q_proj." in name:
            array = _llama_cpp_permute(array, config.num_attention_heads)
        elif ".k_proj." in name:
            array = _llama_cpp_permute(array, config.num_key_value_heads)
        array = np.ascontiguousarray(array)
        if quantize and array.ndim == 2:
            qtype = gguf.GGMLQuantizationType.Q8_0
            writer.add_tensor(gguf_name, gguf.quants.quantize(array, qtype), raw_dtype=qtype)
        else:
            writer.add_tensor(gguf_name, array)
    writer.write_header_to_file()
    writer.write_kv_data_to_file()
    writer.write_tensors_to_file()
    writer.close()


@pytest.fixture(scope="session")
def tiny_gguf(tmp_path_factory):
    """quantize (bool) -> (path of a tiny llama GGUF, the HF model it was written from)."""
    cache = {}

    def get(quantize: bool):
        if quantize not in cache:
            model = make_tiny_hf_model("llama", seed=1)
            folder = tmp_path_factory.mktemp("gguf")
            path = os.path.join(folder, f"tiny-{'q8_0' if quantize else 'f32'}.gguf")
            write_llama_gguf(path, model, quantize)
            cache[quantize] = (path, model)
        return cache[quantize]

    return get


@pytest.fixture(scope="session")
def smollm2_dir(tmp_path_factory):
    """The default model converted from its GGUF, in a cache folder of this test session."""
    from kvserve.services.worker.model_loader import resolve_model

    return resolve_model(None, cache_dir=str(tmp_path_factory.mktemp("kvserve-cache")))
