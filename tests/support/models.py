"""Tiny random-weight models, written in seconds and stepped in milliseconds.

Five builders:
- `build_tiny_llama`: a Llama folder (config, safetensors, byte-level tokenizer) written
  with numpy and `tokenizers` only, so a process test that serves it never imports torch.
  With `successor=True` its greedy next token is a fixed permutation of the current one
  (`tiny_successor`), whatever the context, so a draft can be built to guess it.
- `build_tiny_eagle3`: an EAGLE-3 draft folder for such a model, in the published layout.
- `build_tiny_deepseek_v3`: a DeepSeek-V3 folder the same way, with its multi-token-prediction
  layer (`num_nextn_predict_layers`), built to guess a `successor` target's next tokens.
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


def build_tiny_llama(model_dir: str, seed: int = 0, successor: bool = False) -> str:
    """Write config.json, model.safetensors and tokenizer files into model_dir; return it.

    Args:
        successor: an untied LM head whose row tiny_successor()[x] is the normed embedding
            of x, and layers scaled down 20x: the greedy next token of x is its successor.
    """
    os.makedirs(model_dir, exist_ok=True)
    _write_config(model_dir, tied=not successor)
    _write_weights(model_dir, seed, successor)
    _write_tokenizer(model_dir)
    return model_dir


def tiny_successor() -> np.ndarray:
    """[TINY_VOCAB_SIZE] the next token of each token in a `successor` tiny Llama: a fixed
    permutation of the bytes (EOS follows EOS only, so it is never generated)."""
    order = np.random.default_rng(1234).permutation(TINY_EOS_TOKEN_ID)
    return np.append(order, TINY_EOS_TOKEN_ID)


def _rms_normed(x: np.ndarray) -> np.ndarray:
    return x / np.sqrt(np.mean(x * x, axis=-1, keepdims=True) + 1e-6)


def _write_config(model_dir: str, tied: bool = True) -> None:
    config = dict(
        architectures=["LlamaForCausalLM"],
        model_type="llama",
        vocab_size=TINY_VOCAB_SIZE,
        max_position_embeddings=512,
        rms_norm_eps=1e-6,
        rope_theta=10000.0,
        hidden_act="silu",
        tie_word_embeddings=tied,
        bos_token_id=None,
        eos_token_id=TINY_EOS_TOKEN_ID,
        torch_dtype="float32",
        **_DIMS,
    )
    with open(os.path.join(model_dir, "config.json"), "w") as f:
        json.dump(config, f, indent=1)


def _write_weights(model_dir: str, seed: int, successor: bool = False) -> None:
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
    # A successor model's layers only nudge the residual stream: the LM head's match of
    # the current token's own embedding decides.
    out_scale = 0.05 if successor else 1.0
    if successor:
        head = np.empty_like(tensors["model.embed_tokens.weight"])
        head[tiny_successor()] = _rms_normed(tensors["model.embed_tokens.weight"])
        tensors["lm_head.weight"] = head
    for i in range(_DIMS["num_hidden_layers"]):
        prefix = f"model.layers.{i}."
        tensors.update(
            {
                prefix + "input_layernorm.weight": np.ones(hidden, np.float32),
                prefix + "post_attention_layernorm.weight": np.ones(hidden, np.float32),
                prefix + "self_attn.q_proj.weight": rand(hidden, hidden),
                prefix + "self_attn.k_proj.weight": rand(kv_size, hidden),
                prefix + "self_attn.v_proj.weight": rand(kv_size, hidden),
                prefix + "self_attn.o_proj.weight": rand(hidden, hidden) * out_scale,
                prefix + "mlp.gate_proj.weight": rand(inter, hidden),
                prefix + "mlp.up_proj.weight": rand(inter, hidden),
                prefix + "mlp.down_proj.weight": rand(hidden, inter) * out_scale,
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


def build_tiny_eagle3(
    draft_dir: str, target_dir: str, draft_vocab_size: int | None = None, seed: int = 0
) -> str:
    """Write an EAGLE-3 draft for the tiny Llama in target_dir, in the published layout
    (config.json + model.safetensors, no embedding: the target's is shared); return its folder.

    Built to guess what a `successor` target says: attention (q = k = 3 x, v = x, on the
    normed embedding half only) reads the current pair's own token, o_proj scales it up 8x
    over the residual (hidden_norm(g), norm_before_residual), and lm_head holds the target's
    head rows, so the argmax is the successor of the pair's token. fc, the MLP and the
    hidden half of the attention input carry random weights that do not change the guess.
    With draft_vocab_size, lm_head keeps that many target rows (a random subset, d2t
    mapping them); a successor outside it is never guessed.
    """
    from safetensors.numpy import load_file, save_file

    rng = np.random.default_rng(seed)
    hidden, inter, heads = _DIMS["hidden_size"], _DIMS["intermediate_size"], 4
    target = load_file(os.path.join(target_dir, "model.safetensors"))
    head = target.get("lm_head.weight", target["model.embed_tokens.weight"])
    vocab = head.shape[0]
    size = draft_vocab_size or vocab
    targets = np.arange(vocab) if size == vocab else np.sort(rng.choice(vocab, size, False))
    eye, zeros = np.eye(hidden, dtype=np.float32), np.zeros((hidden, hidden), np.float32)

    def rand(*shape, scale=0.15):
        return rng.normal(0.0, scale, shape).astype(np.float32)

    ones = np.ones(hidden, np.float32)
    tensors = {
        "fc.weight": rand(hidden, 3 * hidden),
        "midlayer.input_layernorm.weight": ones,
        "midlayer.hidden_norm.weight": ones,
        "midlayer.post_attention_layernorm.weight": ones,
        "midlayer.self_attn.q_proj.weight": np.concatenate([3 * eye, zeros], 1),
        "midlayer.self_attn.k_proj.weight": np.concatenate([3 * eye, zeros], 1),
        "midlayer.self_attn.v_proj.weight": np.concatenate(
            [eye, rand(hidden, hidden, scale=0.02)], 1
        ),
        "midlayer.self_attn.o_proj.weight": 8 * eye,
        "midlayer.mlp.gate_proj.weight": rand(inter, hidden),
        "midlayer.mlp.up_proj.weight": rand(inter, hidden),
        "midlayer.mlp.down_proj.weight": rand(hidden, inter, scale=0.01),
        "norm.weight": ones,
        "lm_head.weight": np.ascontiguousarray(head[targets]),
        "d2t": (targets - np.arange(size)).astype(np.int64),
        "t2d": np.isin(np.arange(vocab), targets),
    }
    config = dict(
        architectures=["LlamaForCausalLMEagle3"],
        model_type="llama",
        hidden_size=hidden,
        intermediate_size=inter,
        num_hidden_layers=1,
        num_attention_heads=heads,
        num_key_value_heads=heads,
        vocab_size=vocab,
        draft_vocab_size=size,
        max_position_embeddings=512,
        rms_norm_eps=1e-6,
        rope_theta=10000.0,
        hidden_act="silu",
        # The tiny target has 2 layers (the defaults, 2, L // 2 and L - 3, need 6): the
        # embeddings, the first layer's output and the last one's.
        eagle_aux_hidden_state_layer_ids=[0, 1, 2],
        norm_before_residual=True,
    )
    os.makedirs(draft_dir, exist_ok=True)
    with open(os.path.join(draft_dir, "config.json"), "w") as f:
        json.dump(config, f, indent=1)
    save_file(tensors, os.path.join(draft_dir, "model.safetensors"), metadata={"format": "pt"})
    return draft_dir


# A tiny DeepSeek-V3 (build_tiny_deepseek_v3): MLA with q through its own latent, a dense
# first layer then MoE (8 experts, 2 a token, in 2 of 4 groups, one shared expert).
_DEEPSEEK_DIMS = dict(
    hidden_size=64,
    intermediate_size=128,
    num_hidden_layers=2,
    num_attention_heads=4,
    num_key_value_heads=4,
    q_lora_rank=48,
    kv_lora_rank=32,
    qk_nope_head_dim=16,
    qk_rope_head_dim=8,
    v_head_dim=16,
    moe_intermediate_size=32,
    n_routed_experts=8,
    num_experts_per_tok=2,
    n_shared_experts=1,
    n_group=4,
    topk_group=2,
    first_k_dense_replace=1,
)


def build_tiny_deepseek_v3(
    model_dir: str, seed: int = 0, successor: bool = False, mtp: bool = True
) -> str:
    """Write a tiny DeepSeek-V3 folder (config.json with num_nextn_predict_layers, HF-named
    model.safetensors, the byte-level tokenizer) with numpy only; return it.

    Args:
        successor: as build_tiny_llama's: the LM head's row tiny_successor()[x] is the normed
            embedding of x and every layer's output projections are scaled down 20x, so the
            greedy next token of x is its successor. The MTP layer is then built to guess
            it: eh_proj passes the token's normed embedding through and its shared_head.head
            is the target's LM head, so from the pair (h_p, x_{p+1}) it guesses x_{p+1}'s
            successor, which is x_{p+2}.
        mtp: write one MTP layer (model.layers.2.*, num_nextn_predict_layers 1); without,
            num_nextn_predict_layers is 0 and the checkpoint has no such tensors.
    """
    from safetensors.numpy import save_file

    rng = np.random.default_rng(seed)
    dims = _DEEPSEEK_DIMS
    hidden, num_layers = dims["hidden_size"], dims["num_hidden_layers"]

    def rand(*shape, scale=0.15):
        return rng.normal(0.0, scale, shape).astype(np.float32)

    embed = rand(TINY_VOCAB_SIZE, hidden)
    head = rand(TINY_VOCAB_SIZE, hidden)
    if successor:
        head[tiny_successor()] = _rms_normed(embed)
    out_scale = 0.05 if successor else 1.0
    ones = np.ones(hidden, np.float32)
    tensors = {
        "model.embed_tokens.weight": embed,
        "model.norm.weight": ones,
        "lm_head.weight": head,
    }
    for i in range(num_layers + (1 if mtp else 0)):
        tensors.update(_deepseek_layer(f"model.layers.{i}.", i, rand, out_scale))
    if mtp:
        prefix = f"model.layers.{num_layers}."
        eye = np.eye(hidden, dtype=np.float32)
        # The built layer reads the token's half only: [enorm(e) | hnorm(h)] -> enorm(e).
        eh_proj = np.concatenate([eye, 0 * eye], 1) if successor else rand(hidden, 2 * hidden)
        tensors.update(
            {
                prefix + "embed_tokens.weight": embed,  # DeepSeek's copy of the target's
                prefix + "enorm.weight": ones,
                prefix + "hnorm.weight": ones,
                prefix + "eh_proj.weight": eh_proj,
                prefix + "shared_head.norm.weight": ones,
                prefix + "shared_head.head.weight": head if successor else rand(*head.shape),
            }
        )
    os.makedirs(model_dir, exist_ok=True)
    save_file(tensors, os.path.join(model_dir, "model.safetensors"), metadata={"format": "pt"})
    config = dict(
        architectures=["DeepseekV3ForCausalLM"],
        model_type="deepseek_v3",
        vocab_size=TINY_VOCAB_SIZE,
        max_position_embeddings=512,
        rms_norm_eps=1e-6,
        rope_theta=10000.0,
        rope_interleave=True,
        hidden_act="silu",
        topk_method="noaux_tc",
        scoring_func="sigmoid",
        norm_topk_prob=True,
        routed_scaling_factor=2.5,
        num_nextn_predict_layers=1 if mtp else 0,
        tie_word_embeddings=False,
        bos_token_id=None,
        eos_token_id=TINY_EOS_TOKEN_ID,
        torch_dtype="float32",
        **dims,
    )
    with open(os.path.join(model_dir, "config.json"), "w") as f:
        json.dump(config, f, indent=1)
    _write_tokenizer(model_dir)
    return model_dir


def _deepseek_layer(prefix: str, index: int, rand, out_scale: float) -> dict[str, np.ndarray]:
    """One DeepSeek-V3 decoder layer's tensors under HF's names (dense before
    first_k_dense_replace, else routed experts plus the shared one); the output projections
    times out_scale."""
    d = _DEEPSEEK_DIMS
    hidden, heads = d["hidden_size"], d["num_attention_heads"]
    nope, rope, v_dim = d["qk_nope_head_dim"], d["qk_rope_head_dim"], d["v_head_dim"]
    q_rank, kv_rank = d["q_lora_rank"], d["kv_lora_rank"]
    ones = np.ones(hidden, np.float32)
    out = {
        "input_layernorm.weight": ones,
        "post_attention_layernorm.weight": ones,
        "self_attn.q_a_proj.weight": rand(q_rank, hidden),
        "self_attn.q_a_layernorm.weight": np.ones(q_rank, np.float32),
        "self_attn.q_b_proj.weight": rand(heads * (nope + rope), q_rank),
        "self_attn.kv_a_proj_with_mqa.weight": rand(kv_rank + rope, hidden),
        "self_attn.kv_a_layernorm.weight": np.ones(kv_rank, np.float32),
        "self_attn.kv_b_proj.weight": rand(heads * (nope + v_dim), kv_rank),
        "self_attn.o_proj.weight": rand(hidden, heads * v_dim) * out_scale,
    }

    def mlp(name: str, inter: int) -> None:
        out[f"{name}.gate_proj.weight"] = rand(inter, hidden)
        out[f"{name}.up_proj.weight"] = rand(inter, hidden)
        out[f"{name}.down_proj.weight"] = rand(hidden, inter) * out_scale

    if index < d["first_k_dense_replace"]:
        mlp("mlp", d["intermediate_size"])
    else:
        out["mlp.gate.weight"] = rand(d["n_routed_experts"], hidden)
        out["mlp.gate.e_score_correction_bias"] = rand(d["n_routed_experts"], scale=0.3)
        for e in range(d["n_routed_experts"]):
            mlp(f"mlp.experts.{e}", d["moe_intermediate_size"])
        mlp("mlp.shared_experts", d["moe_intermediate_size"] * d["n_shared_experts"])
    return {prefix + name: tensor for name, tensor in out.items()}


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
