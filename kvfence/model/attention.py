"""Paged attention: each request reads K/V only through the slots of its own block table."""
from dataclasses import dataclass

import torch
import torch.nn.functional as F


@dataclass
class PrefillChunk:
    row_start: int          # rows [row_start, row_end) of the batch are this chunk's tokens
    row_end: int
    context_slots: torch.Tensor  # [L] pool slots of positions 0..L-1 of this request
    mask: torch.Tensor           # [Q, L] bool, causal


@dataclass
class AttentionMetadata:
    slot_mapping: torch.Tensor   # [T] slot each row's new K/V is written to
    num_decode: int              # rows [0, num_decode) are single-token decode steps
    decode_slots: torch.Tensor | None  # [Rd, Lmax] context slots, padding points at the scratch slot
    decode_mask: torch.Tensor | None   # [Rd, 1, 1, Lmax] bool
    prefills: list[PrefillChunk]


def write_kv(k_cache: torch.Tensor, v_cache: torch.Tensor, k: torch.Tensor, v: torch.Tensor,
             meta: AttentionMetadata) -> None:
    k_cache.index_copy_(0, meta.slot_mapping, k)
    v_cache.index_copy_(0, meta.slot_mapping, v)


def paged_attention(q: torch.Tensor, k_cache: torch.Tensor, v_cache: torch.Tensor,
                    meta: AttentionMetadata, scale: float) -> torch.Tensor:
    """q: [T, H, D]; caches: [slots, KVH, D]. Returns [T, H, D] (zero for padding rows)."""
    num_rows, num_heads, head_dim = q.shape
    num_kv_heads = k_cache.shape[1]
    group = num_heads // num_kv_heads
    out = torch.zeros_like(q)
    if meta.num_decode:
        rd = meta.num_decode
        # [Rd, KVH, G, D]: the G query heads sharing a KV head act as G query rows.
        qd = q[:rd].view(rd, num_kv_heads, group, head_dim)
        k = k_cache[meta.decode_slots].transpose(1, 2)  # [Rd, KVH, Lmax, D]
        v = v_cache[meta.decode_slots].transpose(1, 2)
        o = F.scaled_dot_product_attention(qd, k, v, attn_mask=meta.decode_mask, scale=scale)
        out[:rd] = o.reshape(rd, num_heads, head_dim)
    for chunk in meta.prefills:
        qp = q[chunk.row_start:chunk.row_end].transpose(0, 1).unsqueeze(0)  # [1, H, Q, D]
        k = k_cache[chunk.context_slots].transpose(0, 1).unsqueeze(0)       # [1, KVH, L, D]
        v = v_cache[chunk.context_slots].transpose(0, 1).unsqueeze(0)
        o = F.scaled_dot_product_attention(qp, k, v, attn_mask=chunk.mask, scale=scale,
                                           enable_gqa=group > 1)
        out[chunk.row_start:chunk.row_end] = o[0].transpose(0, 1)
    return out
