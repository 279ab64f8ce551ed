"""Shape of a Llama-family model, read from a GGUF header or a Hugging Face config.json, and
the error for a model that cannot be read or run."""

import math
from dataclasses import dataclass, fields


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

    def __post_init__(self):
        """A hyperparameter no step can run with is refused at load, not in every step."""
        for f in fields(self):
            value = getattr(self, f.name)
            if f.type is int and (
                isinstance(value, bool) or not isinstance(value, int) or value <= 0
            ):
                raise ModelLoadError(f"{f.name} = {value!r}: a positive whole number is needed")
            if f.type is float and not (
                isinstance(value, int | float) and math.isfinite(value) and value > 0
            ):
                raise ModelLoadError(f"{f.name} = {value!r}: a positive finite number is needed")
        if self.head_dim % 2:
            raise ModelLoadError(
                f"head_dim = {self.head_dim}: rotary embeddings turn pairs of values, so a "
                f"head needs an even size"
            )
        if not all(math.isfinite(f) and f > 0 for f in self.rope_factors):
            raise ModelLoadError(
                f"rope_factors ({', '.join(map(str, self.rope_factors[:3]))}, ...): positive "
                f"finite values are needed"
            )
        if self.sliding_window is not None and self.sliding_window <= 0:
            raise ModelLoadError(f"sliding_window = {self.sliding_window}: a positive window")
