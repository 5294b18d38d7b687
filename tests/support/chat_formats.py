"""Tiny random models that speak a family's chat format: a byte-level tokenizer (256 byte
symbols) plus the family's special tokens, each one id, and a chat template; the model's
vocabulary is exactly the tokenizer's, so a grammar can force any text.

HARMONY_TOKENS are gpt-oss's special tokens (its tokenizer holds them, one id each)."""

from __future__ import annotations

import json
import os

HARMONY_TOKENS = [
    "<|start|>",
    "<|end|>",
    "<|message|>",
    "<|channel|>",
    "<|constrain|>",
    "<|return|>",
    "<|call|>",
    "<|endoftext|>",
]
QWEN_TOKENS = ["<|im_start|>", "<|im_end|>", "<|endoftext|>"]


def write_byte_tokenizer(
    model_dir: str, special_tokens: list[str], eos: str, chat_template: str | None = None
) -> int:
    """A byte-level BPE tokenizer with `special_tokens` after the 256 bytes; its size."""
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers

    alphabet = sorted(pre_tokenizers.ByteLevel.alphabet())
    vocab = {symbol: index for index, symbol in enumerate(alphabet)}
    for token in special_tokens:
        vocab[token] = len(vocab)
    tokenizer = Tokenizer(models.BPE(vocab=vocab, merges=[]))
    tokenizer.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tokenizer.decoder = decoders.ByteLevel()
    tokenizer.add_special_tokens(special_tokens)
    os.makedirs(model_dir, exist_ok=True)
    tokenizer.save(os.path.join(model_dir, "tokenizer.json"))
    config = {"tokenizer_class": "PreTrainedTokenizerFast", "eos_token": eos}
    if chat_template is not None:
        config["chat_template"] = chat_template
    with open(os.path.join(model_dir, "tokenizer_config.json"), "w") as f:
        json.dump(config, f)
    return len(vocab)


def save_tiny_chat_model(
    kind: str, model_dir: str, special_tokens: list[str], eos: str, template: str | None = None
) -> str:
    """A tiny random `kind` model (tests/support/hf_models.py) with the tokenizer above."""
    from tests.support.hf_models import make_tiny_family_model

    vocab_size = write_byte_tokenizer(model_dir, special_tokens, eos, template)
    model = make_tiny_family_model(kind, vocab_size=vocab_size, max_position_embeddings=1024)
    model.config.eos_token_id = vocab_size - len(special_tokens) + special_tokens.index(eos)
    model.save_pretrained(model_dir)
    return model_dir
