"""Regenerate tests/data/int4/: tiny 4-bit checkpoints made by the real tools, each with the
tool's own float32 dequantization of every quantized linear (reference/dequantized.safetensors).

Run in a venv with the tools (not the project's: llm-compressor pins its own transformers):

    python3 -m venv /tmp/int4tools && /tmp/int4tools/bin/pip install torch llmcompressor \\
        autoawq --no-deps   # autoawq for its dequantize_gemm only
    PYTHONPATH=$PWD /tmp/int4tools/bin/python tests/support/make_int4_fixtures.py

Checkpoints (tiny Llamas, random weights, 2 layers):

    ct_w4a16_g128      llm-compressor GPTQModifier, scheme W4A16 (int4 sym, group 128)
    ct_w4a16_asym_g32  llm-compressor AWQModifier, int4 asym group 32
    ct_w4a16_channel   llm-compressor GPTQModifier, int4 sym per channel, actorder weight
    ct_w4a16_actorder  compressed-tensors' own compressor on a group-32 act-order
                       (weight_g_idx) model: the layout llm-compressor wrote before
                       actorder "group" was removed
    awq_g32            tests/support/int4_writer.py, AWQ GEMM layout, read back by AutoAWQ's
                       dequantize_gemm
    gptq_g32_act       tests/support/int4_writer.py, GPTQ asym group 32 with desc_act;
                       its reference is the writer's dequantization, which GPTQModel's
                       TorchLinear reproduces bit for bit (tests/support/check_gptq_fixture.py,
                       run in a venv of its own)

reference/dequantized.safetensors holds "<prefix>.weight" float32 for every quantized linear:
what the tool's dequantization gives with the scales in float32.
"""

from __future__ import annotations

import json
import os
import shutil
import sys

import torch

HERE = os.path.dirname(os.path.abspath(__file__))
OUT = os.path.join(HERE, "..", "data", "int4")
sys.path.insert(0, os.path.join(HERE, "..", ".."))

from tests.support.int4_writer import LINEARS, write_checkpoint  # noqa: E402
from tests.support.int4_writer import dequantize as writer_dequantize  # noqa: E402

# K = 64, 128: groups of 32, and a tensor-parallel split of 2 keeps whole groups
SMALL = dict(hidden_size=64, intermediate_size=128)
WIDE = dict(hidden_size=128, intermediate_size=128)  # K = 128: groups of 128


def tiny_llama(dims: dict, seed: int):
    from transformers import LlamaConfig, LlamaForCausalLM

    config = LlamaConfig(
        vocab_size=128, num_hidden_layers=2, num_attention_heads=4, num_key_value_heads=2,
        max_position_embeddings=128, rms_norm_eps=1e-6, tie_word_embeddings=False,
        rope_theta=10000.0, **dims,
    )  # fmt: skip
    torch.manual_seed(seed)
    model = LlamaForCausalLM(config).eval()
    with torch.no_grad():
        for name, param in model.named_parameters():
            param.normal_(1.0, 0.1) if "norm" in name else param.normal_(0.0, 0.15)
    return model


def calibration():
    from datasets import Dataset

    generator = torch.Generator().manual_seed(1)
    ids = torch.randint(0, 128, (16, 32), generator=generator).tolist()
    return Dataset.from_dict({"input_ids": ids, "attention_mask": [[1] * 32] * 16})


def save_reference(ref: dict, out: str) -> None:
    """The tool's dequantization in <out>/reference/ (a subfolder: a loader globbing
    <out>/*.safetensors must not read it as part of the checkpoint)."""
    from safetensors.torch import save_file

    os.makedirs(os.path.join(out, "reference"), exist_ok=True)
    save_file(ref, os.path.join(out, "reference", "dequantized.safetensors"))


def tiny_tokenizer():
    """A word-level tokenizer over "0".."127" (oneshot wants a processor with a dataset)."""
    from tokenizers import Tokenizer
    from tokenizers.models import WordLevel
    from tokenizers.pre_tokenizers import WhitespaceSplit
    from transformers import PreTrainedTokenizerFast

    tokenizer = Tokenizer(WordLevel({str(i): i for i in range(128)}, unk_token="0"))
    tokenizer.pre_tokenizer = WhitespaceSplit()
    return PreTrainedTokenizerFast(tokenizer_object=tokenizer, unk_token="0", pad_token="0")


def llmcompressor_checkpoint(name: str, dims: dict, modifier) -> None:
    from llmcompressor import oneshot

    out = os.path.join(OUT, name)
    float_dir = os.path.join(OUT, "_float")
    tiny_llama(dims, seed=len(name)).save_pretrained(float_dir)
    tokenizer = tiny_tokenizer()
    tokenizer.save_pretrained(float_dir)
    model = oneshot(model=float_dir, processor=tokenizer, dataset=calibration(), recipe=modifier,
                    num_calibration_samples=16, max_seq_length=32)  # fmt: skip
    model.save_pretrained(out, save_compressed=True)
    shutil.rmtree(float_dir)
    write_ct_reference(out)


def write_ct_reference(out: str) -> None:
    """The compressed-tensors compressor's decompress of each linear, scales in float32."""
    from compressed_tensors.compressors.pack_quantized.base import PackedQuantizationCompressor
    from compressed_tensors.quantization import QuantizationScheme
    from safetensors.torch import load_file

    with open(os.path.join(out, "config.json")) as f:
        qconfig = json.load(f)["quantization_config"]
    (group,) = qconfig["config_groups"].values()
    scheme = QuantizationScheme.model_validate(group)
    tensors = load_file(os.path.join(out, "model.safetensors"))
    ref = {}
    for name in tensors:
        if not name.endswith(".weight_packed"):
            continue
        prefix = name.removesuffix(".weight_packed")
        local = {k.removeprefix(prefix + "."): v for k, v in tensors.items()
                 if k.startswith(prefix + ".")}  # fmt: skip
        local["weight_scale"] = local["weight_scale"].float()
        ref[f"{prefix}.weight"] = PackedQuantizationCompressor.decompress(local, scheme)["weight"]
    assert ref, "no pack-quantized linear written"
    save_reference(ref, out)


def ct_actorder_checkpoint(name: str, dims: dict) -> None:
    """A group-32 act-order checkpoint: quantized by compressed-tensors' own quantize with a
    g_idx, packed by its PackedQuantizationCompressor, weight_g_idx saved beside."""
    from compressed_tensors.compressors.pack_quantized.base import PackedQuantizationCompressor
    from compressed_tensors.quantization import QuantizationScheme
    from safetensors.torch import save_file

    out = os.path.join(OUT, name)
    model = tiny_llama(dims, seed=7)
    model.save_pretrained(out)
    os.remove(os.path.join(out, "model.safetensors"))
    weights = {"num_bits": 4, "type": "int", "symmetric": True, "strategy": "group",
               "group_size": 32, "actorder": None, "dynamic": False}  # fmt: skip
    scheme = QuantizationScheme.model_validate({"targets": ["Linear"], "weights": weights})
    generator = torch.Generator().manual_seed(3)
    tensors, ref = {}, {}
    for pname, param in model.state_dict().items():
        prefix = pname.removesuffix(".weight")
        if not (pname.endswith(".weight") and prefix.rpartition(".")[2] in LINEARS):
            tensors[pname] = param.contiguous()
            continue
        n, k = param.shape
        g_idx = (torch.arange(k) // 32)[torch.randperm(k, generator=generator)]
        grouped = torch.zeros(n, k // 32)
        for g in range(k // 32):
            grouped[:, g] = param[:, g_idx == g].abs().amax(1)
        scale = (grouped / 7.5).clamp_min(1e-6).to(torch.bfloat16)
        # the compressor quantizes per contiguous group: hand it the columns in group order
        order = torch.argsort(g_idx, stable=True)
        local = {"weight": param[:, order].contiguous(), "weight_scale": scale}
        packed_sorted = PackedQuantizationCompressor.compress(local, scheme)
        # unsort the packed columns: unpack, undo the order, repack (the tool's helpers)
        from compressed_tensors.compressors.pack_quantized.helpers import (
            pack_to_int32,
            unpack_from_int32,
        )

        values = unpack_from_int32(packed_sorted["weight_packed"], 4, torch.Size((n, k)))
        unsorted = torch.empty_like(values)
        unsorted[:, order] = values
        tensors[f"{prefix}.weight_packed"] = pack_to_int32(unsorted, 4)
        tensors[f"{prefix}.weight_scale"] = scale
        tensors[f"{prefix}.weight_shape"] = torch.tensor([n, k])
        tensors[f"{prefix}.weight_g_idx"] = g_idx.to(torch.int32)
        # the tool's dequantization of the sorted columns, put back in checkpoint order
        sorted_local = dict(packed_sorted, weight_scale=scale.float())
        deq = PackedQuantizationCompressor.decompress(sorted_local, scheme)["weight"]
        ref[f"{prefix}.weight"] = torch.empty_like(deq)
        ref[f"{prefix}.weight"][:, order] = deq
    save_file(tensors, os.path.join(out, "model.safetensors"))
    save_reference(ref, out)
    config_path = os.path.join(out, "config.json")
    with open(config_path) as f:
        config = json.load(f)
    config["quantization_config"] = {
        "quant_method": "compressed-tensors", "format": "pack-quantized",
        "quantization_status": "compressed", "ignore": ["lm_head"],
        "config_groups": {"group_0": {"targets": ["Linear"], "format": "pack-quantized",
                                      "weights": dict(weights, actorder="group")}},
    }  # fmt: skip
    with open(config_path, "w") as f:
        json.dump(config, f, indent=2)


def awq_checkpoint(name: str) -> None:
    from awq.utils.packing_utils import dequantize_gemm
    from safetensors.torch import load_file

    out = os.path.join(OUT, name)
    quantized = write_checkpoint(tiny_llama(SMALL, seed=11), out, "awq", 32)
    tensors = load_file(os.path.join(out, "model.safetensors"))
    ref = {}
    for prefix, parts in quantized.items():
        tool = dequantize_gemm(tensors[f"{prefix}.qweight"], tensors[f"{prefix}.qzeros"],
                               tensors[f"{prefix}.scales"].float(), 4, 32).t()  # fmt: skip
        assert torch.equal(tool, writer_dequantize(*parts)), prefix
        ref[f"{prefix}.weight"] = tool.contiguous()
    save_reference(ref, out)


def gptq_checkpoint(name: str) -> None:

    out = os.path.join(OUT, name)
    quantized = write_checkpoint(tiny_llama(SMALL, seed=13), out, "gptq", 32, desc_act=True)
    ref = {f"{p}.weight": writer_dequantize(*parts) for p, parts in quantized.items()}
    save_reference(ref, out)


def main() -> None:
    from llmcompressor.modifiers.awq import AWQModifier
    from llmcompressor.modifiers.quantization import GPTQModifier
    from llmcompressor.pipelines.cache import IntermediatesCache

    # AWQModifier pins its cached activations, which needs an accelerator: on CPU, skip it.
    IntermediatesCache.pin_memory = lambda self, *args, **kwargs: None

    shutil.rmtree(OUT, ignore_errors=True)
    os.makedirs(OUT)
    llmcompressor_checkpoint(
        "ct_w4a16_g128", WIDE, GPTQModifier(targets="Linear", scheme="W4A16", ignore=["lm_head"])
    )
    asym32 = {"targets": ["Linear"], "weights": {"num_bits": 4, "type": "int", "symmetric": False,
              "strategy": "group", "group_size": 32}}  # fmt: skip
    llmcompressor_checkpoint(
        "ct_w4a16_asym_g32", SMALL,
        AWQModifier(config_groups={"group_0": asym32}, ignore=["lm_head"]),
    )  # fmt: skip
    channel = {"targets": ["Linear"], "weights": {"num_bits": 4, "type": "int", "symmetric": True,
               "strategy": "channel", "actorder": "weight"}}  # fmt: skip
    llmcompressor_checkpoint(
        "ct_w4a16_channel", SMALL,
        GPTQModifier(config_groups={"group_0": channel}, ignore=["lm_head"]),
    )  # fmt: skip
    ct_actorder_checkpoint("ct_w4a16_actorder", SMALL)
    awq_checkpoint("awq_g32")
    gptq_checkpoint("gptq_g32_act")
    for name in sorted(os.listdir(OUT)):
        size = sum(
            os.path.getsize(os.path.join(OUT, name, f)) for f in os.listdir(os.path.join(OUT, name))
        )
        print(f"{name}: {size / 1024:.0f} KiB")


if __name__ == "__main__":
    main()
