"""A plain Llama's config read without transformers (services/worker/plain_llama_config.py)
holds what transformers' AutoConfig holds; any other config is transformers' own."""

from __future__ import annotations

import json

import pytest

from kvserve.services.worker.plain_llama_config import PlainLlamaConfig, load_config

# PretrainedConfig's bookkeeping for transformers' own models and training: no kvserve code
# reads it, and the plain reader does not keep it.
_GENERIC = {"output_hidden_states", "return_dict", "dtype", "chunk_size_feed_forward",
            "is_encoder_decoder", "id2label", "label2id", "problem_type", "transformers_version",
            "_output_attentions", "_attn_implementation_internal",
            "_experts_implementation_internal", "_post_init_done"}  # fmt: skip
_LLAMA = {"model_type": "llama", "architectures": ["LlamaForCausalLM"]}


def _auto_config(model_dir: str):
    from transformers import AutoConfig

    return AutoConfig.from_pretrained(model_dir)


def _assert_same_as_transformers(model_dir: str) -> None:
    ours, theirs = load_config(model_dir), _auto_config(model_dir)
    assert isinstance(ours, PlainLlamaConfig)
    want = {k: v for k, v in vars(theirs).items() if k not in _GENERIC}
    assert ours.to_dict() == want
    assert ours.get_text_config() is ours


def _folder(tmp_path, config: dict) -> str:
    (tmp_path / "config.json").write_text(json.dumps(config))
    return str(tmp_path)


def test_the_default_and_the_tiny_models_read_as_transformers_reads_them(
    default_model_dir, tiny_llama_dir
):
    _assert_same_as_transformers(default_model_dir)
    _assert_same_as_transformers(tiny_llama_dir)


@pytest.mark.parametrize(
    "fields",
    [
        pytest.param({}, id="every-default"),
        pytest.param({"hidden_size": 96, "num_attention_heads": 6}, id="derived-sizes"),
        pytest.param({"rope_theta": 500000.0, "tie_word_embeddings": True}, id="old-rope-theta"),
        pytest.param({"rope_parameters": {"rope_theta": 1e6}, "bos_token_id": None}, id="rope"),
    ],
)
def test_left_out_fields_get_transformers_defaults(tmp_path, fields):
    _assert_same_as_transformers(_folder(tmp_path, _LLAMA | fields))


@pytest.mark.parametrize(
    "config",
    [
        _LLAMA | {"rope_scaling": {"rope_type": "linear", "factor": 2.0}},
        _LLAMA
        | {
            "rope_parameters": {
                "rope_type": "llama3",
                "rope_theta": 1e4,
                "factor": 8.0,
                "low_freq_factor": 1.0,
                "high_freq_factor": 4.0,
                "original_max_position_embeddings": 8192,
            }
        },  # fmt: skip
        _LLAMA | {"quantization_config": {"quant_method": "fp8"}},
        {"model_type": "mistral", "architectures": ["MistralForCausalLM"]},
        {"model_type": "llama"},  # a converted GGUF's: no architectures
    ],
    ids=["rope-scaling", "llama3-rope", "quantized", "mistral", "no-architectures"],
)
def test_any_other_config_is_transformers_own(tmp_path, config):
    assert not isinstance(load_config(_folder(tmp_path, config)), PlainLlamaConfig)
