"""8-bit checkpoints: compressed-tensors int-quantized / float-quantized (llm-compressor's
W8A8, W8A16, FP8, FP8_DYNAMIC) and native FP8 (`quant_method: fp8`, as transformers'
FineGrainedFP8 and DeepSeek write it).

What each becomes (the checkpoint tensors of one quantized linear -> one tensor under
"<prefix>.weight", [N, K]):

    int8 weights, per-channel or per-tensor `weight_scale`
        dynamic per-token int8 activations (W8A8)  -> QuantizedTensor("W8A8"): int8 held,
                                                      kernels/w8a8.py's per-token int8 GEMM
                                                      or the I8 VNNI kernel, by measurement
        no input activations (W8A16)               -> QuantizedTensor("I8")
    fp8 e4m3 weights (compressed-tensors `weight_scale` per tensor / channel / block, or
    native `weight_scale_inv` per tensor / channel / block of `weight_block_size`)
                                                   -> the float expansion q * scale in the
                                                      model's dtype (this CPU has no fp8
                                                      arithmetic: bfloat16 runs on AMX tiles);
                                                      activations are not quantized, so a
                                                      static `input_scale` is read and unused

Layers the checkpoint leaves float (its `ignore` / `ignored_layers` list, the LM head) arrive
as float tensors and stay float. Everything else a config can say is refused at load by
`validate`, naming it: int8 static (`input_scale`) or asymmetric activations, group / block
int8 weights, asymmetric weights (`weight_zero_point`), other bit widths, output-activation or
KV-cache schemes, sparsity, transforms, other compressed-tensors formats.
"""

from __future__ import annotations

from collections.abc import Iterable, Iterator
from dataclasses import dataclass
from typing import Any

import torch

from kvserve.kernels.quant import QuantizedTensor

METHODS = ("compressed-tensors", "fp8")
_CT_FORMATS = ("int-quantized", "float-quantized")
_SCALE_SUFFIXES = ("weight_scale", "weight_scale_inv")
_DROPPED_SUFFIXES = ("input_scale",)  # static activation scales of fp8 (unused: see above)


@dataclass(frozen=True)
class Scheme:
    """What validate() found. weights: "int8" or "fp8"; activations: "token" (dynamic
    per-token int8), "none" (weight-only) or "float" (fp8 activations, run unquantized)."""

    weights: str
    activations: str
    block: tuple[int, int] | None = None  # native fp8 weight_block_size

    @property
    def held(self) -> bool:
        """Whether linears hold a QuantizedTensor (int8); else they load a float expansion."""
        return self.weights == "int8"


def handles(method: str | None, qconfig: dict[str, Any] | None) -> bool:
    """Whether this module reads the checkpoint (fp8, or compressed-tensors whose formats are
    the 8-bit ones; another compressed-tensors format belongs to another reader)."""
    if method == "fp8":
        return True
    if method != "compressed-tensors" or not qconfig:
        return False
    formats = {g.get("format") or qconfig.get("format") for g in _groups(qconfig).values()}
    return bool(formats) and formats <= set(_CT_FORMATS)


def validate(method: str, qconfig: dict[str, Any]) -> Scheme:
    """The scheme of an 8-bit quantization_config; ValueError naming anything unsupported."""
    if method == "fp8":
        return _validate_native_fp8(qconfig)
    return _validate_compressed_tensors(qconfig)


def _refuse(what: str) -> ValueError:
    return ValueError(f"{what} is not supported by kvserve's 8-bit checkpoint reader")


def _groups(qconfig: dict[str, Any]) -> dict[str, Any]:
    groups = qconfig.get("config_groups") or {}
    if not isinstance(groups, dict) or not groups:
        raise ValueError("compressed-tensors quantization_config has no config_groups")
    return groups


def _validate_native_fp8(qconfig: dict[str, Any]) -> Scheme:
    fmt = qconfig.get("fmt", "e4m3")
    if fmt != "e4m3":
        raise _refuse(f"native fp8 fmt {fmt!r} (only e4m3)")
    activation = qconfig.get("activation_scheme", "dynamic")
    if activation not in ("dynamic", "static"):
        raise _refuse(f"native fp8 activation_scheme {activation!r}")
    block = qconfig.get("weight_block_size")
    if block is not None:
        if not (isinstance(block, list | tuple) and len(block) == 2 and all(b > 0 for b in block)):
            raise _refuse(f"native fp8 weight_block_size {block!r} (need [rows, cols])")
        block = (int(block[0]), int(block[1]))
    return Scheme("fp8", "float", block)


def _validate_compressed_tensors(qconfig: dict[str, Any]) -> Scheme:
    for key in ("kv_cache_scheme", "sparsity_config", "transform_config"):
        if qconfig.get(key):
            raise _refuse(f"compressed-tensors {key} {qconfig[key]!r}")
    schemes = {
        _group_scheme(name, g, qconfig.get("format")) for name, g in _groups(qconfig).items()
    }
    if len(schemes) != 1:
        raise _refuse(f"compressed-tensors config groups of different schemes {sorted(schemes)}")
    weights, activations = schemes.pop()
    return Scheme(weights, activations)


def _group_scheme(name: str, group: dict[str, Any], fmt: str | None) -> tuple[str, str]:
    fmt = group.get("format") or fmt
    if fmt not in _CT_FORMATS:
        raise _refuse(f"compressed-tensors format {fmt!r} (group {name}); 8-bit: {_CT_FORMATS}")
    if group.get("output_activations"):
        raise _refuse(f"compressed-tensors output_activations (group {name})")
    w = group.get("weights") or {}
    kind = "int" if fmt == "int-quantized" else "float"
    if w.get("num_bits") != 8 or w.get("type", kind) != kind:
        raise _refuse(f"{w.get('num_bits')}-bit {w.get('type')} weights in format {fmt!r}")
    if not w.get("symmetric", True):
        raise _refuse(f"asymmetric weights (weight_zero_point, group {name})")
    if w.get("dynamic"):
        raise _refuse(f"dynamic weight quantization (group {name})")
    strategies = ("channel", "tensor") if kind == "int" else ("channel", "tensor", "block")
    if w.get("strategy") not in strategies:
        raise _refuse(
            f"{kind}8 weight strategy {w.get('strategy')!r} (group {name}); have {strategies}"
        )
    a = group.get("input_activations")
    if kind == "float":  # fp8: weights expanded, activations not quantized (module doc)
        if a and (a.get("num_bits") != 8 or a.get("type", "float") != "float"):
            raise _refuse(f"fp8 weights with {a.get('num_bits')}-bit {a.get('type')} activations")
        return "fp8", "float"
    if not a:
        return "int8", "none"
    if a.get("num_bits") != 8 or a.get("type", "int") != "int":
        raise _refuse(f"int8 weights with {a.get('num_bits')}-bit {a.get('type')} activations")
    if not a.get("symmetric", True):
        raise _refuse(f"asymmetric int8 activations (input_zero_point, group {name})")
    if not a.get("dynamic") or a.get("strategy") != "token":
        raise _refuse(
            f"int8 activations with strategy {a.get('strategy')!r}, dynamic "
            f"{a.get('dynamic')!r} (group {name}: a static input_scale); kvserve runs "
            "dynamic per-token int8 activations"
        )
    return "int8", "token"


# ---------------------------------------------------------------------- the tensor stream


def held_weights(
    scheme: Scheme, tensors: Iterable[tuple[str, torch.Tensor]]
) -> Iterator[tuple[str, torch.Tensor | QuantizedTensor]]:
    """The checkpoint stream with each quantized linear's (weight, scale) pair joined into one
    "<prefix>.weight": a QuantizedTensor (int8) or its float32 expansion (fp8); float
    tensors pass through. A quantized weight whose scale never comes is an error."""
    pending: dict[str, dict[str, torch.Tensor]] = {}
    for name, tensor in tensors:
        prefix, _, suffix = name.rpartition(".")
        if suffix in _DROPPED_SUFFIXES:
            continue
        if suffix in ("weight_zero_point", "input_zero_point"):
            raise _refuse(f"{name} (asymmetric quantization)")
        quantized_weight = suffix == "weight" and tensor.dtype in (torch.int8, torch.float8_e4m3fn)
        if not quantized_weight and suffix not in _SCALE_SUFFIXES:
            yield name, tensor
            continue
        parts = pending.setdefault(prefix, {})
        parts[suffix] = tensor
        scale = next((parts[s] for s in _SCALE_SUFFIXES if s in parts), None)
        if "weight" in parts and scale is not None:
            del pending[prefix]
            yield f"{prefix}.weight", _join(f"{prefix}.weight", scheme, parts["weight"], scale)
    if pending:
        prefix, parts = next(iter(pending.items()))
        lacks = "its weight_scale" if "weight" in parts else "its quantized weight"
        raise ValueError(f"{prefix}: the checkpoint lacks {lacks} ({len(pending)} such layers)")


def _join(name: str, scheme: Scheme, weight: torch.Tensor, scale: torch.Tensor):
    n, k = weight.shape
    scale = scale.float()
    if weight.dtype == torch.int8:
        if scheme.weights != "int8":
            raise ValueError(f"{name} is int8 in a {scheme.weights} checkpoint")
        rows = _row_scales(name, scale, n)
        qtype = "W8A8" if scheme.activations == "token" else "I8"
        return QuantizedTensor(qtype, (n, k), weight.view(torch.uint8).contiguous(), rows)
    if scheme.weights != "fp8":
        raise ValueError(f"{name} is {weight.dtype} in an {scheme.weights} checkpoint")
    return weight.float() * _expanded_scale(name, scale, n, k, scheme.block)


def _row_scales(name: str, scale: torch.Tensor, n: int) -> torch.Tensor:
    """A per-channel ([N] / [N, 1]) or per-tensor ([] / [1]) scale as float32 [N]."""
    if scale.numel() == 1:
        return scale.reshape(1).expand(n).contiguous()
    if scale.numel() == n:
        return scale.reshape(n).contiguous()
    raise ValueError(f"{name}: scale of shape {tuple(scale.shape)} for {n} output channels")


def _expanded_scale(
    name: str, scale: torch.Tensor, n: int, k: int, block: tuple[int, int] | None
) -> torch.Tensor:
    """The scale broadcast to the weight: per tensor, per channel, or per [bn, bk] block
    (native weight_block_size, or a compressed-tensors block scale [ceil(N/bn), ceil(K/bk)])."""
    if scale.numel() in (1, n) and scale.dim() <= 2 and (scale.dim() < 2 or scale.shape[1] == 1):
        return _row_scales(name, scale, n)[:, None]
    if scale.dim() != 2:
        raise ValueError(f"{name}: scale of shape {tuple(scale.shape)} for a [{n}, {k}] weight")
    if block is None:  # compressed-tensors block strategy: the block size from the shapes
        block = (-(-n // scale.shape[0]), -(-k // scale.shape[1]))
    bn, bk = block
    if tuple(scale.shape) != (-(-n // bn), -(-k // bk)):
        raise ValueError(
            f"{name}: block scale {tuple(scale.shape)} does not tile a [{n}, {k}] weight in "
            f"[{bn}, {bk}] blocks"
        )
    return scale.repeat_interleave(bn, 0)[:n].repeat_interleave(bk, 1)[:, :k]
