"""Write GPTQ and AWQ checkpoints to their published layouts (torch only), for the 4-bit
checkpoint tests and tests/support/make_int4_fixtures.py.

The weights are round-to-nearest quantized (the layouts are what is tested, not GPTQ's or
AWQ's search): per group of `group` input features a scale and a zero point. The packing is
the one services/worker/quant_formats/int4.py documents; this file writes it independently
of that reader (from the formats' definitions), and the fixtures script reads it back with
the tool that defines the format where it installs.
"""

from __future__ import annotations

import json
import os

import torch

AWQ_ORDER = (0, 2, 4, 6, 1, 3, 5, 7)
LINEARS = ("q_proj", "k_proj", "v_proj", "o_proj", "gate_proj", "up_proj", "down_proj")


def rtn_quantize(w: torch.Tensor, group: int, sym: bool, g_idx: torch.Tensor | None = None):
    """w [N, K] -> (q int64 [N, K] in 0..15, scales fp16 [N, G], zeros int64 [N, G]); column k
    belongs to group g_idx[k] (default k // group). Symmetric: zero 8, scale max|w| / 7.5
    (GPTQ's 2 max|w| / 15). Asymmetric zero points are kept in 1..15 (GPTQ's v1 layout stores
    zero - 1 in four bits)."""
    n, k = w.shape
    g_idx = torch.arange(k) // group if g_idx is None else g_idx.long()
    num_groups = k // group
    order = torch.argsort(g_idx, stable=True)
    grouped = w.float()[:, order].reshape(n, num_groups, group)
    if sym:
        scales = (grouped.abs().amax(-1) / 7.5).clamp_min(1e-6).half()
        zeros = torch.full((n, num_groups), 8, dtype=torch.int64)
    else:
        lo, hi = grouped.amin(-1).clamp(max=0), grouped.amax(-1).clamp(min=0)
        scales = ((hi - lo) / 15).clamp_min(1e-6).half()
        zeros = torch.round(-lo / scales.float()).long().clamp(1, 15)
    s, z = scales.float()[:, g_idx], zeros[:, g_idx]
    q = (torch.round(w.float() / s) + z).clamp(0, 15).long()
    return q, scales, zeros


def _to_int32(words: torch.Tensor) -> torch.Tensor:
    """int64 words in 0..2^32 - 1 -> int32 with the same bits."""
    return torch.where(words >= 2**31, words - 2**32, words).to(torch.int32)


def pack_along_last(values: torch.Tensor, order=tuple(range(8))) -> torch.Tensor:
    """[..., 8 M] values 0..15 -> int32 [..., M]; word j's value i is element 8j + order[i]."""
    v = values.long().reshape(*values.shape[:-1], -1, 8)[..., list(order)]
    shifts = torch.arange(0, 32, 4)
    return _to_int32((v << shifts).sum(-1))


def pack_gptq(q, scales, zeros, g_idx, version: int = 1) -> dict[str, torch.Tensor]:
    """GPTQ's qweight [K/8, N] (packed along K), qzeros [G, N/8] (zero - 1 in v1), scales
    [G, N], g_idx [K]."""
    stored = (zeros - 1) if version == 1 else zeros
    return {
        "qweight": pack_along_last(q).t().contiguous(),
        "qzeros": pack_along_last(stored.t() & 15),
        "scales": scales.t().contiguous(),
        "g_idx": g_idx.to(torch.int32),
    }


def pack_awq(q, scales, zeros) -> dict[str, torch.Tensor]:
    """AWQ GEMM's qweight [K, N/8] and qzeros [G, N/8] (packed along N in AWQ's order), scales
    [G, N]."""
    return {
        "qweight": pack_along_last(q.t(), AWQ_ORDER),
        "qzeros": pack_along_last(zeros.t(), AWQ_ORDER),
        "scales": scales.t().contiguous(),
    }


def gptq_config(group: int, sym: bool, desc_act: bool) -> dict:
    return {
        "quant_method": "gptq",
        "bits": 4,
        "group_size": group,
        "desc_act": desc_act,
        "sym": sym,
        "checkpoint_format": "gptq",
        "lm_head": False,
    }


def awq_config(group: int) -> dict:
    return {"quant_method": "awq", "bits": 4, "group_size": group, "zero_point": True,
            "version": "gemm"}  # fmt: skip


def write_checkpoint(
    hf_model, out_dir: str, method: str, group: int, sym: bool = False, desc_act: bool = False,
    seed: int = 0,
) -> dict[str, tuple]:  # fmt: skip
    """hf_model saved to out_dir with its decoder linears in method's layout ("gptq" or
    "awq"); the rest float. Returns prefix -> (q, scales, zeros, g_idx) as quantized."""
    from safetensors.torch import save_file

    hf_model.save_pretrained(out_dir)
    for name in os.listdir(out_dir):
        if name.endswith(".safetensors"):
            os.remove(os.path.join(out_dir, name))
    generator = torch.Generator().manual_seed(seed)
    tensors, quantized = {}, {}
    for name, param in hf_model.state_dict().items():
        prefix = name.removesuffix(".weight")
        if not (name.endswith(".weight") and prefix.rpartition(".")[2] in LINEARS):
            tensors[name] = param.detach().contiguous()
            continue
        w = param.detach().float()
        k = w.shape[1]
        g_idx = torch.arange(k) // group
        if desc_act:  # act-order: the groups scattered over K by a permutation
            g_idx = g_idx[torch.randperm(k, generator=generator)]
        q, scales, zeros = rtn_quantize(w, group, sym, g_idx)
        quantized[prefix] = (q, scales, zeros, g_idx)
        parts = (
            pack_gptq(q, scales, zeros, g_idx) if method == "gptq" else pack_awq(q, scales, zeros)
        )
        for suffix, t in parts.items():
            tensors[f"{prefix}.{suffix}"] = t
    save_file(tensors, os.path.join(out_dir, "model.safetensors"))
    config_path = os.path.join(out_dir, "config.json")
    with open(config_path) as f:
        config = json.load(f)
    qconfig = gptq_config(group, sym, desc_act) if method == "gptq" else awq_config(group)
    config["quantization_config"] = qconfig
    with open(config_path, "w") as f:
        json.dump(config, f, indent=2)
    return quantized


def dequantize(q, scales, zeros, g_idx) -> torch.Tensor:
    """(q - z) * s in float32, the formats' definition."""
    g_idx = g_idx.long()
    return (q.float() - zeros[:, g_idx].float()) * scales.float()[:, g_idx]
