"""Multi-head latent attention (DeepSeek-V2/V3) over a paged cache of latents.

Per token the cache keeps what MLA compresses K and V into: the normalized latent c
(kv_lora_rank L) and the rotated rope key k_pe (qk_rope_head_dim R), one row of L + R, shared
by every head. A full-attention cache of the same model would hold H x (Dn + R + Dv) per
token (H heads, nope / rope / value dims): DeepSeek-V2-Lite's 576 values against 5,120.

Every head's key and value are linear in c (kv_b_proj = [W_UK_h ; W_UV_h] per head):

    k_h = [W_UK_h c ; k_pe],  v_h = W_UV_h c
    q_h . k_h = (W_UK_h^T q_nope_h) . c + q_pe_h . k_pe      (q_nope absorbed into W_UK)
    sum_s p_s v_h(s) = W_UV_h (sum_s p_s c(s))                (the output through W_UV)

so attention runs directly over the latent rows: queries [W_UK_h^T q_nope_h ; q_pe_h] of
L + R, one shared key/value "head" of L + R (multi-query attention), the first L features of
the output taken through W_UV. That is the paged_attention kernel every other model uses
(torch reference, CPU C kernel, Triton), with the cache's one plane passed as both key and
value cache: the value's last R features (the rope key) are computed and dropped. The same
path serves prefills, chunks and decodes, so a prefix-cache hit or a KV-store load is just
latent rows in blocks.
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
        qk_rope_head_dim: R, features of the rope key (and of each head's rope query).
        scale: softmax scale of the full q . k (qk_head_dim ** -0.5, YaRN's mscale folded in).

    `kv_cache` is [1, num_blocks, block_size, 1, L + R] (one plane of one shared "head"),
    bound by the model runner; `latent_cache` is its [num_blocks, block_size, L + R] view.
    """

    def __init__(self, num_heads: int, kv_lora_rank: int, qk_rope_head_dim: int, scale: float):
        super().__init__(num_heads, kv_lora_rank + qk_rope_head_dim, scale, num_kv_heads=1)
        self.kv_lora_rank = kv_lora_rank
        self.qk_rope_head_dim = qk_rope_head_dim

    def kv_cache_spec(self) -> KVCacheSpec:
        return KVCacheSpec(1, 1, self.kv_lora_rank + self.qk_rope_head_dim)

    @property
    def latent_cache(self) -> torch.Tensor:
        cache = self.kv_cache
        assert cache is not None, "the model runner binds the cache first"
        assert cache.shape[0] == 1 and cache.shape[3] == 1, f"not a latent cache: {cache.shape}"
        return cache[0, :, :, 0]

    def forward_latent(
        self,
        q_latent: torch.Tensor,
        q_pe: torch.Tensor,
        latent: torch.Tensor,
        k_pe: torch.Tensor,
        w_uv: torch.Tensor,
        attn_metadata: AttentionMetadata,
    ) -> torch.Tensor:
        """Attention of absorbed queries over the latent cache.

        q_latent: [T, H, L] (q_nope through W_UK); q_pe: [T, H, R] rotated; latent: [T, L]
        normalized; k_pe: [T, R] rotated; w_uv: [H, Dv, L]. Returns [T, H * Dv].
        """
        num_tokens = q_latent.shape[0]
        query = torch.cat((q_latent, q_pe), dim=-1)  # [T, H, L + R]
        rows = torch.cat((latent, k_pe), dim=-1)  # [T, L + R]
        if self.kv_cache is None:  # the memory-profile run: this step's rows are the cache
            kv = rows.unsqueeze(1)
            out = self._attend_without_cache(query, kv, kv, attn_metadata)
        else:
            paged = self.latent_cache.unsqueeze(2)  # [num_blocks, block_size, 1, L + R]
            # The K/V write kernel with the one plane as both caches (slots < 0 skipped).
            row_heads = rows.to(paged.dtype).unsqueeze(1)
            kernels.write_kv_cache(row_heads, row_heads, paged, paged, attn_metadata.slot_mapping)
            out = kernels.paged_attention(
                query.to(paged.dtype),
                paged,
                paged,
                attn_metadata.block_table,
                attn_metadata.query_start_loc,
                attn_metadata.seq_lens,
                self.scale,
                attn_metadata.max_query_len,
                attn_metadata.max_seq_len,
            )
        out_latent = out[..., : self.kv_lora_rank]  # [T, H, L]
        out_v = torch.einsum("thl,hvl->thv", out_latent, w_uv.to(out_latent.dtype))
        return out_v.reshape(num_tokens, -1)
