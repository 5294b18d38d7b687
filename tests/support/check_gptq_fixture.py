"""Read tests/data/int4/gptq_g32_act back with GPTQModel (the tool that defines the GPTQ
layout) and check its dequantization equals reference/dequantized.safetensors bit for bit.

GPTQModel needs torch >= 2.14 by its metadata; on CPU its TorchLinear runs on 2.13 when
installed with --no-deps plus its light dependencies (accelerate numpy safetensors
transformers threadpoolctl device-smi protobuf pillow requests pypcre tokenicer logbar
datasets dill defuser torchao ninja maturin); run it from outside the repository (its
`kernels` package and tests/support/kernels.py would shadow the Hub's `kernels`):

    cd /tmp && /tmp/gptqtools/bin/python -c 'import runpy, sys; runpy.run_path(sys.argv[1],
        run_name="__main__")' <repo>/tests/support/check_gptq_fixture.py
"""

from __future__ import annotations

import json
import os

import torch
from gptqmodel.nn_modules.qlinear.torch import TorchLinear
from gptqmodel.utils.model import convert_gptq_v1_to_v2_format_module
from safetensors.torch import load_file

FOLDER = os.path.join(
    os.path.dirname(os.path.abspath(__file__)), "..", "data", "int4", "gptq_g32_act"
)


def main() -> None:
    with open(os.path.join(FOLDER, "config.json")) as f:
        qconfig = json.load(f)["quantization_config"]
    tensors = load_file(os.path.join(FOLDER, "model.safetensors"))
    reference = load_file(os.path.join(FOLDER, "reference", "dequantized.safetensors"))
    for name, expected in reference.items():
        prefix = name.removesuffix(".weight")
        n, k = expected.shape
        layer = TorchLinear(
            bits=4,
            group_size=qconfig["group_size"],
            sym=qconfig["sym"],
            desc_act=qconfig["desc_act"],
            in_features=k,
            out_features=n,
        )
        for part in ("qweight", "qzeros", "scales", "g_idx"):
            getattr(layer, part).data = tensors[f"{prefix}.{part}"].clone()
        layer.scales.data = layer.scales.data.float()  # the tool's formula, in float32
        convert_gptq_v1_to_v2_format_module(layer, bits=4, pack_dtype=torch.int32)
        layer.post_init()
        got = layer.dequantize_weight().t().float()
        assert torch.equal(got, expected), f"{prefix}: GPTQModel's dequantization differs"
    print(f"GPTQModel: {len(reference)} linears equal to the reference bit for bit")


if __name__ == "__main__":
    main()
