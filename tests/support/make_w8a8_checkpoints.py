"""Write the tiny 8-bit checkpoints of tests/data/w8a8/ with the real llm-compressor.

Run it with a Python that has llmcompressor (it pins its own transformers, so not the team's
venv), from outside the repository root (the repo's `kernels` folder would shadow the
`kernels` package transformers probes for):

    python3 -m venv /tmp/llmc && /tmp/llmc/bin/pip install torch==2.13.0 llmcompressor==0.14.0.1
    cd /tmp && /tmp/llmc/bin/python /path/to/kvserve/tests/support/make_w8a8_checkpoints.py \
        /path/to/kvserve/tests/data/w8a8

Each scheme gets a folder <out>/<scheme>/ (config.json with llm-compressor's
quantization_config, model.safetensors as compressed-tensors saves it) and
<out>/<scheme>/hf_logits.pt: the logits HF transformers computes from the quantized
folder (its compressed-tensors integration, on CPU) for PROMPT, so the tests compare kvserve
with HF on the format without needing llmcompressor installed. The float model is the tiny
Llama of tests/support/models.py (`make_tiny_hf_model("llama")`: the same config and seed),
rebuilt here because this script cannot import the repository.

With `--default-model <float HF folder> <out>` it quantizes SmolLM2-135M (the GGUF's float
expansion) to W8A8 instead, calibration-free, for bench/w8a8.py.
"""

from __future__ import annotations

import os
import shutil
import sys

import torch

SCHEMES = ("W8A8", "FP8_DYNAMIC")  # int8 or fp8 channel weights, dynamic per-token
HF_LOGITS = "hf_logits.pt"
PROMPT = [(7 * i + 3) % 96 for i in range(24)]
TINY_HF_DIMS = dict(
    hidden_size=64,
    intermediate_size=96,
    num_hidden_layers=2,
    num_attention_heads=4,
    num_key_value_heads=2,
    max_position_embeddings=128,
    rms_norm_eps=1e-6,
)


def tiny_llama():
    from transformers import LlamaConfig, LlamaForCausalLM

    config = LlamaConfig(
        **TINY_HF_DIMS, vocab_size=96, rope_theta=10000.0, tie_word_embeddings=False
    )
    config._attn_implementation = "eager"
    torch.manual_seed(0)
    model = LlamaForCausalLM(config).eval()
    with torch.no_grad():
        for name, param in model.named_parameters():
            if "norm" in name:
                param.normal_(1.0, 0.1)
            else:
                param.normal_(0.0, 0.15)
    return model


def quantize(model, scheme: str, out_dir: str) -> None:
    from llmcompressor import oneshot
    from llmcompressor.modifiers.quantization import QuantizationModifier

    recipe = QuantizationModifier(targets="Linear", scheme=scheme, ignore=["lm_head"])
    oneshot(model=model, recipe=recipe)  # both schemes are calibration-free
    model.save_pretrained(out_dir, save_compressed=True)


def hf_logits(model_dir: str) -> None:
    from transformers import AutoModelForCausalLM

    model = AutoModelForCausalLM.from_pretrained(model_dir, dtype=torch.float32).eval()
    with torch.no_grad():
        logits = model(torch.tensor([PROMPT])).logits[0].float().contiguous()
    # not *.safetensors: a loader reads every such file of the folder as weights
    torch.save(
        {"logits": logits, "prompt": torch.tensor(PROMPT)}, os.path.join(model_dir, HF_LOGITS)
    )


def main(argv: list[str]) -> None:
    if argv[:1] == ["--default-model"]:
        from transformers import AutoModelForCausalLM

        src, out = argv[1], argv[2]
        model = AutoModelForCausalLM.from_pretrained(src, dtype=torch.bfloat16)
        quantize(model, "W8A8", out)
        for name in ("tokenizer.json", "tokenizer_config.json", "chat_template.jinja",
                     "generation_config.json"):  # fmt: skip
            if os.path.exists(os.path.join(src, name)):
                shutil.copyfile(os.path.join(src, name), os.path.join(out, name))
        return
    out = argv[0]
    import tempfile

    from transformers import AutoModelForCausalLM

    float_dir = tempfile.mkdtemp()
    tiny_llama().save_pretrained(float_dir)  # oneshot wants a model that knows its folder
    for scheme in SCHEMES:
        folder = os.path.join(out, scheme.lower())
        model = AutoModelForCausalLM.from_pretrained(float_dir, dtype=torch.float32)
        quantize(model, scheme, folder)
        hf_logits(folder)
        for name in os.listdir(folder):
            if name not in ("config.json", "model.safetensors", HF_LOGITS):
                os.remove(os.path.join(folder, name))


if __name__ == "__main__":
    main(sys.argv[1:])
