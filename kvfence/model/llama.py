"""Llama-family forward pass (Llama, SmolLM, Mistral, Qwen2 and Qwen3 shapes) over paged K/V
caches."""

from dataclasses import dataclass

import torch
import torch.nn.functional as F

from kvfence.model.attention import AttentionMetadata, paged_attention
from kvfence.model.config import ModelConfig
from kvfence.model.kernels import decode_layers, fused_ops, linear_kernel, packed_rows_kernel
from kvfence.model.linear import PANEL, Linear
from kvfence.model.loader import Weights
from kvfence.model.quant import HALF_TYPES, blocks_to_float


def write_slots(cache: torch.Tensor, slots: torch.Tensor, values: torch.Tensor) -> None:
    """cache[slots] = values in the cache's dtype. fp8 saturates at its largest finite value
    (as the CPU kernel does) and goes in as bytes: index_copy_ has no fp8 kernels."""
    if cache.dtype == torch.float8_e4m3fn:
        fp8_max = torch.finfo(cache.dtype).max
        cache.view(torch.uint8).index_copy_(
            0, slots, values.clamp(-fp8_max, fp8_max).to(cache.dtype).view(torch.uint8)
        )
    else:
        cache.index_copy_(0, slots, values.to(cache.dtype))


class TorchOps:
    """What csrc/fused.cpp computes, in PyTorch ops: for GPUs, and CPUs without a compiler."""

    @staticmethod
    def add_rms_norm(
        x: torch.Tensor,
        delta: torch.Tensor | None,
        weight: torch.Tensor,
        eps: float,
        out_dtype: torch.dtype,
    ) -> torch.Tensor:
        if delta is not None:
            x += delta
        return F.rms_norm(x, x.shape[-1:], weight, eps).to(out_dtype)

    @staticmethod
    def silu_mul(gate_up: torch.Tensor) -> torch.Tensor:
        gate, up = gate_up.chunk(2, dim=-1)
        return F.silu(gate) * up

    @staticmethod
    def rope_write_kv(
        qkv: torch.Tensor,
        cos: torch.Tensor,
        sin: torch.Tensor,
        k_cache: torch.Tensor,
        v_cache: torch.Tensor,
        slots: torch.Tensor,
        num_heads: int,
    ) -> torch.Tensor:
        rows, (num_kv_heads, head_dim) = qkv.shape[0], k_cache.shape[1:]
        qk_width = (num_heads + num_kv_heads) * head_dim
        # RoPE on the query and key heads at once: they lie side by side in qkv.
        qk = qkv[:, :qk_width].view(rows, -1, head_dim)
        qk = qk * cos[:, None] + qk.roll(head_dim // 2, -1) * sin[:, None]
        write_slots(k_cache, slots, qk[:, num_heads:])
        write_slots(v_cache, slots, qkv[:, qk_width:].view(rows, num_kv_heads, head_dim))
        return qk[:, :num_heads]


@dataclass
class Layer:
    attn_norm: torch.Tensor
    qkv: Linear
    o: Linear
    ffn_norm: torch.Tensor
    gate_up: Linear
    down: Linear
    q_norm: torch.Tensor | None
    k_norm: torch.Tensor | None


class LlamaModel:
    """Norms, RoPE, the residual stream and decode attention math run in fp32; the linear
    layers in `dtype` (fp32 by default; bfloat16 halves weight traffic and, where oneDNN has
    AVX-512 BF16 or AMX, runs large batches much faster, at the cost there of batch
    invariance, and always of bit-equality with fp32). In bf16 the tensors between a linear
    layer and the next (SwiGLU, attention output) stay bf16. See model/linear.py for which
    kernel runs when, and docs/precision.md for what each dtype computes."""

    def __init__(
        self,
        config: ModelConfig,
        weights: Weights,  # taken over: its head and embedding are released once packed
        device: str = "cpu",
        dtype: torch.dtype = torch.float32,
        int8_activations: bool = False,
    ):
        self.config = config
        self.device = torch.device(device)
        kernel = linear_kernel(self.device.type)
        self.ops = fused_ops(self.device.type) or TorchOps
        self.dtype = dtype
        # torch's fp32 matmul (MKL) gives batch-independent rows only from 4 rows up; the kernel
        # at any count.
        self.min_batch_rows = 1 if kernel is not None else 4

        def fp32(t):
            return t.to(self.device, torch.float32)

        def lin(w, b=None):
            return Linear(w, b, dtype, self.device, kernel, int8_activations)

        self.lm_head = lin(weights.lm_head)
        self.embed, self.lookup = self._lookup(
            weights, self.lm_head, packed_rows_kernel(self.device.type)
        )
        # The model keeps what it needs of them: the loader's copies go before the layers are
        # packed, rather than stay beside them to the end of the load.
        weights.lm_head = weights.embed = None
        self.layers = []
        for w in weights.layers:
            self.layers.append(
                Layer(
                    fp32(w.attn_norm),
                    lin(w.qkv, w.qkv_bias),
                    lin(w.o),
                    fp32(w.ffn_norm),
                    lin(w.gate_up),
                    lin(w.down),
                    None if w.q_norm is None else fp32(w.q_norm),
                    None if w.k_norm is None else fp32(w.k_norm),
                )
            )
            del w  # its unpacked weights go before the next layer is read, not beside it
        self.final_norm = fp32(weights.final_norm)
        d = config.head_dim
        self.inv_freq = 1.0 / (
            config.rope_theta
            ** (torch.arange(0, d, 2, dtype=torch.float32, device=self.device) / d)
        )
        if config.rope_factors:
            self.inv_freq /= torch.tensor(config.rope_factors, device=self.device)
        self.scale = d**-0.5
        self.q_size = config.num_heads * d
        # With every kernel at hand and fp32 layers, a decode step's layers run in one C++ call
        # (which has no per-head Q/K norms, nor gguf-int8's rounding of x for 16-bit weights).
        bind_layers = (
            decode_layers(self.device.type)
            if kernel is not None
            and dtype == torch.float32
            and not config.qk_norm
            and not any(
                lin.round_to
                for layer in self.layers
                for lin in (layer.qkv, layer.o, layer.gate_up, layer.down)
            )
            else None
        )
        self.decode_layers = None
        if bind_layers is not None:
            no_bias = torch.empty(0)
            first = self.layers[0]
            self.decode_layers = bind_layers(
                [
                    t
                    for layer in self.layers
                    for t in (
                        layer.attn_norm,
                        layer.qkv.packed,
                        no_bias if layer.qkv.bias is None else layer.qkv.bias,
                        layer.o.packed,
                        layer.ffn_norm,
                        layer.gate_up.packed,
                        layer.down.packed,
                    )
                ],
                [lin.out_features for lin in (first.qkv, first.o, first.gate_up, first.down)],
                self.scale,
                config.rms_norm_eps,
                config.num_heads,
            )

    def rope(self, positions: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """cos and sin [T, D], the first half of sin negated: x * cos + x.roll(D/2) * sin is then
        HF's x * cos + rotate_half(x) * sin."""
        freqs = positions.float()[:, None] * self.inv_freq[None, :]
        return torch.cat((freqs, freqs), dim=-1).cos(), torch.cat(
            (-freqs.sin(), freqs.sin()), dim=-1
        )

    def _lookup(self, weights: Weights, head: Linear, packed_rows) -> tuple:
        """The embedding the model keeps (None: the output layer's) and its lookup, ids -> fp32
        rows. A tied embedding in blocks or 16 bits is read from the output layer's packed
        weights, so the matrix is held once; other blocks stay blocks, and a lookup decodes only
        its rows; other 16-bit tables stay 16-bit."""
        embed, hidden, packed = weights.embed, self.config.hidden_size, head.packed
        tied = weights.lm_head is embed and packed is not None
        if embed.dtype in HALF_TYPES.values():
            if tied and packed.dtype == embed.dtype:  # row i: column i % 32 of panel i // 32
                return None, lambda ids: packed[ids // PANEL, :, ids % PANEL].float()
            table = embed.to(self.device)  # kept 16-bit, widened exactly as looked up
            return table, lambda ids: table[ids].float()
        if embed.dtype != torch.uint8:
            table = embed.to(self.device, torch.float32)
            return table, lambda ids: table[ids]
        if (
            tied
            and packed_rows
            and packed.dtype in (torch.uint8, torch.int8)  # blocks, for fp32 or 8-bit activations
        ):
            return None, lambda ids: packed_rows(packed, ids, hidden)
        return embed, lambda ids: blocks_to_float(embed[ids])

    def norm_qk(self, qkv: torch.Tensor, layer: Layer) -> torch.Tensor:
        """Qwen3's RMSNorm over each query and key head of qkv; V passes through."""
        cfg, rows = self.config, qkv.shape[0]
        d, q_width = cfg.head_dim, self.q_size
        k_end = q_width + cfg.num_kv_heads * d

        def norm(x, weight):
            x = x.float().reshape(rows, -1, d)
            return F.rms_norm(x, (d,), weight, cfg.rms_norm_eps).flatten(1).to(qkv.dtype)

        return torch.cat(
            (
                norm(qkv[:, :q_width], layer.q_norm),
                norm(qkv[:, q_width:k_end], layer.k_norm),
                qkv[:, k_end:],
            ),
            dim=1,
        )

    @torch.inference_mode()
    def forward(
        self,
        input_ids: torch.Tensor,
        positions: torch.Tensor,
        meta: AttentionMetadata,
        kv_caches: list[tuple[torch.Tensor, torch.Tensor]],
        sample_rows: torch.Tensor,
    ) -> torch.Tensor:
        """Runs every row of the batch, each layer writing and reading its (K, V) pages of
        `kv_caches`; returns logits [len(sample_rows), vocab] for the rows to sample."""
        cfg = self.config
        num_rows = input_ids.shape[0]
        eps, ops = cfg.rms_norm_eps, self.ops
        cos, sin = self.rope(positions)
        # The fp32 residual stream; each layer's output is added in the next norm.
        x = self.lookup(input_ids)
        delta = None
        if (
            self.decode_layers is not None
            and meta.decode_kernel is not None
            and meta.num_decode == num_rows
        ):
            delta = self.decode_layers(
                x,
                kv_caches,
                cos,
                sin,
                meta.slot_mapping,
                meta.decode_block_table,
                meta.decode_lens,
                meta.page_size,
            )
        else:
            for layer, (k_cache, v_cache) in zip(self.layers, kv_caches):
                h = ops.add_rms_norm(x, delta, layer.attn_norm, eps, self.dtype)
                qkv = layer.qkv(h)
                if layer.q_norm is not None:
                    qkv = self.norm_qk(qkv, layer)
                q = ops.rope_write_kv(
                    qkv,
                    cos,
                    sin,
                    k_cache,
                    v_cache,
                    meta.slot_mapping,
                    cfg.num_heads,
                )
                attn = paged_attention(q, k_cache, v_cache, meta, self.scale, self.dtype)
                h = ops.add_rms_norm(
                    x,
                    layer.o(attn.view(num_rows, self.q_size)),
                    layer.ffn_norm,
                    eps,
                    self.dtype,
                )
                delta = layer.down(ops.silu_mul(layer.gate_up(h)))
        x = ops.add_rms_norm(x[sample_rows], delta[sample_rows], self.final_norm, eps, self.dtype)
        return self.lm_head(x)
