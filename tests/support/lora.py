"""Random LoRA adapters for the tiny Llama, made with PEFT itself, and PEFT's merged model as
the reference to check kvserve's batched LoRA against."""

from __future__ import annotations

ALL_TARGETS = ["q_proj", "k_proj", "v_proj", "o_proj", "gate_proj", "up_proj", "down_proj"]


def load_hf_base(model_dir: str):
    """The tiny Llama folder as a transformers model (float32, eager attention)."""
    from transformers import AutoModelForCausalLM

    model = AutoModelForCausalLM.from_pretrained(
        model_dir, dtype="float32", attn_implementation="eager"
    )
    return model.eval()


def make_peft_adapter(
    model_dir: str,
    adapter_dir: str,
    *,
    seed: int,
    rank: int = 8,
    alpha: float = 16.0,
    targets: list[str] | None = None,
    std: float = 0.1,
    use_rslora: bool = False,
) -> str:
    """Save a PEFT LoRA adapter for the model in `model_dir` with random A and B (PEFT's own
    init leaves B zero, an adapter that changes nothing)."""
    import torch
    from peft import LoraConfig, get_peft_model

    config = LoraConfig(
        r=rank,
        lora_alpha=alpha,
        target_modules=targets or ALL_TARGETS,
        lora_dropout=0.0,
        use_rslora=use_rslora,
        init_lora_weights=False,
    )
    peft_model = get_peft_model(load_hf_base(model_dir), config)
    generator = torch.Generator().manual_seed(seed)
    with torch.no_grad():
        for name, param in peft_model.named_parameters():
            if "lora_" in name:
                param.copy_(torch.randn(param.shape, generator=generator) * std)
    peft_model.save_pretrained(adapter_dir)
    return adapter_dir


def merged_model(model_dir: str, adapter_dir: str | None):
    """The base model with the adapter merged into its weights (None: the base model)."""
    from peft import PeftModel

    base = load_hf_base(model_dir)
    if adapter_dir is None:
        return base
    return PeftModel.from_pretrained(base, adapter_dir).merge_and_unload().eval()


def hf_greedy(model, prompt_token_ids: list[int], max_tokens: int) -> list[int]:
    """Greedy continuation without a KV cache trick: one full forward per token."""
    import torch

    ids = list(prompt_token_ids)
    with torch.no_grad():
        for _ in range(max_tokens):
            logits = model(torch.tensor([ids])).logits[0, -1]
            ids.append(int(logits.argmax()))
    return ids[len(prompt_token_ids) :]


def hf_logprobs(model, token_ids: list[int]):
    """log_softmax of the logits at every position [len, vocab] (float32)."""
    import torch

    with torch.no_grad():
        return torch.log_softmax(model(torch.tensor([token_ids])).logits[0].float(), dim=-1)
