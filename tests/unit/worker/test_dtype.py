"""--dtype auto takes the checkpoint's dtype, with vLLM's two casts."""

from __future__ import annotations

import json

import pytest
import torch

from kvserve.services.worker.dtype import checkpoint_dtype, resolve_dtype

CPU, CUDA = torch.device("cpu"), torch.device("cuda")


@pytest.mark.parametrize(
    "dtype, device, checkpoint, expected",
    [
        ("auto", CPU, None, torch.float32),
        ("auto", CPU, "bfloat16", torch.bfloat16),
        ("auto", CPU, "float32", torch.float32),
        ("auto", CPU, "float16", torch.bfloat16),  # CPUs lack fast float16 GEMMs
        ("auto", CUDA, "float16", torch.float16),
        ("auto", CUDA, "float32", torch.bfloat16),
        ("auto", CUDA, None, torch.bfloat16),
        ("auto", CPU, "torch.bfloat16", torch.bfloat16),
        ("float16", CPU, "bfloat16", torch.float16),  # an explicit dtype is never cast
        ("float32", CUDA, "bfloat16", torch.float32),
    ],
)
def test_resolve_dtype(dtype, device, checkpoint, expected):
    assert resolve_dtype(dtype, device, checkpoint) == expected


@pytest.mark.parametrize(
    "config, expected",
    [
        ({"dtype": "bfloat16"}, "bfloat16"),
        ({"torch_dtype": "float16"}, "float16"),
        ({}, None),
    ],
)
def test_checkpoint_dtype_reads_config_json(tmp_path, config, expected):
    (tmp_path / "config.json").write_text(json.dumps(config))
    assert checkpoint_dtype(str(tmp_path)) == expected
