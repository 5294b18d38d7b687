"""Multi-head latent attention (DeepSeek-V2/V3) over a paged cache of latents.

Per token the cache keeps what MLA compresses K and V into: the normalized latent c
(kv_lora_rank L) and the rotated rope key k_pe (qk_rope_head_dim R), one row of L + R, shared
by every head. A full-attention cache of the same model would hold H x (Dn + R + Dv) per
token (H heads, nope / rope / value dims): DeepSeek-V2-Lite's 576 values against 5,120.

Every head's key and value are linear in c (kv_b_proj = [W_UK_h ; W_UV_h] per head):

    k_h = [W_UK_h c ; k_pe],  v_h = W_UV_h c
    q_h . k_h = (W_UK_h^T q_nope_h) . c + q_pe_h . k_pe      (q_nope absorbed into W_UK)
    sum_s p_s v_h(s) = W_UV_h (sum_s p_s c(s))                (the output through W_UV)

so attention can run directly over the latent rows (the absorbed path): queries
[W_UK_h^T q_nope_h ; q_pe_h] of L + R, one shared key/value "head" of L + R (multi-query
attention), the first L features of the output taken through W_UV. That is the
paged_attention kernel every other model uses (torch reference, CPU C kernel, Triton), with
the cache's one plane passed as both key and value cache: the value's last R features (the
rope key) are computed and dropped. Decodes, chunks behind a long context and mixed steps
take it.

A step of fresh prompts expands instead (the naive path): its context rows go through
kv_b_proj to per-head K (Dn + R) and V (Dv), and attention runs per head at Dn + R rather
than L + R. Expanding costs L x (Dn + Dv) per context row and head; attending saves
2 x (L + R - Dn - R) per (query, key) pair and head; so it pays once a request brings more
than L (Dn + Dv) / (2 (L - Dn)) new tokens on average (171 for DeepSeek's 512 / 128 / 128),
and it is taken only when the gathered context is little more than the step's own tokens
(no long cached prefix to expand again, and no more memory than the profile run's prompts).
Either way the cache holds only latent rows, so a prefix-cache hit or a KV-store load is
just latent rows in blocks.
"""

from __future__ import annotations

import torch

from kvserve import kernels
from kvserve.services.worker.layers.attention import Attention, AttentionMetadata, KVCacheSpec


class MLAAttention(Attention):
    """Writes this step's latent + rope key rows into the paged cache, then attends over it.

    Args:
        num_heads: query heads on this rank (the latent is the same on every rank).
        kv_lora_rank: L, features of the latent.
        qk_nope_head_dim: Dn, each head's key features outside RoPE.
        qk_rope_head_dim: R, features of the rope key (and of each head's rope query).
        v_head_dim: Dv, each head's value features.
        scale: softmax scale of the full q . k ((Dn + R) ** -0.5, YaRN's mscale folded in).

    `kv_cache` is [1, num_blocks, block_size, 1, L + R] (one plane of one shared "head"),
    bound by the model runner; `latent_cache` is its [num_blocks, block_size, L + R] view.
    `expand_min_tokens_per_request`: the new tokens per request from which a step of fresh
    prompts takes the naive path (module docstring).
    """

    def __init__(
        self,
        num_heads: int,
        kv_lora_rank: int,
        qk_nope_head_dim: int,
        qk_rope_head_dim: int,
        v_head_dim: int,
        scale: float,
    ):
        super().__init__(num_heads, kv_lora_rank + qk_rope_head_dim, scale, num_kv_heads=1)
        self.kv_lora_rank = kv_lora_rank
        self.qk_nope_head_dim = qk_nope_head_dim
        self.qk_rope_head_dim = qk_rope_head_dim
        self.v_head_dim = v_head_dim
        saved_per_pair = 2 * (kv_lora_rank - qk_nope_head_dim)
        expansion = kv_lora_rank * (qk_nope_head_dim + v_head_dim)
        self.expand_min_tokens_per_request = (
            expansion / saved_per_pair if saved_per_pair > 0 else float("inf")
        )

    def kv_cache_spec(self) -> KVCacheSpec:
        return KVCacheSpec(1, 1, self.kv_lora_rank + self.qk_rope_head_dim)

    @property
    def latent_cache(self) -> torch.Tensor:
        cache = self.kv_cache
        assert cache is not None, "the model runner binds the cache first"
        assert cache.shape[0] == 1 and cache.shape[3] == 1, f"not a latent cache: {cache.shape}"
        return cache[0, :, :, 0]

    def expands(self, attn_metadata: AttentionMetadata, num_tokens: int) -> bool:
        """Whether this step takes the naive path; host-side sizes only (no device sync)."""
        md = attn_metadata
        num_reqs = md.seq_lens.shape[0]
        if md.max_query_len <= 1 or num_tokens < self.expand_min_tokens_per_request * num_reqs:
            return False
        if self.kv_cache is None:
            return True
        block_size = self.kv_cache.shape[2]
        padded_rows = num_reqs * -(-md.max_seq_len // block_size) * block_size
        return padded_rows <= num_tokens + num_reqs * block_size

    def forward_mla(
        self,
        q_nope: torch.Tensor,
        q_pe: torch.Tensor,
        latent: torch.Tensor,
        k_pe: torch.Tensor,
        w_uk: torch.Tensor,
        w_uv: torch.Tensor,
        attn_metadata: AttentionMetadata,
    ) -> torch.Tensor:
        """Write this step's rows, then attend by the cheaper path.

        q_nope: [T, H, Dn]; q_pe: [T, H, R] rotated; latent: [T, L] normalized; k_pe: [T, R]
        rotated; w_uk: [H, Dn, L] and w_uv: [H, Dv, L], kv_b_proj's rows. Returns [T, H * Dv].
        """
        num_tokens = q_nope.shape[0]
        rows = torch.cat((latent, k_pe), dim=-1)  # [T, L + R]
        if self.kv_cache is not None:
            paged = self.latent_cache.unsqueeze(2)  # [num_blocks, block_size, 1, L + R]
            # The K/V write kernel with the one plane as both caches (slots < 0 skipped).
            row_heads = rows.to(paged.dtype).unsqueeze(1)
            kernels.write_kv_cache(row_heads, row_heads, paged, paged, attn_metadata.slot_mapping)
        if self.expands(attn_metadata, num_tokens):
            out = self._attend_expanded(q_nope, q_pe, rows, w_uk, w_uv, attn_metadata)
        else:
            out = self._attend_absorbed(q_nope, q_pe, rows, w_uk, w_uv, attn_metadata)
        return out.reshape(num_tokens, -1)

    def _attend_absorbed(self, q_nope, q_pe, rows, w_uk, w_uv, attn_metadata) -> torch.Tensor:
        """Multi-query attention over the latent rows; [T, H, Dv]."""
        q_latent = torch.einsum("thd,hdl->thl", q_nope, w_uk.to(q_nope.dtype))
        query = torch.cat((q_latent, q_pe), dim=-1)  # [T, H, L + R]
        if self.kv_cache is None:  # the memory-profile run: this step's rows are the cache
            kv = rows.unsqueeze(1)
            out = self._attend_without_cache(query, kv, kv, attn_metadata)
        else:
            paged = self.latent_cache.unsqueeze(2)
            md = attn_metadata
            out = kernels.paged_attention(
                query.to(paged.dtype), paged, paged, md.block_table, md.query_start_loc,
                md.seq_lens, self.scale, md.max_query_len, md.max_seq_len,
            )  # fmt: skip
        out_latent = out[..., : self.kv_lora_rank]  # [T, H, L]
        return torch.einsum("thl,hvl->thv", out_latent, w_uv.to(out_latent.dtype))

    def _attend_expanded(self, q_nope, q_pe, rows, w_uk, w_uv, attn_metadata) -> torch.Tensor:
        """Per-head attention over the context expanded to K and V; [T, H, Dv].

        The context rows sit end to end as a cache of block size 1: each request's context
        padded to whole blocks ([R * P] rows), or this step's own rows before the cache exists
        (every request then starts at position 0)."""
        md = attn_metadata
        if self.kv_cache is None:
            context, block_table = rows, _own_rows_table(md, rows.shape[0])
        else:
            cache = self.latent_cache  # [num_blocks, block_size, L + R]
            num_blocks, block_size = cache.shape[:2]
            width = -(-md.max_seq_len // block_size)
            blocks = md.block_table[:, :width].clamp(0, num_blocks - 1).long()
            context = cache[blocks].reshape(-1, cache.shape[-1])  # [R * P, L + R]
            padded = width * block_size
            starts = torch.arange(blocks.shape[0], device=cache.device) * padded
            offsets = torch.arange(padded, device=cache.device)
            block_table = (starts[:, None] + offsets[None, :]).to(torch.int32)
        c, k_pe = context.split([self.kv_lora_rank, self.qk_rope_head_dim], dim=-1)
        c = c.to(q_nope.dtype)
        k_nope = torch.einsum("nl,hdl->nhd", c, w_uk.to(c.dtype))
        value = torch.einsum("nl,hvl->nhv", c, w_uv.to(c.dtype))
        num_heads = k_nope.shape[1]
        key = torch.cat((k_nope, k_pe.to(c.dtype)[:, None].expand(-1, num_heads, -1)), dim=-1)
        query = torch.cat((q_nope, q_pe), dim=-1)
        head_size = max(key.shape[-1], self.v_head_dim)  # the kernel takes one head size
        key, query = _pad_to(key, head_size), _pad_to(query, head_size)
        value = _pad_to(value, head_size)
        out = kernels.paged_attention(
            query, key.unsqueeze(1), value.unsqueeze(1), block_table, md.query_start_loc,
            md.seq_lens, self.scale, md.max_query_len, md.max_seq_len,
        )  # fmt: skip
        return out[..., : self.v_head_dim]


def _own_rows_table(attn_metadata: AttentionMetadata, num_rows: int) -> torch.Tensor:
    """Request r's rows query_start_loc[r] + [0, 1, ...] (Attention._attend_without_cache)."""
    query_start_loc = attn_metadata.query_start_loc
    offsets = torch.arange(
        attn_metadata.max_query_len, device=query_start_loc.device, dtype=torch.int32
    )
    return (query_start_loc[:-1, None] + offsets[None, :]).clamp_(max=num_rows - 1)


def _pad_to(x: torch.Tensor, size: int) -> torch.Tensor:
    """x with zeros after its last dim up to size (zeros change no dot product)."""
    extra = size - x.shape[-1]
    return torch.nn.functional.pad(x, (0, extra)) if extra else x.contiguous()
