"""Model registry and loading from a HF-style folder (config.json + *.safetensors)."""

from __future__ import annotations

import contextlib
import glob
import importlib
import os
from collections.abc import Iterator
from typing import TYPE_CHECKING, Any

import torch

if TYPE_CHECKING:
    from kvserve.services.worker.models.llama import LlamaForCausalLM

# HF architecture name -> (module under services.worker.models, class); imported on first use.
_MODELS: dict[str, tuple[str, str]] = {
    "LlamaForCausalLM": ("llama", "LlamaForCausalLM"),
    "MistralForCausalLM": ("llama", "LlamaForCausalLM"),
    "Qwen2ForCausalLM": ("llama", "Qwen2ForCausalLM"),
    "Qwen3ForCausalLM": ("qwen3", "Qwen3ForCausalLM"),
    "Qwen3MoeForCausalLM": ("qwen3_moe", "Qwen3MoeForCausalLM"),
    "Gemma2ForCausalLM": ("gemma2", "Gemma2ForCausalLM"),
    "Gemma3ForCausalLM": ("gemma3", "Gemma3ForCausalLM"),
    "Phi3ForCausalLM": ("phi3", "Phi3ForCausalLM"),
    "MixtralForCausalLM": ("mixtral", "MixtralForCausalLM"),
    "Llama4ForCausalLM": ("llama4", "Llama4ForCausalLM"),
    "Llama4ForConditionalGeneration": ("llama4", "Llama4ForConditionalGeneration"),
    "DeepseekV2ForCausalLM": ("deepseek_v2", "DeepseekV2ForCausalLM"),
    "DeepseekV3ForCausalLM": ("deepseek_v2", "DeepseekV3ForCausalLM"),
    "GptOssForCausalLM": ("gpt_oss", "GptOssForCausalLM"),
    "Qwen2_5_VLForConditionalGeneration": ("qwen2_5_vl", "Qwen2_5_VLForConditionalGeneration"),
    # Encoders (--runner pooling only; shared/model_dir.py ENCODER_ARCHITECTURES).
    "BertModel": ("bert", "BertModel"),
    "XLMRobertaModel": ("bert", "XLMRobertaModel"),
    "RobertaModel": ("bert", "XLMRobertaModel"),
    "BertForSequenceClassification": ("bert", "BertForSequenceClassification"),
    "XLMRobertaForSequenceClassification": ("bert", "XLMRobertaForSequenceClassification"),
    "RobertaForSequenceClassification": ("bert", "XLMRobertaForSequenceClassification"),
    "ModernBertModel": ("modernbert", "ModernBertModel"),
    "ModernBertForSequenceClassification": ("modernbert", "ModernBertForSequenceClassification"),
}

# Multimodal architectures served text-only: the engine reads their text_config.
_TEXT_ONLY_MULTIMODAL = frozenset({"Llama4ForConditionalGeneration"})

# For configs that name no architecture (e.g. converted GGUFs): model_type -> architecture.
_ARCH_OF_MODEL_TYPE: dict[str, str] = {
    "llama": "LlamaForCausalLM",
    "mistral": "MistralForCausalLM",
    "qwen2": "Qwen2ForCausalLM",
    "qwen3": "Qwen3ForCausalLM",
    "qwen3_moe": "Qwen3MoeForCausalLM",
    "gemma2": "Gemma2ForCausalLM",
    "gemma3_text": "Gemma3ForCausalLM",
    "phi3": "Phi3ForCausalLM",
    "mixtral": "MixtralForCausalLM",
    "llama4_text": "Llama4ForCausalLM",
    "llama4": "Llama4ForConditionalGeneration",
    "deepseek_v2": "DeepseekV2ForCausalLM",
    "deepseek_v3": "DeepseekV3ForCausalLM",
    "gpt_oss": "GptOssForCausalLM",
}


def supported_architectures() -> list[str]:
    return sorted(_MODELS)


def architecture_of_model_type(model_type: str) -> str | None:
    """The architecture we build for a HF `model_type`, or None if unsupported."""
    return _ARCH_OF_MODEL_TYPE.get(model_type)


def get_model_class(architectures: list[str]) -> type[LlamaForCausalLM]:
    """The model class of the first supported name in a config's `architectures` (each is
    LlamaForCausalLM or a subclass)."""
    for arch in architectures:
        if arch in _MODELS:
            module_name, class_name = _MODELS[arch]
            module = importlib.import_module(f"{__name__}.{module_name}")
            return getattr(module, class_name)
    raise ValueError(
        f"model architectures {architectures} are not supported; "
        f"supported: {supported_architectures()}"
    )


def iterate_safetensors(model_dir: str) -> Iterator[tuple[str, torch.Tensor]]:
    """Yield (name, tensor) of every *.safetensors file in model_dir, one tensor at a time."""
    from safetensors import safe_open

    files = sorted(glob.glob(os.path.join(model_dir, "*.safetensors")))
    if not files:
        raise ValueError(f"no *.safetensors file in {model_dir}")
    for path in files:
        with safe_open(path, framework="pt") as f:
            for name in f.keys():
                yield name, f.get_tensor(name)


@contextlib.contextmanager
def _default_dtype(dtype: torch.dtype) -> Iterator[None]:
    old = torch.get_default_dtype()
    torch.set_default_dtype(dtype)
    try:
        yield
    finally:
        torch.set_default_dtype(old)


def load_model(
    model_dir: str,
    dtype: torch.dtype,
    device: torch.device | str,
    quantization: str | None = None,
    model_arg: str | None = None,
) -> tuple[LlamaForCausalLM, Any]:
    """Build the model of model_dir/config.json in dtype on device and load its weights.

    A vision-language model is built from its whole config; the config returned is its
    language model's (`get_text_config()`: vocab, hidden size, layers), which the runner reads.

    Args:
        model_dir: a HF-style folder (see model_loader.resolve_model).
        dtype: parameter dtype (RoPE tables stay float32).
        device: where parameters are created; checkpoint tensors are copied in one by one.
        quantization: --quantization (gguf, int8 or None: see worker/quantization.py).
        model_arg: the user's model argument (the .gguf file gguf quantization reads).

    Returns:
        (model in eval mode, the transformers config: Any, as its attributes are per model).
    """
    from kvserve.services.worker.plain_llama_config import load_config

    hf_config = load_config(model_dir)
    architectures = list(getattr(hf_config, "architectures", None) or [])
    fallback = architecture_of_model_type(hf_config.model_type)
    if not architectures and fallback:
        architectures = [fallback]
    model_class = get_model_class(architectures)
    if _TEXT_ONLY_MULTIMODAL.intersection(architectures):
        hf_config = hf_config.get_text_config()
    from kvserve.services.worker import quantization as quant
    from kvserve.services.worker.kv_scales import apply_kv_scales, take_kv_scales

    method, gguf_path = quant.resolve_quantization(quantization, model_arg, model_dir)
    with _default_dtype(dtype), torch.device(device):
        model = quant.build_quantized(model_class, hf_config, method)
    # fp8 KV-cache scales leave the stream here: no model's loader sees them (worker/kv_scales).
    kv_scales: dict[str, tuple[str, float]] = {}
    checkpoint = take_kv_scales(iterate_safetensors(model_dir), kv_scales)
    weights = quant.quantized_weights(method, gguf_path, checkpoint, model_dir=model_dir)
    model.load_weights(weights)
    apply_kv_scales(model, kv_scales)
    quant.finish_loading(model)
    return model.eval(), hf_config.get_text_config()
