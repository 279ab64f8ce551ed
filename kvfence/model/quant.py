"""GGUF's quantized block formats as the model keeps them: the types kept as stored, their
blocks unpacked into rows of 16-weight sub-blocks, and those rows back to fp32."""

from collections.abc import Callable

import numpy as np
import torch

# The GGUF types kept in blocks, and the bytes of one of their blocks (32 weights; 256 for the
# K-quants). F16 and BF16 stay 16-bit floats (HALF_TYPES); the others (IQ*, Q2_K, ...) are
# dequantized to fp32 at load.
BLOCK_BYTES = {
    "Q4_0": 18,
    "Q4_1": 20,
    "Q5_0": 22,
    "Q5_1": 24,
    "Q8_0": 34,
    "Q4_K": 144,
    "Q5_K": 176,
    "Q6_K": 210,
}
# Kept in their own super-blocks of 256 weights, as uint8 [N, K/256, bytes a block]: the
# kernel decodes them there (csrc/linear.cpp, pack_super_blocks), at the file's bytes a weight.
SUPER_BLOCK_TYPES = {BLOCK_BYTES[kind]: kind for kind in ("Q4_K", "Q5_K", "Q6_K")}
# Those 8-bit activations (gguf-int8) run on: rows rounded per 32 k, or per 256 for K-quants
INT8_BLOCK_TYPES = ("Q4_0", "Q4_1", "Q5_0", "Q5_1", "Q8_0", "Q4_K", "Q5_K", "Q6_K")
# Kept as torch's 16-bit floats, which the kernel widens exactly (gguf-int8: x rounded to them)
HALF_TYPES = {"F16": torch.float16, "BF16": torch.bfloat16}
KEPT_TYPES = (*BLOCK_BYTES, *HALF_TYPES)  # what --dtype gguf and gguf-int8 keep as stored
SUB_BLOCK = 16  # weights per scale in gguf_blocks: Q6_K's, the finest of BLOCK_BYTES
SUB_BLOCK_BYTES = 8 + SUB_BLOCK  # fp32 scale and offset, then a code a weight


def _fp16(raw: np.ndarray, at: int) -> np.ndarray:
    return raw[:, at : at + 2].view(np.float16).astype(np.float32)


def _high_bits(qh: np.ndarray) -> np.ndarray:
    """Q5_0/Q5_1's 32 fifth bits, one a weight, from their little-endian uint32."""
    return ((qh.view(np.uint32) >> np.arange(32, dtype=np.uint32)) & 1).astype(np.uint8)


def _k_quant_scales(raw: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
    """Q4_K/Q5_K: per sub-block of 32, scale d * sc and offset -dmin * m (both exact in fp32:
    an fp16 times a 6-bit integer), with gguf's own unpacking of the 6-bit scales."""
    from gguf.quants import Q4_K

    sc, m = Q4_K.get_scale_min(raw[:, 4:16])
    scale = _fp16(raw, 0) * sc.astype(np.float32)
    return scale.reshape(-1), (-(_fp16(raw, 2) * m.astype(np.float32))).reshape(-1)


def _bytes_of_8(raw: np.ndarray) -> np.ndarray:
    """uint8 [R, 8n] as uint64 [R, n]: shifts and masks on 8 codes at once, none of which
    carries a bit across a byte."""
    return np.ascontiguousarray(raw).view(np.uint64)


def k_quant_nibbles(qs: np.ndarray) -> np.ndarray:
    """128 bytes of K-quant codes -> [8 sub-blocks, 32] low nibbles: sub-block 2i is the low
    nibbles of bytes 32i..32i+31, sub-block 2i+1 their high nibbles."""
    qs = _bytes_of_8(qs).reshape(-1, 4, 1, 4) >> np.array([0, 4], np.uint64).reshape(1, 1, 2, 1)
    return (qs & np.uint64(0x0F0F0F0F0F0F0F0F)).view(np.uint8).reshape(-1, 32)


def q6_k_codes(raw: np.ndarray) -> np.ndarray:
    """Q6_K's 256 6-bit codes a block, in gguf's order: the low 4 bits from 128 bytes of
    nibbles (as k_quant_nibbles, in halves of 64 bytes), the high 2 from 64 bytes of pairs."""
    words = _bytes_of_8(raw[:, :192])
    low = words[:, :16].reshape(-1, 2, 1, 8) >> np.array([0, 4], np.uint64).reshape(1, 1, 2, 1)
    high = words[:, 16:].reshape(-1, 2, 1, 4) >> np.array([0, 2, 4, 6], np.uint64).reshape(
        1, 1, 4, 1
    )
    low, high = low & np.uint64(0x0F0F0F0F0F0F0F0F), high & np.uint64(0x0303030303030303)
    return (low.reshape(-1, 32) | high.reshape(-1, 32) << np.uint64(4)).view(np.uint8)


def gguf_blocks(data: np.ndarray, kind: str) -> torch.Tensor:
    """A tensor of a type in BLOCK_BYTES as the model keeps it: K-quants in their own blocks
    (uint8 [N, K/256, bytes]), the other types in sub-blocks (see sub_blocks)."""
    if kind in SUPER_BLOCK_TYPES.values():
        return torch.from_numpy(np.array(data).reshape(data.shape[0], -1, BLOCK_BYTES[kind]))
    return torch.from_numpy(_by_rows(data, lambda rows: _sub_blocks(rows, kind)))


def sub_blocks(blocks: torch.Tensor) -> torch.Tensor:
    """Blocks as gguf_blocks keeps them -> rows of 24-byte sub-blocks of 16 weights:
    scale and offset (fp32), then 16 codes (uint8), with weight = scale * code + offset (types
    with a scale per 32 weights give two sub-blocks the same one). gguf dequantizes each of
    these types with one rounding after an exact product, so one fused multiply-add of scale,
    code and offset gives its fp32 values bit for bit. Sub-blocks take any mix of types."""
    if blocks.dim() == 2:
        return blocks
    kind = SUPER_BLOCK_TYPES[blocks.shape[2]]
    rows = blocks.numpy().reshape(blocks.shape[0], -1)
    return torch.from_numpy(_by_rows(rows, lambda part: _sub_blocks(part, kind)))


def _sub_blocks(data: np.ndarray, kind: str) -> np.ndarray:
    raw = data.reshape(-1, BLOCK_BYTES[kind])
    if kind == "Q6_K":  # w = d * sc * (q - 32), sc an int8 per 16 weights
        scale = (_fp16(raw, 208) * raw[:, 192:208].view(np.int8).astype(np.float32)).reshape(-1)
        codes = q6_k_codes(raw)
        offset = -32 * scale
    elif kind in ("Q4_K", "Q5_K"):  # w = d * sc * q - dmin * m, per sub-block of 32
        scale, offset = _k_quant_scales(raw)
        codes = k_quant_nibbles(raw[:, -128:])
        if kind == "Q5_K":  # bit j of byte k is the fifth bit of weight k of sub-block j
            qh = raw[:, 16:48].reshape(-1, 1, 32) >> np.arange(8, dtype=np.uint8).reshape(1, 8, 1)
            codes |= (qh & 1).reshape(-1, 32) << 4
    elif kind == "Q8_0":  # w = d * q, q int8: codes q + 128, offset -128 d
        scale = _fp16(raw, 0)
        codes = (raw[:, 2:].view(np.int8).astype(np.int16) + 128).astype(np.uint8)
        offset = -128 * scale
    else:
        scale = _fp16(raw, 0)
        nibbles = raw[:, -16:]  # the low nibbles are weights 0-15, the high ones 16-31
        codes = np.concatenate([nibbles & 15, nibbles >> 4], axis=1)
        if kind == "Q4_0":  # w = d * (q - 8)
            offset = -8 * scale
        elif kind == "Q4_1":  # w = d * q + m
            offset = _fp16(raw, 2)
        elif kind == "Q5_0":  # w = d * (q - 16), q's fifth bits in a uint32
            codes |= _high_bits(raw[:, 2:6]) << 4
            offset = -16 * scale
        else:  # Q5_1: w = d * q + m
            codes |= _high_bits(raw[:, 4:8]) << 4
            offset = _fp16(raw, 2)
    codes = codes.reshape(-1, SUB_BLOCK)
    per_scale = len(codes) // scale.size  # sub-blocks sharing one scale
    blocks = np.concatenate(
        [
            np.repeat(scale.reshape(-1, 1), per_scale, axis=0).view(np.uint8),
            np.repeat(np.reshape(offset, (-1, 1)), per_scale, axis=0).view(np.uint8),
            codes,
        ],
        axis=1,
    )
    return blocks.reshape(data.shape[0], -1)


def blocks_to_float(blocks: torch.Tensor) -> torch.Tensor:
    """gguf_blocks' rows back to fp32 weights: scale * code is exact (at most 24 bits: an
    fp16's 11 times Q6_K's 7-bit scale and 6-bit code), so the one rounding of the add gives
    the values gguf dequantizes to."""
    b = sub_blocks(blocks).view(blocks.shape[0], -1, SUB_BLOCK_BYTES)
    scale, offset = (
        b[..., 0:4].contiguous().view(torch.float32),
        b[..., 4:8].contiguous().view(torch.float32),
    )
    return (scale * b[..., 8:].float() + offset).flatten(1)


def gguf_fp32(tensor) -> torch.Tensor:
    """A tensor of gguf's reader, of any type, as gguf dequantizes it, in fp32."""
    from gguf.quants import dequantize

    values = _by_rows(tensor.data, lambda rows: dequantize(rows, tensor.tensor_type))
    # F32 tensors come as read-only views of the mapped file
    return torch.from_numpy(np.require(values, np.float32, ["W"]))


def _by_rows(data: np.ndarray, convert: Callable) -> np.ndarray:
    """convert(rows) of a tensor into one array, a few MB of rows at a time: at once, its
    temporaries would be several times the tensor's size."""
    if data.ndim < 2:
        return convert(data)
    step = max(1, (4 << 20) // data[0].nbytes)
    first = convert(data[:step])
    out = np.empty((data.shape[0], *first.shape[1:]), dtype=first.dtype)
    out[:step] = first
    for row in range(step, data.shape[0], step):
        out[row : row + step] = convert(data[row : row + step])
    return out
