"""Paged attention over flattened varlen queries."""

import torch
import torch.nn.functional as F


def paged_attention_ref(query, key_cache, value_cache, block_table, query_start_loc, seq_lens,
                        scale, max_query_len, max_seq_len):
    # Simple per-request loop; to be replaced by a batched version.
    num_heads = query.shape[1]
    num_kv_heads = key_cache.shape[2]
    block_size = key_cache.shape[1]
    out = torch.empty_like(query)
    qsl = query_start_loc.tolist()
    lens = seq_lens.tolist()
    for r, seq_len in enumerate(lens):
        start, end = qsl[r], qsl[r + 1]
        q_len = end - start
        num_blocks = (seq_len + block_size - 1) // block_size
        blocks = block_table[r, :num_blocks].long()
        k = key_cache[blocks].flatten(0, 1)[:seq_len]
        v = value_cache[blocks].flatten(0, 1)[:seq_len]
        q = query[start:end].transpose(0, 1)  # [Hq, q_len, D]
        k = k.transpose(0, 1).repeat_interleave(num_heads // num_kv_heads, dim=0)
        v = v.transpose(0, 1).repeat_interleave(num_heads // num_kv_heads, dim=0)
        # Query j sits at position seq_len - q_len + j: mask keys after it.
        pos_q = torch.arange(seq_len - q_len, seq_len).unsqueeze(1)
        mask = torch.arange(seq_len).unsqueeze(0) <= pos_q
        o = F.scaled_dot_product_attention(q, k, v, attn_mask=mask, scale=scale)
        out[start:end] = o.transpose(0, 1)
    return out


paged_attention = paged_attention_ref  # replaced by the Triton kernel
