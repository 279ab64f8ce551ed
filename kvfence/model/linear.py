"""Linear layers: x @ weight.T + bias, weights in fp32, bf16 or GGUF blocks (times fp32 or,
with --dtype gguf-int8, 8-bit activations). The output is in the layer's dtype (fp32 for GGUF
blocks): bf16 layers hand bf16 on, which spares a conversion each way on every call."""

from typing import Callable

import numpy as np
import torch
import torch.nn.functional as F

from kvfence.model.kernels import build
from kvfence.model.quant import HALF_TYPES, SUB_BLOCK_BYTES, blocks_to_float, sub_blocks

PANEL = 32  # weight rows per panel of csrc/linear.cpp
ONEDNN_MIN_ROWS = 8  # bf16: from this many rows oneDNN's prepacked bf16 GEMM beats the kernel


def block_panels(blocks: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """Blocks (uint8 [N, K/16 * 24], see quant.gguf_blocks) in panels of 32 rows (zero padded):
    the codes [ceil(N/32), K/32, 32 rows, 32 k] and the fp32 scales and offsets
    [ceil(N/32), K/32, 32 rows, 2 halves of 16 k, 2]."""
    panels = F.pad(blocks, (0, 0, 0, -blocks.shape[0] % PANEL)).view(
        -1, PANEL, blocks.shape[1] // (2 * SUB_BLOCK_BYTES), 2, SUB_BLOCK_BYTES
    )
    panels = panels.transpose(1, 2)
    codes = panels[..., 8:].flatten(3)
    return codes, panels[..., :8].contiguous().view(torch.float32)


def pack(weight: torch.Tensor | list[torch.Tensor]) -> torch.Tensor:
    """fp32, bf16 or fp16 [N, K] -> [ceil(N/32), K, 32]: panel p holds rows 32p..32p+31 (zero
    padded), k-major. Blocks (uint8 [N, K/16 * 24], see quant.gguf_blocks) -> per panel and
    block of 32 k, the 32 rows' scales, their offsets, then the codes k-major. Where every
    code fits 4 bits, two codes a byte (row j low, row j + 16 high), with fp16 scales where
    they all fit (Q4_0, Q4_1 as stored: [ceil(N/32), K/32, 640]), else fp32 ones (Q4_K: 768);
    other codes take a byte each, with fp32 scales (1280). Where the two halves of a block
    have scales of their own (Q6_K), each half's scales and offsets, then bytes (1536).
    K-quant rows (uint8 [N, K/256, bytes], the file's blocks) -> csrc/linear.cpp's
    SuperBlocks, [ceil(N/32), K/256, bytes] (Q4_K: 4,736, 0.58 a weight; Q5_K 6,784; Q6_K
    6,720), packed there; a list of K-quant parts of different types (a fused matrix) -> its
    table of those panels, uint8 [bytes] (pack_k_quants)."""
    if isinstance(weight, list):
        return build("linear").pack_k_quants([part.contiguous() for part in weight], False)
    if weight.dtype != torch.uint8:
        panels = F.pad(weight, (0, 0, 0, -weight.shape[0] % PANEL)).view(-1, PANEL, weight.shape[1])
        return panels.transpose(1, 2).contiguous()
    if weight.dim() == 3:
        return build("linear").pack_super_blocks(weight.contiguous())
    shared, nibbles, fp16 = True, True, True  # one layout for the whole matrix
    for part in _panel_chunks(weight):
        codes, scales = block_panels(part)
        shared = shared and torch.equal(scales[..., 0, :], scales[..., 1, :])
        nibbles = nibbles and bool(codes.max() < 16)
        fp16 = fp16 and torch.equal(scales.half().float(), scales)

    def packed(part: torch.Tensor) -> torch.Tensor:
        codes, scales = block_panels(part)
        codes = codes.transpose(2, 3)  # [P, K/32, 32 k, 32 rows]
        if not shared:
            halves = scales.permute(0, 1, 3, 4, 2).contiguous()  # [P, K/32, half, kind, row]
            return torch.cat([halves.view(torch.uint8).flatten(2), codes.flatten(2)], dim=2)
        scales = scales[..., 0, :]
        if nibbles and fp16:
            scales = scales.half().view(torch.uint8).view(*scales.shape, 2)
        else:
            scales = scales.view(torch.uint8).view(*scales.shape, 4)
        if nibbles:
            codes = codes[..., :16] | codes[..., 16:] << 4
        return torch.cat(
            [scales[..., 0, :].flatten(2), scales[..., 1, :].flatten(2), codes.flatten(2)],
            dim=2,
        )

    return _in_chunks(weight, packed)


def _panel_chunks(blocks: torch.Tensor) -> list[torch.Tensor]:
    """Blocks in whole panels of a few MB: packed at once, a large matrix's temporaries would
    be several times its size."""
    rows = PANEL * max(1, (2 << 20) // (PANEL * blocks[0].numel()))
    return [blocks[r : r + rows] for r in range(0, blocks.shape[0], rows)]


def _in_chunks(blocks: torch.Tensor, packed: Callable) -> torch.Tensor:
    """packed(chunk) of each of _panel_chunks' chunks, into one tensor of panels."""
    first, *rest = _panel_chunks(blocks)
    panels = packed(first)
    out = torch.empty((-(-blocks.shape[0] // PANEL), *panels.shape[1:]), dtype=torch.uint8)
    out[: len(panels)] = panels
    at = len(panels)
    for part in rest:
        panels = packed(part)
        out[at : at + len(panels)] = panels
        at += len(panels)
    return out


def pack_for_int8(blocks: torch.Tensor | list[torch.Tensor]) -> torch.Tensor:
    """Blocks (uint8 [N, K/16 * 24]) -> the int8 layout of csrc/linear.cpp's kernel for 8-bit
    activations, per panel and block of 32 k: 4-bit codes (Q4_1) with fp16 scales and
    offsets, [ceil(N/32), K/32, 640]; 5-bit ones (Q5_1), the same and a plane of their
    fifth bits, [ceil(N/32), K/32, 768]; the same with a zero point of 8 (Q4_0) or 16 (Q5_0,
    and Q4_0 beside it, its codes moved up by 8) in place of the offsets, 576 and 704 bytes;
    or signed codes with fp16 scales (Q8_0, with any Q4_0 and Q5_0 beside it in a fused
    matrix), [ceil(N/32), K/32, 1088]. Columns come in groups of 8 with 4 consecutive k each,
    the order vpmaddubsw multiplies them in. K-quants (a list of their parts where a fused
    matrix mixes types) go to csrc/linear.cpp's table of panels (pack_k_quants)."""
    if isinstance(blocks, list) or blocks.dim() == 3:
        parts = blocks if isinstance(blocks, list) else [blocks]
        if any(part.dim() != 3 for part in parts):
            raise ValueError("8-bit activations need the parts of a matrix all in K-quants or none")
        return build("linear").pack_k_quants([part.contiguous() for part in parts], True)
    codes, scales = block_panels(sub_blocks(blocks))
    if not torch.equal(scales[..., 0, :], scales[..., 1, :]):
        raise ValueError("8-bit activations need blocks with one scale per 32 weights")
    scales = scales[..., 0, :]
    p, nb = codes.shape[:2]
    scale, offset = scales[..., 0], scales[..., 1]
    codes = codes.view(p, nb, 4, 8, 32)  # [P, K/32, g, j, k]

    def half(t):
        return t.half().view(torch.uint8).view(p, nb, 2 * PANEL)

    def fp16(t):
        return torch.equal(t.half().float(), t)

    # Q4_0 and Q5_0: every offset is -8 or -16 scales, but in blocks of zeros (scale 0), whose
    # codes say nothing. One zero point for all: Q4_0's codes move up by 8 beside Q5_0's.
    zeros = torch.where(scale != 0, -offset / scale, 0)
    blank = ((scale == 0) & (offset == 0)).view(p, nb, 4, 8, 1)
    zero_point = None
    if bool(((zeros == 8) | (zeros == 16) | blank.view_as(zeros)).all()):
        zero_point = 16 if bool((zeros == 16).any()) else 8
        lifted = codes.to(torch.int16) + (zero_point - zeros).view(p, nb, 4, 8, 1).to(torch.int16)
        nibble_codes = torch.where(blank, zero_point, lifted).to(torch.uint8)
        five = zero_point == 16
    else:
        nibble_codes = codes
        five = bool(codes.max() >= 16)
    if fp16(scale) and (zero_point or (codes.max() < 32 and fp16(offset))):
        # [P, K/32, h, g, j, t, high]
        nibbles = nibble_codes.view(p, nb, 4, 8, 4, 2, 4).permute(0, 1, 4, 2, 3, 6, 5)
        low = nibbles & 15
        parts = [half(scale)] + ([] if zero_point else [half(offset)])
        parts.append((low[..., 0] | low[..., 1] << 4).flatten(2))
        if five:  # fifth bits, per step and nibble: [P, K/32, h, high, g, j, t]
            fifth = (nibbles >> 4).permute(0, 1, 2, 6, 3, 4, 5).reshape(p, nb, 8, 128)
            bits = np.packbits(fifth.numpy(), axis=-1, bitorder="little")
            parts.append(torch.from_numpy(bits).flatten(2))
        packed = torch.cat(parts, dim=2)
    else:  # Q8_0, and Q4_0 or Q5_0 beside it: signed codes q = code - zero, no offset
        # the code of each block's weight 0, where its type has one (Q8_0 128, Q5_0 16, Q4_0 8)
        zero = torch.where(scale != 0, zeros, 128).round().clamp(0, 128).to(torch.int16)
        signed = codes.to(torch.int16) - zero.view(p, nb, 4, 8, 1)
        if not (torch.equal(offset, -zero * scale) and fp16(scale) and signed.max() < 128):
            raise ValueError(
                "8-bit activations need blocks with fp16 scales, and no 8-bit codes (Q8_0) in "
                "one matrix with offsets (Q4_1, Q5_1)"
            )
        signed = signed.to(torch.int8).view(torch.uint8)
        packed = torch.cat(
            [half(scale), signed.view(p, nb, 4, 8, 8, 4).permute(0, 1, 4, 2, 3, 5).flatten(2)],
            dim=2,
        )
    return packed.contiguous().view(torch.int8)


def onednn_prepacked(weight: torch.Tensor) -> torch.Tensor | None:
    """bf16 weights reordered once into oneDNN's blocked layout (F.linear reorders them on
    every call, a large part of a layer's time at decode batch sizes), or None where oneDNN
    has no bf16 GEMM. Packed for 64 rows, a full decode batch; other row counts still run."""
    if not (
        weight.device.type == "cpu"
        and torch.backends.mkldnn.is_available()
        and torch.ops.mkldnn._is_mkldnn_bf16_supported()
    ):
        return None
    return torch.ops.mkldnn._reorder_linear_weight(weight, 64)


class Linear:
    """With the CPU kernel, fp32 layers run through it at every batch size, which makes each
    row's result independent of the batch (invariant 10) and streams the weights at memory
    speed for a single request. GGUF blocks (uint8 weights) run through it too, with the
    same bits as fp32 from a sixth (4-bit) or a third (8-bit) of the bytes. bf16 layers use
    it on the GGUF blocks where they are given (fewer bytes than bf16, and the exact
    weights); where oneDNN has a bf16 GEMM (AVX-512 BF16, AMX), which is far faster on large
    batches, they keep its layout too and use the kernel for small batches only, and are then
    not batch invariant. fp16 and bf16 weights of fp32 layers stay 16-bit: the kernel widens
    them exactly, so they give the bits of their fp32 values from half the bytes.
    int8_activations (GGUF weights): the kernel rounds x to 8 bits per block of 32 (K-quants:
    256, llama.cpp's Q8_K) and sums on integers, llama.cpp's arithmetic: faster, still batch
    invariant, not the fp32 bits; fp16 and bf16 weights take x rounded to their own type, as
    llama.cpp's F16 and BF16 dot products do. Without the kernel (GPU, no compiler, neither
    AVX-512 nor AVX2): torch's matmul."""

    def __init__(
        self,
        weight: torch.Tensor | list[torch.Tensor],
        bias: torch.Tensor | None,
        dtype: torch.dtype,
        device: torch.device,
        kernel: Callable | None,
        int8_activations: bool = False,
    ):
        # A list: the parts of a fused matrix in K-quants of different types, packed into one
        # table of panels, each of its own type (see loader._cat_rows).
        parts = weight if isinstance(weight, list) else [weight]
        weight = parts[0] if len(parts) == 1 else weight
        self.out_features = sum(part.shape[0] for part in parts)
        self.dtype = dtype
        self.kernel = kernel
        blocks = parts[0].dtype == torch.uint8
        half = parts[0].dtype in HALF_TYPES.values()
        if blocks and kernel is None:
            raise RuntimeError(
                "GGUF blocks run only through the CPU linear kernel, which is unavailable here "
                "(see the warning above): use --dtype float32, which gives the same results"
            )
        if int8_activations and not ((blocks or half) and dtype == torch.float32):
            raise ValueError("8-bit activations run on GGUF weights with fp32 outputs only")
        # x rounded to the weights' 16-bit type, for llama.cpp's arithmetic on them
        self.round_to = parts[0].dtype if int8_activations and half else None
        keep = blocks or (half and dtype == torch.float32)  # as stored: widened exactly
        packer = pack_for_int8 if int8_activations and blocks else pack
        self.packed = (
            None
            if kernel is None
            else packer(parts if len(parts) > 1 else weight.to(device, None if keep else dtype))
        )

        def unpacked():
            if blocks and len(parts) > 1:
                return torch.cat([blocks_to_float(part) for part in parts]).to(device, dtype)
            return (blocks_to_float(weight) if blocks else weight).to(device, dtype)

        self.onednn = (
            onednn_prepacked(unpacked()) if kernel is not None and dtype == torch.bfloat16 else None
        )
        self.weight = None if kernel is not None else unpacked()  # torch's GEMM
        self.bias = None if bias is None else bias.to(device, torch.float32)
        # For torch's and oneDNN's GEMMs.
        self.low_bias = None if bias is None else bias.to(device, dtype)

    def __call__(self, x: torch.Tensor) -> torch.Tensor:
        if self.round_to is not None:
            x = x.to(self.round_to)
        if self.packed is not None and (self.onednn is None or x.shape[0] < ONEDNN_MIN_ROWS):
            out = self.kernel(
                x if x.dtype == torch.float32 else x.float(),
                self.packed,
                self.out_features,
                self.bias,
            )
            return out if self.dtype == torch.float32 else out.to(self.dtype)
        if self.onednn is not None:
            return torch.ops.mkldnn._linear_pointwise(
                x.to(self.dtype), self.onednn, self.low_bias, "none", [], ""
            )
        return F.linear(x.to(self.dtype), self.weight, self.low_bias)
