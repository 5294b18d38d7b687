"""Tiny random-weight encoder folders (BERT, XLM-RoBERTa, ModernBERT) in sentence-transformers
layout, and tiny cross-encoders: HF's own classes with random weights, saved with their
WordPiece tokenizer (character pieces: every lowercase text of letters, digits and spaces
tokenizes without [UNK]).

Tests compare against sentence-transformers itself (`st_embeddings`) and HF's
`AutoModelForSequenceClassification` (`hf_pair_scores`).
"""

from __future__ import annotations

import json
import os
import string

import torch

_SPECIAL = ["[PAD]", "[UNK]", "[CLS]", "[SEP]", "[MASK]"]
_CHARS = list(string.ascii_lowercase + string.digits + ".,?!")
VOCAB = _SPECIAL + _CHARS + ["##" + c for c in _CHARS]
_DIMS = dict(
    vocab_size=len(VOCAB),
    hidden_size=32,
    num_hidden_layers=2,
    num_attention_heads=4,
    intermediate_size=64,
)


def _config(kind: str, num_labels: int | None):
    from transformers import BertConfig, ModernBertConfig, XLMRobertaConfig

    if kind == "bert":
        return BertConfig(**_DIMS, max_position_embeddings=128, type_vocab_size=2, pad_token_id=0)
    if kind == "xlm-roberta":
        # RoBERTa's pad id 1 ([UNK] here: never in a test's text) offsets its positions.
        return XLMRobertaConfig(
            **_DIMS, max_position_embeddings=130, type_vocab_size=1, pad_token_id=1
        )
    assert kind == "modernbert", kind
    return ModernBertConfig(
        **_DIMS,
        max_position_embeddings=128,
        local_attention=8,  # windows of 4 tokens each side: short texts cross them
        global_attn_every_n_layers=2,
        pad_token_id=0,
        cls_token_id=2,
        sep_token_id=3,
        classifier_pooling="mean",
        **({"num_labels": num_labels} if num_labels else {}),
    )


def _model_class(kind: str, classifier: bool):
    import transformers as tf

    name = {"bert": "Bert", "xlm-roberta": "XLMRoberta", "modernbert": "ModernBert"}[kind]
    return getattr(tf, f"{name}ForSequenceClassification" if classifier else f"{name}Model")


def _save_tokenizer(model_dir: str) -> None:
    """A BERT WordPiece tokenizer.json ([CLS] a [SEP] and [CLS] a [SEP] b [SEP] with token
    types 0 then 1), built with `tokenizers`."""
    from tokenizers import Tokenizer, normalizers, pre_tokenizers, processors
    from tokenizers.models import WordPiece
    from transformers import PreTrainedTokenizerFast

    vocab = {token: i for i, token in enumerate(VOCAB)}
    tokenizer = Tokenizer(WordPiece(vocab, unk_token="[UNK]", max_input_chars_per_word=100))
    tokenizer.normalizer = normalizers.BertNormalizer(lowercase=True)
    tokenizer.pre_tokenizer = pre_tokenizers.BertPreTokenizer()
    tokenizer.post_processor = processors.TemplateProcessing(
        single="[CLS] $A [SEP]",
        pair="[CLS] $A [SEP] $B:1 [SEP]:1",
        special_tokens=[("[CLS]", vocab["[CLS]"]), ("[SEP]", vocab["[SEP]"])],
    )
    fast = PreTrainedTokenizerFast(
        tokenizer_object=tokenizer,
        unk_token="[UNK]",
        pad_token="[PAD]",
        cls_token="[CLS]",
        sep_token="[SEP]",
        mask_token="[MASK]",
        model_max_length=128,
    )
    fast.save_pretrained(model_dir)


def build_encoder(
    model_dir: str, kind: str, pooling: str = "mean", normalize: bool = True, seed: int = 0
) -> str:
    """An embedding model folder: the encoder, modules.json, 1_Pooling/config.json and,
    when `normalize`, a 2_Normalize module. `pooling` is cls, mean or lasttoken."""
    torch.manual_seed(seed)
    config = _config(kind, None)
    model = _model_class(kind, False)(config).eval()
    _perturb(model)
    model.save_pretrained(model_dir)
    _save_tokenizer(model_dir)
    modules = [
        {"idx": 0, "name": "0", "path": "", "type": "sentence_transformers.models.Transformer"},
        {
            "idx": 1,
            "name": "1",
            "path": "1_Pooling",
            "type": "sentence_transformers.models.Pooling",
        },
    ]
    if normalize:
        modules.append(
            {
                "idx": 2,
                "name": "2",
                "path": "2_Normalize",
                "type": "sentence_transformers.models.Normalize",
            }
        )
        os.makedirs(os.path.join(model_dir, "2_Normalize"), exist_ok=True)
    with open(os.path.join(model_dir, "modules.json"), "w") as f:
        json.dump(modules, f)
    os.makedirs(os.path.join(model_dir, "1_Pooling"), exist_ok=True)
    pooling_config = {
        "word_embedding_dimension": config.hidden_size,
        "pooling_mode_cls_token": pooling == "cls",
        "pooling_mode_mean_tokens": pooling == "mean",
        "pooling_mode_max_tokens": False,
        "pooling_mode_lasttoken": pooling == "lasttoken",
    }
    with open(os.path.join(model_dir, "1_Pooling", "config.json"), "w") as f:
        json.dump(pooling_config, f)
    return model_dir


def build_cross_encoder(model_dir: str, kind: str = "bert", num_labels: int = 1, seed: int = 0):
    """A `*ForSequenceClassification` folder (a cross-encoder with one label, a classifier
    with several, named in id2label)."""
    torch.manual_seed(seed)
    config = _config(kind, num_labels)
    config.num_labels = num_labels
    config.id2label = {i: f"label_{i}" for i in range(num_labels)}
    config.label2id = {v: k for k, v in config.id2label.items()}
    model = _model_class(kind, True)(config).eval()
    _perturb(model)
    model.save_pretrained(model_dir)
    _save_tokenizer(model_dir)
    return model_dir


def _perturb(model: torch.nn.Module) -> None:
    """HF initialises LayerNorms to (1, 0) and biases to 0: random ones test their loading."""
    with torch.no_grad():
        for name, param in model.named_parameters():
            if name.endswith("bias") or "norm" in name.lower():
                param.add_(torch.randn_like(param) * 0.1)
            else:  # std 0.1, not 0.02: scores that differ from document to document
                param.mul_(5.0)


def st_embeddings(model_dir: str, texts: list[str]) -> torch.Tensor:
    """sentence-transformers' embeddings of the folder (its modules: the encoder, Pooling,
    Normalize when listed), one text at a time."""
    from sentence_transformers import SentenceTransformer

    model = SentenceTransformer(model_dir, device="cpu")
    return torch.stack([torch.from_numpy(model.encode(text)) for text in texts])


def hf_pair_scores(model_dir: str, query: str, documents: list[str]) -> torch.Tensor:
    """HF AutoModelForSequenceClassification's logits [N, num_labels] of (query, document)
    pairs, tokenized as the tokenizer's pair encoding."""
    from transformers import AutoModelForSequenceClassification, AutoTokenizer

    model = AutoModelForSequenceClassification.from_pretrained(model_dir, dtype=torch.float32)
    tokenizer = AutoTokenizer.from_pretrained(model_dir)
    with_types = (
        model.config.type_vocab_size > 1 if hasattr(model.config, "type_vocab_size") else False
    )
    rows = []
    for document in documents:
        inputs = tokenizer(query, document, return_tensors="pt", return_token_type_ids=with_types)
        with torch.inference_mode():
            rows.append(model.eval()(**inputs).logits[0])
    return torch.stack(rows)
