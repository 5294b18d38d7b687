"""Paged attention layer and the per-step metadata every attention layer reads.

All scheduled tokens of all requests are laid end to end (no padding). For two requests, one
decoding 1 token with 6 in context and one prefilling 3 tokens from scratch, block_size 4:

    tokens:           | r0: 1 |  r1: 3  |
    query_start_loc:  [0, 1, 4]
    seq_lens:         [6, 3]
    block_table:      [[2, 5], [7, 0]]        (row padding is never read)
    slot_mapping:     [5*4+1, 7*4+0, 7*4+1, 7*4+2]
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import TYPE_CHECKING

import torch
from torch import nn

from kvserve import kernels
from kvserve.kernels import host_memory
from kvserve.services.worker.layers.linear import set_weight_loader
from kvserve.services.worker.parallel_state import get_tp_rank

if TYPE_CHECKING:
    from kvserve.services.worker.layers.rotary_embedding import RotaryEmbedding


@dataclass(frozen=True, slots=True)
class KVCacheSpec:
    """One layer's paged-cache layout: `num_planes` planes of [block_size, num_kv_heads,
    head_size] per block. Full attention keeps K and V (2 planes of Hkv heads); multi-head
    latent attention keeps one plane of one "head", the latent and the rope key
    (layers/mla_attention.py). The cache tensor is [num_planes, num_blocks, block_size,
    num_kv_heads, head_size]; the KV store moves blocks of any spec (KvFingerprint.num_planes).
    """

    num_planes: int
    num_kv_heads: int
    head_size: int

    def block_bytes(self, block_size: int, dtype: torch.dtype) -> int:
        element_size = torch.empty((), dtype=dtype).element_size()
        return self.num_planes * block_size * self.num_kv_heads * self.head_size * element_size

    def allocate(
        self, num_blocks: int, block_size: int, dtype: torch.dtype, device: torch.device | str
    ) -> torch.Tensor:
        """The zeroed cache; on the CPU on huge pages where the OS grants them (its blocks are
        read in scattered 12 KB pieces: kernels/host_memory.py)."""
        shape = (self.num_planes, num_blocks, block_size, self.num_kv_heads, self.head_size)
        return host_memory.zeros(shape, dtype, device)


@dataclass(slots=True)
class AttentionMetadata:
    """Where this step's tokens sit in the paged KV cache.

    Args:
        query_start_loc: [R+1] int32, cumulative query lengths (request r owns tokens
            query_start_loc[r]:query_start_loc[r+1]).
        seq_lens: [R] int32, context length after this step.
        block_table: [R, max_blocks] int32, the KV blocks of each request in order.
        slot_mapping: [T] int64, cache slot (block_id * block_size + offset) of each token;
            a slot < 0 is not written.
        max_query_len: host-side max of the query lengths.
        max_seq_len: host-side max of seq_lens.
        group_tables: (block_table, slot_mapping) of KV cache groups 1.. (shared/
            kv_cache_groups.py), where the model has several; block_table and slot_mapping
            above are group 0's.
    """

    query_start_loc: torch.Tensor  # [R+1] int32
    seq_lens: torch.Tensor  # [R] int32, context length after this step
    block_table: torch.Tensor  # [R, max_blocks] int32
    slot_mapping: torch.Tensor  # [T] int64
    max_query_len: int
    max_seq_len: int
    group_tables: list[tuple[torch.Tensor, torch.Tensor]] | None = None

    def tables_of_group(self, group: int) -> tuple[torch.Tensor, torch.Tensor]:
        """(block_table, slot_mapping) of KV cache group `group`."""
        if group == 0:
            return self.block_table, self.slot_mapping
        assert self.group_tables is not None, "this step carries one KV cache group"
        return self.group_tables[group - 1]


class Attention(nn.Module):
    """Writes this step's K/V into the paged cache, then attends over it.

    Args:
        num_heads: query heads on this rank.
        head_size: features per head (D).
        scale: softmax scale, usually D ** -0.5.
        num_kv_heads: key/value heads on this rank (num_heads must be a multiple).
        sliding_window: attend to only the last this many positions (None: all).
        logits_soft_cap: scores become cap * tanh(score / cap) before the softmax (None: off).
        attention_chunk_size: a token attends only to the tokens of its own chunk of this many
            positions (Llama 4's chunked local attention; None: off).
        sinks: a learned logit per query head joins each softmax's denominator (gpt-oss): the
            layer then holds `sinks` [num_heads] float32, this rank's heads of the
            checkpoint's [total heads].

    `kv_cache` is [2, num_blocks, block_size, num_kv_heads, D] (keys, then values), bound by
    the model runner after it sizes the cache; None before that. `kv_cache_group` is the KV
    cache group whose block table the layer reads (0 unless the model has several). An fp8
    cache (--kv-cache-dtype) holds K / k_scale and V / v_scale: the per-tensor scales of this
    layer, the checkpoint's where it has them (services/worker/kv_scales.py), else 1.0.
    """

    def __init__(
        self,
        num_heads: int,
        head_size: int,
        scale: float,
        num_kv_heads: int,
        sliding_window: int | None = None,
        logits_soft_cap: float | None = None,
        attention_chunk_size: int | None = None,
        sinks: bool = False,
    ):
        super().__init__()
        assert num_heads % num_kv_heads == 0, "query heads must be a multiple of KV heads"
        self.num_heads = num_heads
        self.head_size = head_size
        self.scale = scale
        self.num_kv_heads = num_kv_heads
        self.sliding_window = sliding_window
        self.logits_soft_cap = logits_soft_cap
        self.attention_chunk_size = attention_chunk_size
        self.sinks: nn.Parameter | None = None
        if sinks:
            self.sinks = nn.Parameter(
                torch.empty(num_heads, dtype=torch.float32), requires_grad=False
            )
            set_weight_loader(self.sinks, self._load_sinks)
        self.kv_cache: torch.Tensor | None = None
        self.kv_cache_group = 0
        self.k_scale = 1.0  # an fp8 cache's scales (floats: read on the host each step)
        self.v_scale = 1.0

    def kv_cache_spec(self) -> KVCacheSpec:
        """The layout of this layer's cache: K and V planes (subclasses may differ)."""
        return KVCacheSpec(2, self.num_kv_heads, self.head_size)

    def _load_sinks(self, param: nn.Parameter, loaded_weight: torch.Tensor) -> None:
        # Per query head: this rank's heads, as the q projection's columns split.
        start = get_tp_rank() * self.num_heads
        if loaded_weight.shape[0] < start + self.num_heads:
            raise ValueError(f"sinks of {loaded_weight.shape[0]} heads; this rank needs "
                             f"[{start}, {start + self.num_heads})")  # fmt: skip
        param.data.copy_(loaded_weight.narrow(0, start, self.num_heads))

    def forward(
        self,
        q: torch.Tensor,
        k: torch.Tensor,
        v: torch.Tensor,
        attn_metadata: AttentionMetadata,
        rotary: RotaryEmbedding | None = None,
        positions: torch.Tensor | None = None,
    ) -> torch.Tensor:
        """q: [T, Hq * D]; k, v: [T, Hkv * D]. Returns [T, Hq * D].

        With `rotary` (and the tokens' `positions`), q and k are rotated first: together
        with the KV-cache write, in one pass where the kernel can (the rotated keys then
        exist only in the cache).
        """
        num_tokens = q.shape[0]
        if rotary is not None and self.kv_cache is None:
            q, k = rotary(positions, q, k)
        if self.kv_cache is None:
            out = self._attend_without_cache(
                q.view(num_tokens, self.num_heads, self.head_size),
                k.view(num_tokens, self.num_kv_heads, self.head_size),
                v.view(num_tokens, self.num_kv_heads, self.head_size),
                attn_metadata,
            )
        else:
            block_table, slot_mapping = attn_metadata.tables_of_group(self.kv_cache_group)
            q = self._write_kv_cache(q, k, v, slot_mapping, rotary, positions)
            out = self._paged_attention(
                q.view(num_tokens, self.num_heads, self.head_size), block_table, attn_metadata
            )
        return out.view(num_tokens, self.num_heads * self.head_size)

    def _write_kv_cache(
        self,
        q: torch.Tensor,
        k: torch.Tensor,
        v: torch.Tensor,
        slot_mapping: torch.Tensor,
        rotary: RotaryEmbedding | None,
        positions: torch.Tensor | None,
    ) -> torch.Tensor:
        """Write the step's keys and values into the cache slots; with `rotary`, rotate q
        and k in the same pass. Returns q (rotated where `rotary` is given)."""
        num_tokens = q.shape[0]
        assert self.kv_cache is not None
        key_cache, value_cache = self.kv_cache[0], self.kv_cache[1]
        if rotary is not None:
            assert positions is not None, "rotary needs the tokens' positions"
            return kernels.rotary_write_kv_cache(
                positions,
                q,
                k,
                v,
                rotary.cos_sin_cache,
                self.head_size,
                key_cache,
                value_cache,
                slot_mapping,
                self.k_scale,
                self.v_scale,
            )
        kernels.write_kv_cache(
            k.view(num_tokens, self.num_kv_heads, self.head_size),
            v.view(num_tokens, self.num_kv_heads, self.head_size),
            key_cache,
            value_cache,
            slot_mapping,
            self.k_scale,
            self.v_scale,
        )
        return q

    def _paged_attention(
        self, query: torch.Tensor, block_table: torch.Tensor, attn_metadata: AttentionMetadata
    ) -> torch.Tensor:
        """query [T, Hq, D] over the cache, through this layer's block table."""
        assert self.kv_cache is not None
        return kernels.paged_attention(
            query,
            self.kv_cache[0],
            self.kv_cache[1],
            block_table,
            attn_metadata.query_start_loc,
            attn_metadata.seq_lens,
            self.scale,
            attn_metadata.max_query_len,
            attn_metadata.max_seq_len,
            self.sliding_window,
            self.logits_soft_cap,
            self.attention_chunk_size,
            self.sinks,
            k_scale=self.k_scale,
            v_scale=self.v_scale,
        )

    def _attend_without_cache(
        self, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, attn_metadata: AttentionMetadata
    ) -> torch.Tensor:
        """Prompt-only attention before a cache exists (the runner's memory-profile run).

        Treats this step's own K/V as a cache of block_size 1: token t is block t, so request
        r's block-table row is query_start_loc[r] + [0, 1, ...]. Only valid when every
        request starts at position 0 (seq_lens == query lengths).
        """
        query_start_loc = attn_metadata.query_start_loc
        query_lens = query_start_loc[1:] - query_start_loc[:-1]
        offsets = torch.arange(attn_metadata.max_query_len, device=q.device, dtype=torch.int32)
        block_table = (query_start_loc[:-1, None] + offsets[None, :]).clamp_(max=q.shape[0] - 1)
        # The kernels want K and V in one layout; views of the fused QKV output (or a rotated
        # K beside an unrotated V) need not share strides.
        return kernels.paged_attention(
            q,
            k.contiguous().unsqueeze(1),
            v.contiguous().unsqueeze(1),
            block_table,
            query_start_loc,
            query_lens.to(torch.int32),
            self.scale,
            attn_metadata.max_query_len,
            attn_metadata.max_query_len,
            self.sliding_window,
            self.logits_soft_cap,
            self.attention_chunk_size,
            self.sinks,
        )


def kv_cache_bytes_per_block(layers: list[Attention], block_size: int, dtype: torch.dtype) -> int:
    """Bytes of one KV block over `layers`: block_size tokens of each layer's cache spec."""
    return sum(layer.kv_cache_spec().block_bytes(block_size, dtype) for layer in layers)


def bind_kv_caches(
    layers: list[Attention],
    num_blocks: int,
    block_size: int,
    dtype: torch.dtype,
    device: torch.device | str,
) -> list[torch.Tensor]:
    """Allocate a paged cache per layer as its spec says ([2, num_blocks, block_size, Hkv, D]
    for full attention), bind each to its layer (`layer.kv_cache`) and return them in order."""
    caches = []
    for layer in layers:
        layer.kv_cache = layer.kv_cache_spec().allocate(num_blocks, block_size, dtype, device)
        caches.append(layer.kv_cache)
    return caches
