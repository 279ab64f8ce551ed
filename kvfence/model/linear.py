"""Linear layers: x @ weight.T + bias, weights in fp32, bf16 or GGUF blocks. The output is in
the layer's dtype (fp32 for GGUF blocks): bf16 layers hand bf16 on, which spares a
conversion each way on every call."""
from typing import Callable

import torch
import torch.nn.functional as F

from kvfence.model.loader import blocks_to_float

PANEL = 32             # weight rows per panel of csrc/linear.cpp
ONEDNN_MIN_ROWS = 8    # bf16 only: from this many rows oneDNN's bf16 GEMM (prepacked) beats the kernel


def pack(weight: torch.Tensor) -> torch.Tensor:
    """fp32 or bf16 [N, K] -> [ceil(N/32), K, 32]: panel p holds rows 32p..32p+31 (zero
    padded), k-major. Blocks (uint8 [N, K/32 * 40], see loader.gguf_blocks) -> per panel and
    block of 32 k, the 32 rows' scales, their offsets, then the codes k-major:
    [ceil(N/32), K/32, 640] with fp16 scales and two 4-bit codes a byte (row j low, row j + 16
    high) where every code fits 4 bits and every scale fp16 (Q4_0, Q4_1 as stored), else
    [ceil(N/32), K/32, 1280] with fp32 scales and 8-bit codes."""
    n = weight.shape[0]
    panels = F.pad(weight, (0, 0, 0, -n % PANEL)).view(-1, PANEL, *weight.shape[1:])
    if weight.dtype != torch.uint8:
        return panels.transpose(1, 2).contiguous()
    blocks = panels.view(panels.shape[0], PANEL, -1, 40).transpose(1, 2)      # [P, K/32, 32 rows, 40]
    scales = blocks[..., :8].contiguous().view(torch.float32)                   # [P, K/32, 32 rows, 2]
    codes = blocks[..., 8:].transpose(2, 3)                                      # [P, K/32, 32 k, 32 rows]
    if codes.max() < 16 and torch.equal(scales.half().float(), scales):
        scales = scales.half().view(torch.uint8).view(*scales.shape, 2)
        codes = codes[..., :16] | codes[..., 16:] << 4
    else:
        scales = scales.view(torch.uint8).view(*scales.shape, 4)
    return torch.cat([scales[..., 0, :].flatten(2), scales[..., 1, :].flatten(2), codes.flatten(2)], dim=2).contiguous()


def onednn_prepacked(weight: torch.Tensor) -> torch.Tensor | None:
    """bf16 weights reordered once into oneDNN's blocked layout (F.linear reorders them on
    every call, which cost 25-45% per layer at 16-64 rows here), or None where oneDNN has no
    bf16 GEMM. Packed for 64 rows, a full decode batch; other row counts still run."""
    if not (weight.device.type == "cpu" and torch.backends.mkldnn.is_available()
            and torch.ops.mkldnn._is_mkldnn_bf16_supported()):
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
    not batch invariant. Without the kernel (GPU, no compiler, neither AVX-512 nor AVX2):
    torch's matmul."""

    def __init__(self, weight: torch.Tensor, bias: torch.Tensor | None, dtype: torch.dtype, device: torch.device,
                 kernel: Callable | None):
        self.out_features = weight.shape[0]
        self.dtype = dtype
        self.kernel = kernel
        blocks = weight.dtype == torch.uint8
        if blocks and kernel is None:
            raise RuntimeError("GGUF blocks run only through the CPU linear kernel, which is unavailable here "
                               "(see the warning above): use --dtype float32, which gives the same results")
        self.packed = None if kernel is None else pack(weight.to(device) if blocks else weight.to(device, dtype))
        unpacked = lambda: (blocks_to_float(weight) if blocks else weight).to(device, dtype)  # noqa: E731
        self.onednn = onednn_prepacked(unpacked()) if kernel is not None and dtype == torch.bfloat16 else None
        self.weight = None if kernel is not None else unpacked()  # torch's GEMM
        self.bias = None if bias is None else bias.to(device, torch.float32)
        self.low_bias = None if bias is None else bias.to(device, dtype)  # for torch's and oneDNN's GEMMs

    def __call__(self, x: torch.Tensor) -> torch.Tensor:
        if self.packed is not None and (self.onednn is None or x.shape[0] < ONEDNN_MIN_ROWS):
            out = self.kernel(x if x.dtype == torch.float32 else x.float(), self.packed, self.out_features, self.bias)
            return out if self.dtype == torch.float32 else out.to(self.dtype)
        if self.onednn is not None:
            return torch.ops.mkldnn._linear_pointwise(x.to(self.dtype), self.onednn, self.low_bias, "none", [], "")
        return F.linear(x.to(self.dtype), self.weight, self.low_bias)
