"""Tiny random-weight models, written in seconds and stepped in milliseconds.

Three builders:
- `build_tiny_llama`: a Llama folder (config, safetensors, byte-level tokenizer) written
  with numpy and `tokenizers` only, so a process test that serves it never imports torch.
- `make_tiny_hf_model`: a 2-layer Hugging Face Llama or Qwen2 model to compare our model
  against, and to save as a checkpoint folder.
- `write_llama_gguf`: such a model as llama.cpp would write it into a GGUF file.
"""

from __future__ import annotations

import json
import os

import numpy as np

# The numpy Llama's tokenizer is byte-level BPE without merges: every text encodes (one token
# per byte) and decodes back exactly.
TINY_VOCAB_SIZE = 257  # 256 bytes + EOS: every id the model samples decodes
TINY_EOS_TOKEN = "<|endoftext|>"
TINY_EOS_TOKEN_ID = 256
# The numpy Llama's KV cache for a served engine: plenty of blocks, little memory.
TINY_KV_CACHE_MEMORY = 16 << 20
# The default model's KV cache in tests (kv_cache_memory= / --kv-cache-memory): 182 blocks of
# 16 tokens in float32 (720 KiB a block), room for every test's batch. The product's CPU
# default is 4 GiB an engine, zero-filled at start: tens of seconds on a loaded 2-core machine,
# and a test holding three engines held 12 GiB.
DEFAULT_MODEL_KV_CACHE_MEMORY = 128 << 20
_DIMS = dict(
    hidden_size=64,
    intermediate_size=128,
    num_hidden_layers=2,
    num_attention_heads=4,
    num_key_value_heads=2,
)


def build_tiny_llama(model_dir: str, seed: int = 0) -> str:
    """Write config.json, model.safetensors and tokenizer files into model_dir; return it."""
    os.makedirs(model_dir, exist_ok=True)
    _write_config(model_dir)
    _write_weights(model_dir, seed)
    _write_tokenizer(model_dir)
    return model_dir


def _write_config(model_dir: str) -> None:
    config = dict(
        architectures=["LlamaForCausalLM"],
        model_type="llama",
        vocab_size=TINY_VOCAB_SIZE,
        max_position_embeddings=512,
        rms_norm_eps=1e-6,
        rope_theta=10000.0,
        hidden_act="silu",
        tie_word_embeddings=True,
        bos_token_id=None,
        eos_token_id=TINY_EOS_TOKEN_ID,
        torch_dtype="float32",
        **_DIMS,
    )
    with open(os.path.join(model_dir, "config.json"), "w") as f:
        json.dump(config, f, indent=1)


def _write_weights(model_dir: str, seed: int) -> None:
    from safetensors.numpy import save_file

    rng = np.random.default_rng(seed)
    hidden, inter = _DIMS["hidden_size"], _DIMS["intermediate_size"]
    head_dim = hidden // _DIMS["num_attention_heads"]
    kv_size = _DIMS["num_key_value_heads"] * head_dim

    def rand(*shape):
        return rng.normal(0.0, 0.15, shape).astype(np.float32)

    tensors = {
        "model.embed_tokens.weight": rand(TINY_VOCAB_SIZE, hidden),
        "model.norm.weight": np.ones(hidden, np.float32),
    }
    for i in range(_DIMS["num_hidden_layers"]):
        prefix = f"model.layers.{i}."
        tensors.update(
            {
                prefix + "input_layernorm.weight": np.ones(hidden, np.float32),
                prefix + "post_attention_layernorm.weight": np.ones(hidden, np.float32),
                prefix + "self_attn.q_proj.weight": rand(hidden, hidden),
                prefix + "self_attn.k_proj.weight": rand(kv_size, hidden),
                prefix + "self_attn.v_proj.weight": rand(kv_size, hidden),
                prefix + "self_attn.o_proj.weight": rand(hidden, hidden),
                prefix + "mlp.gate_proj.weight": rand(inter, hidden),
                prefix + "mlp.up_proj.weight": rand(inter, hidden),
                prefix + "mlp.down_proj.weight": rand(hidden, inter),
            }
        )
    save_file(tensors, os.path.join(model_dir, "model.safetensors"), metadata={"format": "pt"})


def _write_tokenizer(model_dir: str) -> None:
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers

    alphabet = sorted(pre_tokenizers.ByteLevel.alphabet())
    vocab = {symbol: index for index, symbol in enumerate(alphabet)}
    vocab[TINY_EOS_TOKEN] = TINY_EOS_TOKEN_ID
    tokenizer = Tokenizer(models.BPE(vocab=vocab, merges=[]))
    tokenizer.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tokenizer.decoder = decoders.ByteLevel()
    tokenizer.add_special_tokens([TINY_EOS_TOKEN])
    tokenizer.save(os.path.join(model_dir, "tokenizer.json"))
    with open(os.path.join(model_dir, "tokenizer_config.json"), "w") as f:
        json.dump(
            {
                "tokenizer_class": "PreTrainedTokenizerFast",
                "eos_token": TINY_EOS_TOKEN,
                "model_max_length": 512,
            },
            f,
        )


# The dimensions of the tiny HF models: make_tiny_hf_model's and tests/support/hf_models.py's.
TINY_HF_DIMS = dict(
    hidden_size=64,
    intermediate_size=96,
    num_hidden_layers=2,
    num_attention_heads=4,
    num_key_value_heads=2,
    max_position_embeddings=128,
    rms_norm_eps=1e-6,
)


def make_tiny_hf_model(kind: str, seed: int = 0, **config_overrides):
    """A 2-layer HF model of `kind` with random weights large enough to give peaked logits
    (greedy ties cannot flip between our model and HF's).

    Args:
        kind: "llama", "llama3_rope" (llama3 rope scaling, tied embeddings) or "qwen2".
        seed: the torch seed the weights are drawn with.
        config_overrides: config fields to change (layers, vocabulary size, ...).
    """
    from transformers import LlamaConfig, LlamaForCausalLM, Qwen2Config, Qwen2ForCausalLM

    common = dict(TINY_HF_DIMS, vocab_size=96)
    if kind == "llama":
        fields = dict(common, rope_theta=10000.0, tie_word_embeddings=False)
        config_class, model_class = LlamaConfig, LlamaForCausalLM
    elif kind == "llama3_rope":
        rope = {
            "rope_type": "llama3",
            "rope_theta": 500000.0,
            "factor": 8.0,
            "low_freq_factor": 1.0,
            "high_freq_factor": 4.0,
            "original_max_position_embeddings": 32,
        }
        fields = dict(common, rope_parameters=rope, tie_word_embeddings=True)
        config_class, model_class = LlamaConfig, LlamaForCausalLM
    elif kind == "qwen2":
        fields = dict(common, rope_theta=1000000.0, tie_word_embeddings=True)
        config_class, model_class = Qwen2Config, Qwen2ForCausalLM
    else:
        raise AssertionError(kind)
    return random_hf_model(config_class, model_class, fields | config_overrides, seed)


def saved_checkpoints(tmp_path_factory, make):
    """kind -> (folder saved with save_pretrained, the HF model make(kind) returns), each
    built and saved once (a session fixture's value)."""
    cache = {}

    def get(kind: str):
        if kind not in cache:
            model = make(kind)
            model_dir = tmp_path_factory.mktemp(f"tiny-{kind}")
            model.save_pretrained(model_dir)
            cache[kind] = (str(model_dir), model)
        return cache[kind]

    return get


def random_hf_model(config_class, model_class, fields: dict, seed: int, norm_mean: float = 1.0):
    """model_class(config_class(**fields)) in eval mode with eager attention, its weights drawn
    with the torch seed `seed`, large enough for peaked logits (greedy ties cannot flip between
    our model and HF's): norms N(norm_mean, 0.1), every other parameter N(0, 0.15)."""
    import torch

    config = config_class(**fields)
    config._attn_implementation = "eager"
    torch.manual_seed(seed)
    model = model_class(config).eval()
    with torch.no_grad():
        for name, param in model.named_parameters():
            if "norm" in name:
                param.normal_(norm_mean, 0.1)
            else:
                param.normal_(0.0, 0.15)
    return model


def _llama_cpp_permute(weight: np.ndarray, num_heads: int) -> np.ndarray:
    # What llama.cpp's convert_hf_to_gguf does to attn_q / attn_k rows.
    return (
        weight.reshape(num_heads, 2, weight.shape[0] // num_heads // 2, *weight.shape[1:])
        .swapaxes(1, 2)
        .reshape(weight.shape)
    )


_GGUF_LAYER_NAMES = {
    "input_layernorm": "attn_norm",
    "post_attention_layernorm": "ffn_norm",
    "self_attn.q_proj": "attn_q",
    "self_attn.k_proj": "attn_k",
    "self_attn.v_proj": "attn_v",
    "self_attn.o_proj": "attn_output",
    "mlp.gate_proj": "ffn_gate",
    "mlp.up_proj": "ffn_up",
    "mlp.down_proj": "ffn_down",
}
_GGUF_GLOBAL_NAMES = {
    "model.embed_tokens.weight": "token_embd.weight",
    "model.norm.weight": "output_norm.weight",
    "lm_head.weight": "output.weight",
}


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
    writer.add_chat_template(
        "{% for m in messages %}<{{ m['role'] }}>{{ m['content'] }}{% endfor %}"
    )
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


def save_tiny_parallel_llama(model_dir: str) -> str:
    """A tiny random Llama that splits over 2 TP ranks and 2 PP stages (4 layers, 4 heads,
    2 KV heads, tied embeddings, 128-token vocabulary: it borrows the default model's
    tokenizer, whose first 128 ids are its vocabulary), saved in model_dir."""
    model = make_tiny_hf_model(
        "llama",
        vocab_size=128,
        intermediate_size=128,
        num_hidden_layers=4,
        max_position_embeddings=256,
        tie_word_embeddings=True,
    )
    model.save_pretrained(model_dir, safe_serialization=True)
    return model_dir
