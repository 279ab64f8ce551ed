"""Linear layers for fp32 activations: x @ weight.T + bias, weights in fp32, bf16 or GGUF blocks."""
from typing import Callable

import torch
import torch.nn.functional as F

PANEL = 32             # weight rows per panel of csrc/linear.cpp
ONEDNN_MIN_ROWS = 16   # bf16 only: from this many rows oneDNN's bf16 GEMM beats the kernel


def pack(weight: torch.Tensor) -> torch.Tensor:
    """fp32 or bf16 [N, K] -> [ceil(N/32), K, 32]: panel p holds rows 32p..32p+31 (zero
    padded), k-major. Blocks (uint8 [N, K/32 * 40], see loader.gguf_blocks) ->
    [ceil(N/32), K/32, 1280]: per block of 32 k, the panel's 32 scales, 32 offsets, then the
    codes k-major."""
    n = weight.shape[0]
    panels = F.pad(weight, (0, 0, 0, -n % PANEL)).view(-1, PANEL, *weight.shape[1:])
    if weight.dtype != torch.uint8:
        return panels.transpose(1, 2).contiguous()
    blocks = panels.view(panels.shape[0], PANEL, -1, 40).transpose(1, 2)      # [P, K/32, 32 rows, 40]
    codes = blocks[..., 8:].transpose(2, 3).flatten(2)                           # [P, K/32, 32 k * 32 rows]
    return torch.cat([blocks[..., :4].flatten(2), blocks[..., 4:8].flatten(2), codes], dim=2).contiguous()


class Linear:
    """With the CPU kernel, fp32 layers run through it at every batch size, which makes each
    row's result independent of the batch (invariant 10) and streams the weights at memory
    speed for a single request. GGUF blocks (uint8 weights) run through it too, with the
    same bits as fp32 from a third of the bytes. bf16 layers use it for small
    batches only and keep the plain layout for oneDNN (AMX), which is far faster on large
    ones; bf16 is not batch invariant. Without the kernel (GPU, no compiler, no AVX-512):
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
        w = weight.to(device) if blocks else weight.to(device, dtype)
        self.packed = None if kernel is None else pack(w)
        self.weight = None if kernel is not None and (blocks or dtype == torch.float32) else w
        self.bias = None if bias is None else bias.to(device, torch.float32)

    def __call__(self, x: torch.Tensor) -> torch.Tensor:
        if self.packed is not None and (self.weight is None or x.shape[0] < ONEDNN_MIN_ROWS):
            return self.kernel(x, self.packed, self.out_features, self.bias)
        bias = None if self.bias is None else self.bias.to(self.dtype)
        return F.linear(x.to(self.dtype), self.weight, bias).to(x.dtype)
