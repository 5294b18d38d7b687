"""4-bit weight-only checkpoints read as stored: AWQ (GEMM layout), GPTQ and
compressed-tensors pack-quantized (W4A16), each linear held as one W4G<g> QuantizedTensor
(kernels/int4.py).

Layouts (a linear of N outputs and K inputs; G = K / group groups; int32 words hold eight
4-bit values, value i at bits 4i..4i+3):

    GPTQ   qweight int32 [K/8, N]     packed along K: word [j, n] holds columns 8j..8j+7 of row n
           qzeros  int32 [G, N/8]     packed along N; the zero point is the value + 1
                                      (checkpoint_format "gptq"; "gptq_v2" stores it as is)
           scales  fp16  [G, N]
           g_idx   int32 [K]          the group of each column (act-order: not column // group)
           w[n, k] = (q - z[g_idx[k], n]) * s[g_idx[k], n]
    AWQ    qweight int32 [K, N/8]     packed along N in the order [0, 2, 4, 6, 1, 3, 5, 7]:
                                      value i of word [k, j] is row 8j + (0, 2, 4, 6, 1, 3, 5, 7)[i]
           qzeros  int32 [G, N/8]     the same packing
           scales  fp16  [G, N]
           w[n, k] = (q - z) * s
    compressed-tensors pack-quantized (int, num_bits 4)
           weight_packed      int32 [N, K/8]  packed along K, values stored as q + 8
           weight_scale       [N, G] (group) or [N, 1] (channel), the model's dtype
           weight_zero_point  int32 [N/8, G]  asymmetric only, packed along N, stored + 8
           weight_g_idx       int32 [K]       actorder "group" (older checkpoints)
           weight_shape       int64 [2]       (N, K)
           w[n, k] = (q - z) * s, q and z signed (-8..7): held as q + 8 and z + 8

Everything each tool's dequantization computes is kept exactly (float32 scales, integer zero
points), so the held weight dequantized equals the tool's own float32 dequantization bit for
bit. Options kvserve does not read are refused at load, naming them (`validate`).
"""

from __future__ import annotations

from collections.abc import Iterable, Iterator
from typing import Any

import torch

from kvserve.kernels.int4 import pack_w4_blocks
from kvserve.kernels.quant import QuantizedTensor
from kvserve.services.worker.quant_formats import compressed_tensors

INT4_METHODS = ("awq", "gptq", "compressed-tensors")
AWQ_ORDER = (0, 2, 4, 6, 1, 3, 5, 7)  # value i of an AWQ word is row 8j + AWQ_ORDER[i]

# The stored tensors of one quantized linear, by format: (required, optional) suffixes.
_PARTS = {
    "gptq": (("qweight", "qzeros", "scales"), ("g_idx",)),
    "awq": (("qweight", "qzeros", "scales"), ()),
    "compressed-tensors": (
        ("weight_packed", "weight_scale", "weight_shape"),
        ("weight_zero_point", "weight_g_idx"),
    ),
}


def _setting(qconfig: dict[str, Any], *names: str, default: Any = None) -> Any:
    for name in names:
        if name in qconfig:
            return qconfig[name]
    return default


def validate(method: str, qconfig: dict[str, Any]) -> None:
    """Refuse what a 4-bit quantization_config says that kvserve does not read."""
    if method == "compressed-tensors":
        _validate_pack_quantized(qconfig)
        return
    bits = _setting(qconfig, "bits", "w_bit")
    if bits != 4:
        raise ValueError(f"{method} checkpoints of {bits} bits are not supported (only 4-bit)")
    group = _setting(qconfig, "group_size", "q_group_size", default=-1)
    if group != -1 and (not isinstance(group, int) or group <= 0 or group % 32):
        raise ValueError(f"{method} group_size {group} is not supported (multiples of 32, or -1)")
    if method == "awq":
        version = str(qconfig.get("version", "gemm")).lower()
        if version != "gemm":
            raise ValueError(
                f"AWQ version {version!r} is not supported: kvserve reads the GEMM layout "
                "(version 'gemm')"
            )
        if not qconfig.get("zero_point", True):
            raise ValueError("AWQ without zero points (zero_point: false) is not supported")
        return
    fmt = qconfig.get("checkpoint_format", "gptq")
    if fmt not in ("gptq", "gptq_v2"):
        raise ValueError(
            f"GPTQ checkpoint_format {fmt!r} is not supported (the Marlin and other repacked "
            "layouts are GPU formats); kvserve reads 'gptq' and 'gptq_v2'"
        )
    if qconfig.get("lm_head"):
        raise ValueError("GPTQ with a quantized lm_head (lm_head: true) is not supported")
    if qconfig.get("dynamic"):
        raise ValueError("GPTQ per-module overrides (dynamic) are not supported")


def _validate_pack_quantized(qconfig: dict[str, Any]) -> None:
    if compressed_tensors.scheme_of(qconfig) != compressed_tensors.W4A16:
        raise ValueError("not a compressed-tensors W4A16 (pack-quantized) checkpoint")
    for name, group in qconfig["config_groups"].items():
        weights = group.get("weights") or {}
        what = f"compressed-tensors group {name!r}"
        if group.get("input_activations") or group.get("output_activations"):
            raise ValueError(f"{what}: quantized activations with pack-quantized weights")
        if weights.get("type", "int") != "int" or weights.get("num_bits") != 4:
            raise ValueError(
                f"{what}: {weights.get('type')} {weights.get('num_bits')}-bit weights are not "
                "supported (pack-quantized int 4-bit)"
            )
        strategy = weights.get("strategy")
        if strategy not in ("group", "channel"):
            raise ValueError(f"{what}: strategy {strategy!r} (supported: group, channel)")
        if weights.get("dynamic"):
            raise ValueError(f"{what}: dynamic weight scales")
        group_size = weights.get("group_size")
        if strategy == "group" and (not isinstance(group_size, int) or group_size % 32):
            raise ValueError(f"{what}: group_size {group_size} (multiples of 32)")
        actorder = weights.get("actorder")
        if actorder not in (None, False, "group", "weight", "static", "dynamic"):
            raise ValueError(f"{what}: actorder {actorder!r}")


# ---------------------------------------------------------------------- unpacking


def pack_w4(
    q: torch.Tensor,
    scales: torch.Tensor,
    zeros: torch.Tensor,
    group: int,
    g_idx: torch.Tensor | None = None,
) -> QuantizedTensor:
    """A weight [N, K] held as W4G blocks (kernels/int4.py `pack_w4_blocks`: q [N, K] in
    0..15, scales and zeros [N, K / group], g_idx [K] for act-order)."""
    n, k = q.shape
    qtype, data, perm = pack_w4_blocks(q, scales, zeros, group, g_idx)
    return QuantizedTensor(qtype, (n, k), data, None, perm)


def unpack_int32(packed: torch.Tensor, dim: int) -> torch.Tensor:
    """int32 words -> their eight 4-bit values (0..15) along dim, value i of word j at 8j + i."""
    if packed.dtype != torch.int32:
        raise ValueError(f"packed 4-bit values are int32, got {packed.dtype}")
    shifts = torch.arange(0, 32, 4, dtype=torch.int32)
    moved = packed.movedim(dim, -1)
    values = (moved.unsqueeze(-1) >> shifts) & 15  # [..., words, 8]
    return values.flatten(-2).movedim(-1, dim).to(torch.uint8)


def unpack_gptq(
    qweight: torch.Tensor,
    qzeros: torch.Tensor,
    scales: torch.Tensor,
    g_idx: torch.Tensor | None,
    zero_offset: int = 1,
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor, int, torch.Tensor | None]:
    """GPTQ's tensors -> (q [N, K], scales [N, G], zeros [N, G], group, g_idx [K] or None)."""
    k, n = qweight.shape[0] * 8, qweight.shape[1]
    num_groups = scales.shape[0]
    if tuple(scales.shape) != (num_groups, n) or tuple(qzeros.shape) != (num_groups, n // 8):
        raise ValueError(
            f"GPTQ qweight {tuple(qweight.shape)}, qzeros {tuple(qzeros.shape)} and scales "
            f"{tuple(scales.shape)} do not fit one [{n}, {k}] linear"
        )
    q = unpack_int32(qweight, 0).t()  # [N, K]
    zeros = unpack_int32(qzeros, 1).t().to(torch.int16) + zero_offset  # [N, G]
    return q, scales.t(), zeros, k // num_groups, g_idx


def unpack_awq(
    qweight: torch.Tensor, qzeros: torch.Tensor, scales: torch.Tensor
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor, int]:
    """AWQ's tensors -> (q [N, K], scales [N, G], zeros [N, G], group)."""
    k, n = qweight.shape[0], qweight.shape[1] * 8
    num_groups = scales.shape[0]
    if tuple(scales.shape) != (num_groups, n) or tuple(qzeros.shape) != (num_groups, n // 8):
        raise ValueError(
            f"AWQ qweight {tuple(qweight.shape)}, qzeros {tuple(qzeros.shape)} and scales "
            f"{tuple(scales.shape)} do not fit one [{n}, {k}] linear (GEMM layout)"
        )
    # value i of word j is row 8j + AWQ_ORDER[i]: reorder each run of eight to 0..7
    undo = torch.tensor([AWQ_ORDER.index(r) for r in range(8)])
    q = unpack_int32(qweight, 1).reshape(k, n // 8, 8)[..., undo].reshape(k, n).t()
    zeros = unpack_int32(qzeros, 1).reshape(num_groups, n // 8, 8)[..., undo]
    return q, scales.t(), zeros.reshape(num_groups, n).t(), k // num_groups


def unpack_pack_quantized(
    packed: torch.Tensor,
    scale: torch.Tensor,
    shape: torch.Tensor,
    zero_point: torch.Tensor | None,
    g_idx: torch.Tensor | None,
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor, int, torch.Tensor | None]:
    """compressed-tensors pack-quantized 4-bit -> (q [N, K] as q + 8, scales [N, G], zeros
    [N, G] as z + 8, group, g_idx)."""
    n, k = (int(v) for v in shape.tolist())
    if k % 8 or tuple(packed.shape) != (n, k // 8):
        raise ValueError(
            f"weight_packed {tuple(packed.shape)} does not hold a [{n}, {k}] 4-bit weight "
            "(K must be a multiple of 8)"
        )
    num_groups = scale.shape[1] if scale.dim() == 2 else 0
    if scale.dim() != 2 or scale.shape[0] != n or k % num_groups:
        raise ValueError(f"weight_scale {tuple(scale.shape)} does not fit a [{n}, {k}] weight")
    q = unpack_int32(packed, 1)
    if zero_point is None:
        zeros = torch.full((n, num_groups), 8, dtype=torch.int16)
    else:
        if tuple(zero_point.shape) != ((n + 7) // 8, num_groups):
            raise ValueError(f"weight_zero_point {tuple(zero_point.shape)} for [{n}, {k}]")
        zeros = unpack_int32(zero_point, 0)[:n].to(torch.int16)
    return q, scale, zeros, k // num_groups, g_idx


def held_weight(method: str, parts: dict[str, torch.Tensor], zero_offset: int = 1):
    """One linear's stored tensors (by suffix) -> its held QuantizedTensor [N, K]."""
    if method == "gptq":
        q, scales, zeros, group, g_idx = unpack_gptq(
            parts["qweight"], parts["qzeros"], parts["scales"], parts.get("g_idx"), zero_offset
        )
    elif method == "awq":
        q, scales, zeros, group = unpack_awq(parts["qweight"], parts["qzeros"], parts["scales"])
        g_idx = None
    else:
        q, scales, zeros, group, g_idx = unpack_pack_quantized(
            parts["weight_packed"],
            parts["weight_scale"],
            parts["weight_shape"],
            parts.get("weight_zero_point"),
            parts.get("weight_g_idx"),
        )
    return pack_w4(q, scales, zeros, group, g_idx)


def held_weights(
    method: str, qconfig: dict[str, Any], tensors: Iterable[tuple[str, torch.Tensor]]
) -> Iterator[tuple[str, torch.Tensor | QuantizedTensor]]:
    """The checkpoint stream with each quantized linear's stored tensors replaced by one
    QuantizedTensor under "<prefix>.weight" (float tensors pass through as they come; the
    quantized ones are gathered per prefix and yielded at the end of the stream)."""
    validate(method, qconfig)
    required, optional = _PARTS[method]
    suffixes = set(required) | set(optional)
    zero_offset = 0 if qconfig.get("checkpoint_format") == "gptq_v2" else 1
    pending: dict[str, dict[str, torch.Tensor]] = {}
    for name, tensor in tensors:
        prefix, _, suffix = name.rpartition(".")
        if suffix in suffixes:
            pending.setdefault(prefix, {})[suffix] = tensor
        else:
            yield name, tensor
    for prefix, parts in pending.items():
        missing = [s for s in required if s not in parts]
        if missing:
            raise ValueError(f"{method} checkpoint: {prefix} lacks {', '.join(missing)}")
        try:
            yield f"{prefix}.weight", held_weight(method, parts, zero_offset)
        except ValueError as exc:
            raise ValueError(f"{method} checkpoint, {prefix}: {exc}") from exc
