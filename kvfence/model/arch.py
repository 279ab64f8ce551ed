"""The model families kvfence runs, one entry each, and what a model file says of its shape
(GGUF metadata, config.json) read into a ModelConfig: every feature the forward pass does not
implement refused by key and value, and every tensor checked against the shape it gives."""

import math
from dataclasses import dataclass
from pathlib import Path

import numpy as np

from kvfence.model.config import ModelConfig, ModelLoadError


@dataclass(frozen=True)
class Architecture:
    """What sets one family apart. A new family is one entry in ARCHITECTURES, plus whatever
    the forward pass lacks for it."""

    model_type: str  # transformers' config class: it fills in the keys config.json leaves out
    # general.architecture of its GGUF files; None: llama.cpp writes them as another family's
    gguf_name: str | None = None
    qk_norm: bool = False  # RMSNorm over each query and key head before RoPE
    # Q/K/V biases whatever config.json's attention_bias says, as transformers builds the
    # family; None: as it says. A GGUF file has them where it has their tensors.
    attention_bias: bool | None = None
    sliding_every_layer: bool = False  # config.json's sliding_window is every layer's
    permuted_qk: bool = False  # its GGUF files hold Q/K rows in llama.cpp's order for its RoPE


# By config.json's architectures entry
ARCHITECTURES = {
    "LlamaForCausalLM": Architecture("llama", gguf_name="llama", permuted_qk=True),
    "Qwen2ForCausalLM": Architecture("qwen2", gguf_name="qwen2", attention_bias=True),
    "Qwen3ForCausalLM": Architecture("qwen3", gguf_name="qwen3", qk_norm=True),
    "MistralForCausalLM": Architecture("mistral", attention_bias=False, sliding_every_layer=True),
}
GGUF_ARCHITECTURES = {a.gguf_name: a for a in ARCHITECTURES.values() if a.gguf_name}


def gguf_model_config(reader) -> ModelConfig:
    from gguf.quants import dequantize
    from transformers.integrations.gguf.gguf_tokenizer_mapping import GGUF_PRE_TOKENIZER_SPLITS

    def field(key, default=None):
        f = reader.fields.get(key)
        if f is None:
            if default is None:
                raise ModelLoadError(f"GGUF file lacks '{key}'")
            return default
        return f.contents()

    def number(key, default=None, kind=int) -> int | float:
        """A hyperparameter: a positive number (llama.cpp also takes some as an array, a
        value per layer)."""
        value = field(key, default)
        if isinstance(value, list):
            raise ModelLoadError(f"{key} = {value}: a value per layer is not implemented")
        if (
            isinstance(value, bool)
            or not isinstance(value, int | float)
            or not math.isfinite(value)
            or value <= 0
        ):
            raise ModelLoadError(f"{key} = {value!r}: a positive finite number is needed")
        if kind is int and value != int(value):
            raise ModelLoadError(f"{key} = {value!r}: a whole number is needed")
        return kind(value)

    model = field("tokenizer.ggml.model")  # kvfence builds the tokenizer from its metadata
    if "tokenizer.ggml.tokens" not in reader.fields:
        raise ModelLoadError("GGUF file lacks 'tokenizer.ggml.tokens'")
    tokens = len(reader.fields["tokenizer.ggml.tokens"].data)
    for name in ("bos", "eos", "eot", "unknown", "padding"):  # those the tokenizer takes
        key = f"tokenizer.ggml.{name}_token_id"
        if key not in reader.fields:
            continue
        value = reader.fields[key].contents()
        if isinstance(value, bool) or not isinstance(value, int) or not 0 <= value < tokens:
            raise ModelLoadError(
                f"{key} = {value!r} is not one of the {tokens} tokens of tokenizer.ggml.tokens"
            )
    # transformers splits text as GPT-2 does for a name it does not know, which is right for
    # GPT-2's and SmolLM's (its vocabulary has no token of several digits) but no other
    pre = field("tokenizer.ggml.pre", "default")
    if model == "gpt2" and pre not in (*GGUF_PRE_TOKENIZER_SPLITS, "default", "gpt-2", "smollm"):
        raise ModelLoadError(
            f"tokenizer.ggml.pre = '{pre}' is not implemented: transformers would split text "
            f"as GPT-2 does, not as this vocabulary was trained"
        )
    arch = field("general.architecture")
    if arch not in GGUF_ARCHITECTURES:
        raise ModelLoadError(
            f"unsupported GGUF architecture '{arch}' (supported: {', '.join(GGUF_ARCHITECTURES)})"
        )
    hidden = number(f"{arch}.embedding_length")
    heads = number(f"{arch}.attention.head_count")
    head_dim = number(f"{arch}.attention.key_length", hidden // heads)
    for key, value in (
        (f"{arch}.attention.value_length", head_dim),
        (f"{arch}.rope.dimension_count", head_dim),
        (f"{arch}.expert_count", 0),
    ):
        if int(field(key, value)) != value:
            raise ModelLoadError(
                f"{key} = {field(key)} is not implemented (kvfence runs {key} = {value})"
            )
    rope_factors = ()
    # as llama.cpp reads them: the type is linear unless named, the factor's older key
    # rope.scale_linear, and a factor of 0 or 1 scales nothing
    factor = float(field(f"{arch}.rope.scaling.factor", field(f"{arch}.rope.scale_linear", 0.0)))
    scaling = field(f"{arch}.rope.scaling.type", "linear")
    if scaling == "linear":
        if factor not in (0.0, 1.0):
            rope_factors = (factor,) * (head_dim // 2)
    elif scaling != "none":
        raise ModelLoadError(
            f"{arch}.rope.scaling.type = '{scaling}' is not implemented (none and linear are)"
        )
    tensors = {t.name: t for t in reader.tensors}
    if "rope_freqs.weight" in tensors:  # Llama 3's scaling, as llama.cpp's converter writes it
        t = tensors["rope_freqs.weight"]
        freqs = dequantize(t.data, t.tensor_type).astype(np.float64).ravel()
        if freqs.size != head_dim // 2:
            raise ModelLoadError(
                f"rope_freqs.weight has {freqs.size} values, where a head of {head_dim} takes "
                f"{head_dim // 2}"
            )
        base = rope_factors or (1.0,) * freqs.size
        rope_factors = tuple(float(a * b) for a, b in zip(base, freqs))
    kv_heads = number(f"{arch}.attention.head_count_kv", heads)
    if heads % kv_heads:
        raise ModelLoadError(
            f"{arch}.attention.head_count_kv = {kv_heads} does not divide "
            f"{arch}.attention.head_count = {heads}"
        )
    vocab = number(f"{arch}.vocab_size", tokens)
    if vocab != tokens:  # llama.cpp's vocabulary is the tokens; the tensors must agree
        raise ModelLoadError(
            f"{arch}.vocab_size = {vocab}, but tokenizer.ggml.tokens has {tokens} tokens"
        )
    window = reader.fields.get(f"{arch}.attention.sliding_window")
    return ModelConfig(
        architecture=arch,
        vocab_size=vocab,
        hidden_size=hidden,
        intermediate_size=number(f"{arch}.feed_forward_length"),
        num_layers=number(f"{arch}.block_count"),
        num_heads=heads,
        num_kv_heads=kv_heads,
        head_dim=head_dim,
        rope_theta=number(f"{arch}.rope.freq_base", 10000.0, float),
        rms_norm_eps=number(f"{arch}.attention.layer_norm_rms_epsilon", kind=float),
        max_position_embeddings=number(f"{arch}.context_length"),
        tie_word_embeddings="output.weight" not in tensors,
        attention_bias="blk.0.attn_q.bias" in tensors,
        qk_norm=GGUF_ARCHITECTURES[arch].qk_norm,  # as llama.cpp: the tensors are then required
        eos_token_ids=tuple(
            int(reader.fields[k].contents())
            for k in ("tokenizer.ggml.eos_token_id", "tokenizer.ggml.eot_token_id")
            if k in reader.fields
        ),
        rope_factors=rope_factors,
        sliding_window=int(window.contents()) if window else None,
    )


def hf_model_config(raw: dict, generation: dict | None = None) -> ModelConfig:
    """`generation`: generation_config.json, whose eos_token_id adds to config.json's."""
    archs = [a for a in raw.get("architectures") or [] if a in ARCHITECTURES]
    if not archs:
        raise ModelLoadError(
            f"unsupported architecture {raw.get('architectures')}: kvfence runs "
            f"{sorted(ARCHITECTURES)}"
        )
    family = ARCHITECTURES[archs[0]]
    if raw.get("hidden_act") not in (None, "silu"):  # absent: the default, which is what runs
        raise _refuse("hidden_act", raw["hidden_act"], "kvfence runs hidden_act = 'silu'")
    if raw.get("mlp_bias"):
        raise _refuse("mlp_bias", True, "the MLP has no bias")
    quantization = raw.get("quantization_config")
    if quantization is not None:
        method = quantization.get("quant_method") if isinstance(quantization, dict) else None
        raise _refuse(
            "quantization_config.quant_method",
            method,
            "kvfence reads unquantized safetensors; quantized weights come as GGUF files",
        )
    hf = _transformers_config(raw, family)
    heads, kv_heads = hf.num_attention_heads, hf.num_key_value_heads or hf.num_attention_heads
    if heads % kv_heads:
        raise ModelLoadError(
            f"config.json: num_key_value_heads = {kv_heads} does not divide "
            f"num_attention_heads = {heads}"
        )
    head_dim = getattr(hf, "head_dim", None) or hf.hidden_size // heads
    rope = hf.rope_parameters
    try:
        theta, rope_factors = float(rope["rope_theta"]), hf_rope_factors(rope, head_dim)
    except (TypeError, ValueError, KeyError) as e:  # a value of another type, or none
        raise ModelLoadError(f"config.json: rope parameters {rope}: {e!r}") from e
    attention_bias = family.attention_bias
    if attention_bias is None:
        attention_bias = bool(getattr(hf, "attention_bias", False))
    return ModelConfig(
        architecture=archs[0],
        vocab_size=hf.vocab_size,
        hidden_size=hf.hidden_size,
        intermediate_size=hf.intermediate_size,
        num_layers=hf.num_hidden_layers,
        num_heads=heads,
        num_kv_heads=kv_heads,
        head_dim=head_dim,
        rope_theta=theta,
        rms_norm_eps=hf.rms_norm_eps,
        max_position_embeddings=hf.max_position_embeddings,
        tie_word_embeddings=bool(hf.tie_word_embeddings),
        attention_bias=attention_bias,
        qk_norm=family.qk_norm,
        eos_token_ids=tuple(
            dict.fromkeys(
                _ids(raw.get("eos_token_id")) + _ids((generation or {}).get("eos_token_id"))
            )
        ),
        rope_factors=rope_factors,
        sliding_window=_sliding_window(hf, family),
    )


def _ids(value) -> tuple[int, ...]:
    """An eos_token_id entry of config.json (an int, a list or null) as a tuple."""
    return tuple(value) if isinstance(value, list) else () if value is None else (value,)


def _refuse(key: str, value, supported: str) -> ModelLoadError:
    return ModelLoadError(f"config.json: {key} = {value!r} is not implemented ({supported})")


def _sliding_window(hf, family: Architecture) -> int | None:
    """The window of the layers that slide, if any do: Mistral's every layer (transformers
    reads no layer_types or use_sliding_window for it); Qwen's where layer_types says so."""
    layer_types = getattr(hf, "layer_types", None) or ()
    if not family.sliding_every_layer and "sliding_attention" not in layer_types:
        return None
    return getattr(hf, "sliding_window", None)


def _transformers_config(raw: dict, family: Architecture):
    """config.json as transformers reads it: its family's config class fills in each key the
    file leaves out (Mistral's 4096-token window, Qwen3's head_dim of 128)."""
    from transformers import CONFIG_MAPPING

    try:
        return CONFIG_MAPPING[family.model_type].from_dict(raw)
    except Exception as e:  # transformers' validation raises its own errors too
        raise ModelLoadError(f"config.json: {e}") from e


def hf_rope_factors(rope: dict, head_dim: int) -> tuple[float, ...]:
    """config.json's rope scaling (transformers' rope_parameters) as divisors of RoPE's
    inverse frequencies."""
    if rope.get("partial_rotary_factor", 1.0) != 1.0:
        raise _refuse(
            "partial_rotary_factor", rope["partial_rotary_factor"], "kvfence turns every dimension"
        )
    kind = rope.get("rope_type", "default")
    if kind == "default":
        return ()
    if kind == "linear":
        return (float(rope["factor"]),) * (head_dim // 2)
    if kind == "llama3":
        return llama3_rope_factors(
            head_dim,
            float(rope["rope_theta"]),
            float(rope["factor"]),
            float(rope["low_freq_factor"]),
            float(rope["high_freq_factor"]),
            int(rope["original_max_position_embeddings"]),
        )
    # dynamic NTK changes the frequencies with the sequence length, after the keys are cached
    raise _refuse("rope_scaling.rope_type", kind, "default, linear and llama3 are")


def llama3_rope_factors(
    head_dim: int,
    theta: float,
    factor: float,
    low_freq_factor: float,
    high_freq_factor: float,
    original_max_position_embeddings: int,
) -> tuple[float, ...]:
    """Llama 3's RoPE scaling as divisors of the inverse frequencies (what llama.cpp's converter
    writes as rope_freqs): long wavelengths slow down by `factor`, short ones keep theirs, and
    those between are interpolated."""
    old = original_max_position_embeddings
    factors = []
    for i in range(0, head_dim, 2):
        wavelen = 2 * math.pi * theta ** (i / head_dim)
        if wavelen < old / high_freq_factor:
            factors.append(1.0)
        elif wavelen > old / low_freq_factor:
            factors.append(factor)
        else:
            smooth = (old / wavelen - low_freq_factor) / (high_freq_factor - low_freq_factor)
            factors.append(1 / ((1 - smooth) / factor + smooth))
    return tuple(factors)


def layer_names(config: ModelConfig, names: dict[str, str]) -> list[str]:
    """The tensor names of one layer that the model reads."""
    keys = ["attn_norm", "q", "k", "v", "o", "ffn_norm", "gate", "up", "down"]
    keys += ["q_bias", "k_bias", "v_bias"] if config.attention_bias else []
    keys += ["q_norm", "k_norm"] if config.qk_norm else []
    return [names[k] for k in keys]


def check_tensors(path: Path, found: set[str], expected: set[str], ignored=()) -> None:
    """Every tensor the model reads is there, and no tensor is left unread: an unread tensor
    is a feature (a bias, an extra norm, experts) that would otherwise be silently dropped."""
    missing = sorted(expected - found)
    if missing:
        raise ModelLoadError(f"{path.name} lacks tensors {missing[:3]} ({len(missing)} missing)")
    unread = sorted(n for n in found - expected if not n.endswith(tuple(ignored)))
    if unread:
        raise ModelLoadError(
            f"{path.name} has tensors kvfence does not implement: {unread[:3]} "
            f"({len(unread)} in all)"
        )


def check_shapes(
    path: Path,
    config: ModelConfig,
    found: dict[str, tuple],
    names: dict[str, str],
    *,
    prefix: str,
    embed: str,
    final_norm: str,
    head: str,
) -> None:
    """Every tensor has the shape the configuration gives it ([rows, columns], or [n]): a
    file whose heads are not the configuration's (a head_dim left out) would otherwise load
    and then fail in its first request, or run wrong. `names`: a layer's tensors by role,
    under `prefix` + the layer's number; then the names of the other tensors."""
    c = config
    hidden, q, kv = c.hidden_size, c.num_heads * c.head_dim, c.num_kv_heads * c.head_dim
    mlp = c.intermediate_size
    by_role = {
        "attn_norm": (hidden,),
        "ffn_norm": (hidden,),
        "q": (q, hidden),
        "k": (kv, hidden),
        "v": (kv, hidden),
        "o": (hidden, q),
        "gate": (mlp, hidden),
        "up": (mlp, hidden),
        "down": (hidden, mlp),
        "q_bias": (q,),
        "k_bias": (kv,),
        "v_bias": (kv,),
        "q_norm": (c.head_dim,),
        "k_norm": (c.head_dim,),
    }
    expected = {embed: (c.vocab_size, hidden), head: (c.vocab_size, hidden), final_norm: (hidden,)}
    for i in range(c.num_layers):
        expected |= {f"{prefix}{i}.{names[k]}": shape for k, shape in by_role.items()}
    wrong = [(n, found[n], s) for n, s in expected.items() if n in found and found[n] != s]
    if wrong:
        name, shape, want = wrong[0]
        raise ModelLoadError(
            f"{path.name}: {name} is {list(shape)}, where the configuration makes it {list(want)} "
            f"(hidden size {hidden}, {c.num_heads} heads and {c.num_kv_heads} KV heads of "
            f"head_dim {c.head_dim}, MLP {mlp}, vocabulary {c.vocab_size}); "
            f"{len(wrong)} tensors differ"
        )
