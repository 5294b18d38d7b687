"""A tiny random Llama folder for process tests: starts in seconds, steps in milliseconds.

Written with numpy and `tokenizers` only, so the test process never imports torch. The
tokenizer is byte-level BPE without merges: every text encodes (one token per byte) and
decodes back exactly.
"""

from __future__ import annotations

import json
import os

import numpy as np

VOCAB_SIZE = 257  # 256 bytes + EOS: every id the model samples decodes
EOS_TOKEN = "<|endoftext|>"
EOS_TOKEN_ID = 256
_DIMS = dict(hidden_size=64, intermediate_size=128, num_hidden_layers=2,
             num_attention_heads=4, num_key_value_heads=2)


def build_tiny_llama(model_dir: str, seed: int = 0) -> str:
    """Write config.json, model.safetensors and tokenizer files into model_dir; return it."""
    os.makedirs(model_dir, exist_ok=True)
    _write_config(model_dir)
    _write_weights(model_dir, seed)
    _write_tokenizer(model_dir)
    return model_dir


def _write_config(model_dir: str) -> None:
    config = dict(architectures=["LlamaForCausalLM"], model_type="llama",
                  vocab_size=VOCAB_SIZE, max_position_embeddings=512, rms_norm_eps=1e-6,
                  rope_theta=10000.0, hidden_act="silu", tie_word_embeddings=True,
                  bos_token_id=None, eos_token_id=EOS_TOKEN_ID, torch_dtype="float32",
                  **_DIMS)
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

    tensors = {"model.embed_tokens.weight": rand(VOCAB_SIZE, hidden),
               "model.norm.weight": np.ones(hidden, np.float32)}
    for i in range(_DIMS["num_hidden_layers"]):
        prefix = f"model.layers.{i}."
        tensors.update({
            prefix + "input_layernorm.weight": np.ones(hidden, np.float32),
            prefix + "post_attention_layernorm.weight": np.ones(hidden, np.float32),
            prefix + "self_attn.q_proj.weight": rand(hidden, hidden),
            prefix + "self_attn.k_proj.weight": rand(kv_size, hidden),
            prefix + "self_attn.v_proj.weight": rand(kv_size, hidden),
            prefix + "self_attn.o_proj.weight": rand(hidden, hidden),
            prefix + "mlp.gate_proj.weight": rand(inter, hidden),
            prefix + "mlp.up_proj.weight": rand(inter, hidden),
            prefix + "mlp.down_proj.weight": rand(hidden, inter),
        })
    save_file(tensors, os.path.join(model_dir, "model.safetensors"),
              metadata={"format": "pt"})


def _write_tokenizer(model_dir: str) -> None:
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers

    alphabet = sorted(pre_tokenizers.ByteLevel.alphabet())
    vocab = {symbol: index for index, symbol in enumerate(alphabet)}
    vocab[EOS_TOKEN] = EOS_TOKEN_ID
    tokenizer = Tokenizer(models.BPE(vocab=vocab, merges=[]))
    tokenizer.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tokenizer.decoder = decoders.ByteLevel()
    tokenizer.add_special_tokens([EOS_TOKEN])
    tokenizer.save(os.path.join(model_dir, "tokenizer.json"))
    with open(os.path.join(model_dir, "tokenizer_config.json"), "w") as f:
        json.dump({"tokenizer_class": "PreTrainedTokenizerFast", "eos_token": EOS_TOKEN,
                   "model_max_length": 512}, f)
