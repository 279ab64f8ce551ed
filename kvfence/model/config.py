"""Shape of a Llama-family model, read from a GGUF header or a Hugging Face config.json, and
the error for a model that cannot be read or run."""

from dataclasses import dataclass


class ModelLoadError(Exception):
    """A model kvfence does not run, or cannot read, and why."""


@dataclass(frozen=True)
class ModelConfig:
    architecture: str
    vocab_size: int
    hidden_size: int
    intermediate_size: int
    num_layers: int
    num_heads: int
    num_kv_heads: int
    head_dim: int
    rope_theta: float
    rms_norm_eps: float
    max_position_embeddings: int
    tie_word_embeddings: bool
    attention_bias: bool = False
    qk_norm: bool = False  # Qwen3: RMSNorm over each query and key head, before RoPE
    # End-of-sequence ids the model file declares; empty: the tokenizer's eos is used. Read
    # from the file because tokenizer converters have been seen to get it wrong.
    eos_token_ids: tuple[int, ...] = ()
    # What RoPE's inverse frequencies are divided by, one per frequency (Llama 3's scaling,
    # linear scaling, a GGUF file's rope_freqs); empty: plain RoPE.
    rope_factors: tuple[float, ...] = ()
    # Attention over the last `sliding_window` positions only; the engine refuses contexts
    # longer than it, where that would differ from full attention.
    sliding_window: int | None = None
