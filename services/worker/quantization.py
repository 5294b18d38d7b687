"""Weights held quantized: which method a model loads with, and the embedding/LM head that
keep GGUF blocks.

The rule (`resolve_quantization`):

    --quantization gguf    the model must be a .gguf file: its Q8_0/Q4_0/Q4_1/Q4_K tensors
                           keep their blocks, read from the file itself (other types expand
                           to float); the converted folder gives only config and tokenizer
    --quantization int8    a float checkpoint (a folder, or a .gguf's float32 expansion):
                           linear weights quantized per output channel at load
    --quantization mxfp4   a checkpoint whose config.json says quant_method mxfp4 (gpt-oss):
                           its MoE experts' MXFP4 blocks held as stored (layers/gpt_oss_moe.py);
                           the default for such a checkpoint
    --quantization compressed-tensors|fp8
                           an 8-bit checkpoint whose config.json says that quant_method
                           (quant_formats/eight_bit.py): compressed-tensors int-quantized
                           int8 weights held as stored (W8A8 with per-token activations, or
                           W8A16), float-quantized FP8 and native FP8 expanded to float at
                           load; the default for such a checkpoint
    --quantization awq|gptq|compressed-tensors
                           a 4-bit checkpoint (AWQ GEMM layout, GPTQ, compressed-tensors
                           pack-quantized W4A16) whose config.json says that quant_method: each
                           quantized linear held as W4G<g> groups (quant_formats/int4.py); the
                           default for such a checkpoint (none: each expanded to float32, the
                           equality reference)
    --quantization none    nothing held quantized: an mxfp4 checkpoint's experts expand to
                           float at load (the equality reference), a .gguf to float32
    neither                the folder's config.json `quantization_config.quant_method`, when
                           it is one we support ("int8": a float checkpoint that asks to be
                           held as int8); another quant_method is an error, not a silent
                           float load of packed weights. Without one, float: a .gguf file
                           expands to float32 (greedy-identical to HF)

Linear layers take the method from `quantization_scope` at construction (layers/linear.py);
the embedding and LM head are swapped here for `QuantizedVocabEmbedding` /
`QuantizedLMHead` under gguf, a tied head sharing the embedding's blocks.
"""

from __future__ import annotations

import json
import os
from collections.abc import Callable, Iterable, Iterator
from typing import Any, TypeVar

import torch
import torch.nn.functional as F
from torch import nn

from kvserve.kernels.quant import QuantizedTensor, quant_embedding, quant_linear
from kvserve.services.worker.layers.embed_head import ParallelLMHead, VocabParallelEmbedding
from kvserve.services.worker.layers.linear import LinearBase, set_weight_loader
from kvserve.services.worker.parallel_state import (
    tensor_model_parallel_all_gather,
    tensor_model_parallel_all_reduce,
)
from kvserve.services.worker.quant_formats import eight_bit
from kvserve.services.worker.quant_formats.int4 import INT4_METHODS

SUPPORTED_QUANT_METHODS: tuple[str, ...] = ("gguf", "int8", "mxfp4", "none")
# config.json quantization_config.quant_method values we load, and the method they mean.
_CHECKPOINT_METHODS = {"int8": "int8", "mxfp4": "mxfp4"}
# 8-bit checkpoints (quant_formats/eight_bit.py) and 4-bit ones read as stored
# (quant_formats/int4.py): the method is the quant_method. compressed-tensors is both: its
# scheme says which reader (eight_bit.handles, else int4).
SUPPORTED_QUANT_METHODS += tuple(dict.fromkeys(eight_bit.METHODS + INT4_METHODS))
_CHECKPOINT_METHODS.update({method: method for method in eight_bit.METHODS + INT4_METHODS})


def checkpoint_qconfig(model_dir: str) -> dict | None:
    """A folder's config.json quantization_config (None: none, or no readable config)."""
    try:
        with open(os.path.join(model_dir, "config.json")) as f:
            qconfig = json.load(f).get("quantization_config")
    except (OSError, ValueError):
        return None
    return qconfig if isinstance(qconfig, dict) else None


def checkpoint_quantization(model_dir: str) -> str | None:
    """The method a folder's config.json asks for (None: a float checkpoint)."""
    try:
        with open(os.path.join(model_dir, "config.json")) as f:
            qconfig = json.load(f).get("quantization_config")
    except (OSError, ValueError):
        return None
    if not qconfig:
        return None
    method = qconfig.get("quant_method") if isinstance(qconfig, dict) else None
    if method not in _CHECKPOINT_METHODS:
        raise ValueError(
            f"{model_dir}/config.json has quantization_config quant_method {method!r}, which "
            f"kvserve cannot load; supported: {sorted(_CHECKPOINT_METHODS)} (or pass a .gguf "
            "file with --quantization gguf)"
        )
    # an unsupported scheme is refused here, naming it
    if eight_bit.handles(method, qconfig):
        eight_bit.validate(method, qconfig)
    elif method in INT4_METHODS:
        from kvserve.services.worker.quant_formats.int4 import validate

        validate(method, qconfig)
    return _CHECKPOINT_METHODS[method]


def resolve_quantization(
    requested: str | None, model_arg: str | None, model_dir: str
) -> tuple[str | None, str | None]:
    """(method, gguf path to read blocks from) for the model argument and its folder."""
    detected = checkpoint_quantization(model_dir)
    if requested is None:
        return detected, None
    if requested not in SUPPORTED_QUANT_METHODS:
        raise ValueError(f"unknown quantization {requested!r}; have {SUPPORTED_QUANT_METHODS}")
    if requested == "none":
        return None, None
    if requested == "mxfp4" and detected != "mxfp4":
        raise ValueError(
            f"--quantization mxfp4 holds a checkpoint's MXFP4 expert blocks as stored; "
            f"{model_dir}/config.json has no quantization_config with quant_method mxfp4"
        )
    if requested == "mxfp4":
        return "mxfp4", None
    if requested in eight_bit.METHODS or requested in INT4_METHODS:
        if detected != requested:
            raise ValueError(
                f"--quantization {requested} reads a {requested} checkpoint as stored; "
                f"{model_dir}/config.json has quantization_config quant_method {detected!r}"
            )
        return requested, None
    if detected is not None and detected != requested:
        raise ValueError(
            f"--quantization {requested} conflicts with {model_dir}'s quantization_config "
            f"({detected})"
        )
    if requested == "int8":
        return "int8", None
    from kvserve.services.worker.model_loader import default_gguf_path

    path = default_gguf_path() if model_arg is None else os.path.abspath(model_arg)
    if not (os.path.isfile(path) and path.endswith(".gguf")):
        raise ValueError(
            f"--quantization gguf keeps a .gguf file's blocks: the model must be a .gguf "
            f"file, got {model_arg!r}"
        )
    return "gguf", path


class QuantizedVocabEmbedding(VocabParallelEmbedding):
    """An embedding whose rows stay GGUF blocks; a lookup dequantizes only the rows it reads.

    `blocks` is this rank's vocab rows (a QuantizedTensor, or float when the file's type has
    no kernel here). `weight` is an empty placeholder the loader finds by name.
    """

    def __init__(self, num_embeddings: int, embedding_dim: int):
        super().__init__(num_embeddings, embedding_dim)
        self.embedding_dim = embedding_dim
        self.weight = nn.Parameter(torch.empty(0, dtype=torch.uint8), requires_grad=False)
        set_weight_loader(self.weight, self.weight_loader)
        self.store: dict[str, QuantizedTensor | torch.Tensor] = {}  # shared with a tied head
        self.params_dtype = torch.get_default_dtype()  # the model's dtype (set while built)

    @property
    def blocks(self) -> QuantizedTensor | torch.Tensor:
        if "blocks" not in self.store:
            raise RuntimeError(f"{type(self).__name__} used before its weight was loaded")
        return self.store["blocks"]

    def weight_loader(self, param, loaded_weight, shard_id=None) -> None:
        assert shard_id is None, "the embedding has no shards"
        if loaded_weight.shape[0] != self.num_embeddings:
            raise ValueError(
                f"checkpoint vocab {loaded_weight.shape[0]} != config vocab {self.num_embeddings}"
            )
        rows = loaded_weight.narrow(0, self.vocab_start_idx, self.num_embeddings_per_partition)
        device = self.weight.device
        if isinstance(rows, QuantizedTensor):
            self.store["blocks"] = rows.to(device).contiguous()
        else:
            self.store["blocks"] = rows.to(device, self.params_dtype).contiguous()

    def weight_bytes(self) -> int:
        b = self.blocks
        return b.nbytes if isinstance(b, QuantizedTensor) else b.numel() * b.element_size()

    def _lookup(self, ids: torch.Tensor) -> torch.Tensor:
        b = self.blocks
        if isinstance(b, QuantizedTensor):
            return quant_embedding(ids, b).to(self.params_dtype)
        return F.embedding(ids, b)

    def forward(self, input_ids: torch.Tensor) -> torch.Tensor:
        if self.tp_size == 1:
            return self._lookup(input_ids)
        in_range = (input_ids >= self.vocab_start_idx) & (input_ids < self.vocab_end_idx)
        local_ids = (input_ids - self.vocab_start_idx) * in_range
        y = self._lookup(local_ids)
        y = y * in_range.unsqueeze(-1).to(y.dtype)
        return tensor_model_parallel_all_reduce(y)


class QuantizedLMHead(QuantizedVocabEmbedding, ParallelLMHead):
    """The LM head as a dequantizing matmul over the same kind of blocks."""

    def forward(self, hidden_states: torch.Tensor) -> torch.Tensor:
        b = self.blocks
        if isinstance(b, QuantizedTensor):
            logits = quant_linear(hidden_states, b)
        else:
            logits = F.linear(hidden_states, b.to(hidden_states.dtype))
        return tensor_model_parallel_all_gather(logits, dim=-1)


def _swap_embeddings(model: nn.Module) -> None:
    """Replace the float embedding and LM head by quantized ones (a tied pair shares one
    store, and one placeholder parameter, so the loader fills it once)."""
    swapped: dict[int, QuantizedVocabEmbedding] = {}  # id(old weight) -> its new embedding
    for parent in list(model.modules()):
        for child_name, child in list(parent.named_children()):
            if not isinstance(child, VocabParallelEmbedding):
                continue
            cls = {VocabParallelEmbedding: QuantizedVocabEmbedding, ParallelLMHead: QuantizedLMHead}
            new_cls = cls.get(type(child))
            if new_cls is None:
                continue
            new = new_cls(child.num_embeddings, child.weight.shape[1])
            tied = swapped.get(id(child.weight))
            if tied is not None:
                new.weight, new.store = tied.weight, tied.store
            else:
                swapped[id(child.weight)] = new
            setattr(parent, child_name, new)


_Model = TypeVar("_Model", bound=nn.Module)


def build_quantized(model_class: Callable[[Any], _Model], hf_config, method: str | None) -> _Model:
    """model_class(hf_config) with its linear layers (and under gguf the embedding and LM
    head) holding `method`'s weights. Call inside the loader's dtype/device scopes.
    model_class is any builder of a module from the config (a draft layer's too)."""
    from kvserve.services.worker.layers.linear import quantization_scope

    qconfig = getattr(hf_config, "quantization_config", None)
    if (
        method in eight_bit.METHODS
        and qconfig is not None
        and eight_bit.handles(method, _as_dict(qconfig))
        and not eight_bit.validate(method, _as_dict(qconfig)).held
    ):
        method = None  # fp8: the linears load the float expansion (quant_formats/eight_bit.py)
    with quantization_scope(method):
        model = model_class(hf_config)
    if method == "gguf":
        _swap_embeddings(model)
    return model


def _as_dict(qconfig) -> dict:
    return qconfig if isinstance(qconfig, dict) else qconfig.to_dict()


def quantized_weights(
    method: str | None, gguf_path: str | None, fallback: Iterable, model_dir: str | None = None
) -> Iterable[tuple[str, torch.Tensor | QuantizedTensor]]:
    """The checkpoint tensors to load: the .gguf's blocks under gguf, an 8-bit checkpoint's
    linears joined with their scales (quant_formats/eight_bit.py), a 4-bit checkpoint's linears
    as held QuantizedTensors (quant_formats/int4.py), else fallback."""
    qconfig = checkpoint_qconfig(model_dir) if model_dir is not None else None
    stored = qconfig.get("quant_method") if qconfig is not None else None
    if eight_bit.handles(stored, qconfig) and method in (stored, None):
        assert qconfig is not None and stored is not None
        held = eight_bit.held_weights(eight_bit.validate(stored, qconfig), fallback)
        # --quantization none: each held weight expanded to float32 (the equality reference)
        return held if method is not None else _dequantized(held)
    if stored in INT4_METHODS and method in (stored, None):
        from kvserve.services.worker.quant_formats.int4 import held_weights

        assert qconfig is not None
        held = held_weights(stored, qconfig, fallback)
        # --quantization none: each held weight expanded to float32 (the equality reference)
        return held if method is not None else _dequantized(held)
    if method == "gguf":
        from kvserve.services.worker.gguf import iterate_gguf_tensors

        assert gguf_path is not None
        return iterate_gguf_tensors(gguf_path, keep_quantized=True)
    return fallback


def _dequantized(tensors: Iterable) -> Iterator[tuple[str, torch.Tensor]]:
    for name, tensor in tensors:
        yield name, tensor.dequantize() if isinstance(tensor, QuantizedTensor) else tensor


def finish_loading(model: nn.Module) -> None:
    """Let every linear layer turn what it loaded into what it holds (int8 quantization,
    merging GGUF shards)."""
    for module in model.modules():
        if isinstance(module, LinearBase):
            module.process_weights_after_loading()


def weight_bytes(model: nn.Module) -> int:
    """Bytes of every parameter and held weight of the model, each storage counted once."""
    seen: set[int] = set()
    total = 0

    def add(t: torch.Tensor) -> None:
        nonlocal total
        key = t.untyped_storage().data_ptr()
        if t.numel() and key not in seen:
            seen.add(key)
            total += t.untyped_storage().nbytes()

    for module in model.modules():
        for p in module.parameters(recurse=False):
            add(p)
        parts: Iterator = iter(getattr(module, "quant_parts", []) or [])
        held = [p for _, p in parts]
        if isinstance(module, QuantizedVocabEmbedding) and "blocks" in module.store:
            held.append(module.store["blocks"])
        for h in held:
            if isinstance(h, QuantizedTensor):
                add(h.data)
                if h.scales is not None:
                    add(h.scales)
                if h.perm is not None:
                    add(h.perm)
            else:
                add(h)
    return total
