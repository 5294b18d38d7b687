"""Rotary position embedding, neox (rotate-half) style."""

import torch


def rotary_embedding_ref(positions, query, key, cos_sin_cache, head_size):
    cos, sin = cos_sin_cache[positions].chunk(2, dim=-1)  # [T, D/2] each
    cos = torch.cat((cos, cos), dim=-1).unsqueeze(1)
    sin = torch.cat((sin, sin), dim=-1).unsqueeze(1)

    def rotate(x):
        t = x.shape[0]
        xf = x.view(t, -1, head_size).float()
        x1, x2 = xf.chunk(2, dim=-1)
        out = xf * cos + torch.cat((-x2, x1), dim=-1) * sin
        return out.to(x.dtype).view(t, -1)

    return rotate(query), rotate(key)


rotary_embedding = rotary_embedding_ref  # replaced by the Triton kernel
