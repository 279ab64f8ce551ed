"""Llama-family forward pass (Llama, SmolLM, Qwen2 shapes) over the paged KV pool."""
import torch
import torch.nn.functional as F

from kvfence.kv.pool import KVPool
from kvfence.model.attention import AttentionMetadata, paged_attention, write_kv
from kvfence.model.config import ModelConfig
from kvfence.model.loader import Weights


def rms_norm(x: torch.Tensor, weight: torch.Tensor, eps: float) -> torch.Tensor:
    return x * torch.rsqrt(x.pow(2).mean(-1, keepdim=True) + eps) * weight


def rotate_half(x: torch.Tensor) -> torch.Tensor:
    half = x.shape[-1] // 2
    return torch.cat((-x[..., half:], x[..., :half]), dim=-1)


def linear(x: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None = None) -> torch.Tensor:
    """x @ weight.T in the weight's dtype; the result comes back in x's dtype (fp32)."""
    return F.linear(x.to(weight.dtype), weight, bias).to(x.dtype)


class LlamaModel:
    """Norms, RoPE, the residual stream and attention run in fp32; the linear layers in
    `dtype` (fp32 by default; bfloat16 roughly triples matmul speed where oneDNN has
    AVX-512 BF16 or AMX, at the cost of batch invariance and of bit-equality with fp32)."""

    LINEAR = ("qkv", "qkv_bias", "o", "gate_up", "down")

    def __init__(self, config: ModelConfig, weights: Weights, device: str = "cpu", dtype: torch.dtype = torch.float32):
        self.config = config
        self.device = torch.device(device)
        move = lambda t, dt=torch.float32: None if t is None else t.to(self.device, dt)  # noqa: E731
        self.embed = move(weights.embed)
        self.layers = [type(layer)(**{k: move(v, dtype if k in self.LINEAR else torch.float32)
                                      for k, v in vars(layer).items()}) for layer in weights.layers]
        self.final_norm = move(weights.final_norm)
        self.lm_head = move(weights.lm_head, dtype)
        d = config.head_dim
        self.inv_freq = 1.0 / (config.rope_theta ** (torch.arange(0, d, 2, dtype=torch.float32, device=self.device) / d))
        self.scale = d ** -0.5
        self.q_size = config.num_heads * d
        self.kv_size = config.num_kv_heads * d

    def rope(self, positions: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        freqs = positions.float()[:, None] * self.inv_freq[None, :]
        emb = torch.cat((freqs, freqs), dim=-1)
        return emb.cos()[:, None, :], emb.sin()[:, None, :]

    @torch.inference_mode()
    def forward(self, input_ids: torch.Tensor, positions: torch.Tensor, meta: AttentionMetadata,
                kv: KVPool, sample_rows: torch.Tensor) -> torch.Tensor:
        """Runs every row of the batch; returns logits [len(sample_rows), vocab] for the rows to sample."""
        cfg = self.config
        num_rows = input_ids.shape[0]
        cos, sin = self.rope(positions)
        x = self.embed[input_ids]
        for i, layer in enumerate(self.layers):
            h = rms_norm(x, layer.attn_norm, cfg.rms_norm_eps)
            qkv = linear(h, layer.qkv, layer.qkv_bias)
            # RoPE on the query and key heads at once: they lie side by side in qkv.
            qk = qkv[:, :self.q_size + self.kv_size].view(num_rows, cfg.num_heads + cfg.num_kv_heads, cfg.head_dim)
            qk = qk * cos + rotate_half(qk) * sin
            q, k = qk[:, :cfg.num_heads], qk[:, cfg.num_heads:]
            v = qkv[:, self.q_size + self.kv_size:].view(num_rows, cfg.num_kv_heads, cfg.head_dim)
            write_kv(kv.k[i], kv.v[i], k, v, meta)
            attn = paged_attention(q, kv.k[i], kv.v[i], meta, self.scale)
            x = x + linear(attn.view(num_rows, self.q_size), layer.o)
            h = rms_norm(x, layer.ffn_norm, cfg.rms_norm_eps)
            gate, up = linear(h, layer.gate_up).chunk(2, dim=-1)
            x = x + linear(F.silu(gate) * up, layer.down)
        x = rms_norm(x[sample_rows], self.final_norm, cfg.rms_norm_eps)
        return linear(x, self.lm_head)
