"""Paged attention: each request reads K/V only through the slots of its own block table."""

from dataclasses import dataclass
from functools import cached_property
from typing import Callable

import torch
import torch.nn.functional as F


@dataclass
class PrefillChunk:
    row_start: int  # rows [row_start, row_end) of the batch are this chunk's tokens
    row_end: int
    context_slots: torch.Tensor  # [L] pool slots of positions 0..L-1 of this request
    mask: torch.Tensor | None  # [Q, L] bool, causal; None: chunk starts at position 0 (Q == L)


@dataclass
class AttentionMetadata:
    slot_mapping: torch.Tensor  # [T] slot each row's new K/V is written to
    page_size: int
    # Rows [0, num_decode) attend through a block table: decode steps, and prefill rows too
    # where the kernel takes them (ModelRunner.kernel_prefill), each to the positions up to its own.
    num_decode: int
    decode_block_table: torch.Tensor | None  # [Rd, P] pages; past a row's length, the scratch page
    decode_lens: torch.Tensor | None  # [Rd] context length including the row's own token
    prefills: list[PrefillChunk]
    # Reads the pool in place (kernels.py); None: gather in PyTorch.
    decode_kernel: Callable | None = None

    @cached_property
    def decode_mask(self) -> torch.Tensor:
        """[Rd, 1, 1, P * page_size] bool: the positions each decode row may attend to."""
        width = self.decode_block_table.shape[1] * self.page_size
        positions = torch.arange(width, device=self.decode_lens.device)
        return (positions[None, :] < self.decode_lens[:, None])[:, None, None, :]

    @cached_property
    def past_decode_lens(self) -> torch.Tensor:
        """[Rd, 1, P * page_size, 1] bool: the gathered slots past each decode row's length."""
        return ~self.decode_mask.transpose(2, 3)


def gather_pages(cache: torch.Tensor, block_table: torch.Tensor, page_size: int) -> torch.Tensor:
    """[Rd, KVH, P * page_size, D]: whole pages copied out of the pool in block-table order."""
    rd, num_pages = block_table.shape
    pages = cache.view(-1, page_size * cache.shape[1] * cache.shape[2])
    picked = pages.index_select(0, block_table.flatten())
    return picked.view(rd, num_pages * page_size, cache.shape[1], cache.shape[2]).transpose(1, 2)


def paged_attention(
    q: torch.Tensor,
    k_cache: torch.Tensor,
    v_cache: torch.Tensor,
    meta: AttentionMetadata,
    scale: float,
    prefill_dtype: torch.dtype = torch.float32,
) -> torch.Tensor:
    """q: [T, H, D]; caches: [slots, KVH, D], fp32, bf16 or fp8. Returns [T, H, D] in the
    caches' dtype, or the model's (`prefill_dtype`) for an fp8 pool (zero for padding rows).
    Decode math is fp32; prefill runs in `prefill_dtype`, the model's: under fp32 layers a bf16
    pool is widened as it is read, since CPUs without bf16 arithmetic run bf16 attention
    several times slower."""
    num_rows, num_heads, head_dim = q.shape
    num_kv_heads = k_cache.shape[1]
    group = num_heads // num_kv_heads
    rd = meta.num_decode
    out_dtype = prefill_dtype if k_cache.dtype == torch.float8_e4m3fn else k_cache.dtype
    if rd and meta.decode_kernel is not None:
        qd = q if rd == num_rows else q[:rd]
        decoded = meta.decode_kernel(
            qd.float().contiguous(),
            k_cache,
            v_cache,
            meta.decode_block_table,
            meta.decode_lens,
            meta.page_size,
            scale,
        )
        if rd == num_rows:  # a decode-only step: nothing else to fill in
            return decoded if decoded.dtype == out_dtype else decoded.to(out_dtype)
    out = torch.zeros_like(q, dtype=out_dtype)
    if rd:
        if meta.decode_kernel is not None:
            out[:rd] = decoded
        else:
            # [Rd, KVH, G, D]: the G query heads sharing a KV head act as G query rows.
            qd = q[:rd].float().view(rd, num_kv_heads, group, head_dim)
            # Zeroed, not only masked: a stale NaN past a row's length (a freed page's previous
            # owner, the scratch page) would survive a zero attention weight, as 0 x NaN is NaN.
            table, hidden = meta.decode_block_table, meta.past_decode_lens
            k = gather_pages(k_cache, table, meta.page_size).float().masked_fill_(hidden, 0.0)
            v = gather_pages(v_cache, table, meta.page_size).float().masked_fill_(hidden, 0.0)
            o = F.scaled_dot_product_attention(qd, k, v, attn_mask=meta.decode_mask, scale=scale)
            out[:rd] = o.reshape(rd, num_heads, head_dim)
    for chunk in meta.prefills:
        # qp: [1, H, Q, D]; k, v: [1, KVH, L, D]
        qp = q[chunk.row_start : chunk.row_end].to(prefill_dtype).transpose(0, 1).unsqueeze(0)
        k = k_cache[chunk.context_slots].to(prefill_dtype).transpose(0, 1).unsqueeze(0)
        v = v_cache[chunk.context_slots].to(prefill_dtype).transpose(0, 1).unsqueeze(0)
        o = F.scaled_dot_product_attention(
            qp,
            k,
            v,
            attn_mask=chunk.mask,
            is_causal=chunk.mask is None,
            scale=scale,
            enable_gqa=group > 1,
        )
        out[chunk.row_start : chunk.row_end] = o[0].transpose(0, 1)
    return out
