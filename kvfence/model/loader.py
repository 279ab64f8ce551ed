"""Find a model, and load its Llama-family weights from a GGUF file or a Hugging Face
safetensors directory.

Both formats end up as the same `Weights`: fp32 tensors in Hugging Face layout, with
the Q/K/V projections fused into one matrix and gate/up fused into another, so that a
layer runs two matmuls where it would otherwise run five.
"""

import json
import logging
from collections.abc import Callable, Iterator
from dataclasses import dataclass
from pathlib import Path

import numpy as np
import torch
from tqdm import tqdm

from kvfence.default_model import find_default_model
from kvfence.model.arch import (
    GGUF_ARCHITECTURES,
    check_shapes,
    check_tensors,
    gguf_model_config,
    hf_model_config,
    layer_names,
)
from kvfence.model.config import ModelConfig, ModelLoadError
from kvfence.model.gguf import SPLIT_NAME, drop_mapped_pages, open_gguf
from kvfence.model.memory import check_fits, kept_line, return_freed_heap
from kvfence.model.quant import (
    HALF_TYPES,
    INT8_BLOCK_TYPES,
    KEPT_TYPES,
    SUPER_BLOCK_TYPES,
    gguf_blocks,
    gguf_fp32,
    sub_blocks,
)

log = logging.getLogger("kvfence.loader")


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
    """The embedded model's GGUF file."""
    try:
        return find_default_model("pass --model PATH")
    except ValueError as e:
        raise ModelLoadError(str(e)) from None


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


def model_name(path: Path) -> str:
    """The name a model is served by: its directory's, or its file's without `.gguf` and a
    split part's `-00001-of-00003`."""
    if path.is_dir():
        return path.name
    split = SPLIT_NAME.fullmatch(path.name)
    return split[1] if split else path.stem


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
        t = {p + n: read(p + n) for n in layer_names(config, names)}
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


def _gguf_tensor_names(config: ModelConfig) -> set[str]:
    names = {"token_embd.weight", "output_norm.weight"}
    names |= set() if config.tie_word_embeddings else {"output.weight"}
    for i in range(config.num_layers):
        names |= {f"blk.{i}.{n}" for n in layer_names(config, _GGUF_LAYER_NAMES)}
    return names


def _gguf_linear_tensors(reader, config: ModelConfig) -> tuple[str, list]:
    """The output layer's name and the tensors of every linear layer, output layer included."""
    head = "token_embd.weight" if config.tie_word_embeddings else "output.weight"
    return head, [
        t for t in reader.tensors if t.name == head or t.name.endswith(_LINEAR_GGUF_NAMES)
    ]


def has_gguf_blocks(reader) -> bool:
    """Whether a GGUF file (its reader) has linear weights that --dtype gguf keeps as stored."""
    try:
        _, weights = _gguf_linear_tensors(reader, gguf_model_config(reader))
    except Exception:  # an unsupported model fails with a clear error when it is loaded
        return False
    return any(t.tensor_type.name in KEPT_TYPES for t in weights)


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
    config = gguf_model_config(reader)
    # the vocabulary's arrays, tens of MiB of numpy views for 128k tokens, which nothing reads
    # past the configuration (the tokenizer reads the file)
    for key in [k for k in reader.fields if k.startswith("tokenizer.ggml.")]:
        del reader.fields[key]
    check_tensors(
        path, {t.name for t in reader.tensors}, _gguf_tensor_names(config), ["rope_freqs.weight"]
    )
    by_name = {t.name: t for t in reader.tensors}
    check_shapes(
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
        check_fits(path, tensors, kept)
        quantized_rest = [t for t in tensors if t.name not in kept and t.tensor_type.name != "F32"]
        log.log(logging.WARNING if quantized_rest else logging.INFO, kept_line(path, tensors, kept))

    def read(name: str) -> torch.Tensor:
        t, kind = by_name[name], by_name[name].tensor_type.name
        if name not in kept:
            weight = gguf_fp32(t)
        elif kind in HALF_TYPES:  # gguf-py reads BF16 as raw bytes
            weight = torch.from_numpy(np.array(t.data).view(np.int16)).view(HALF_TYPES[kind])
        else:
            weight = gguf_blocks(t.data, kind)
        drop_mapped_pages(reader, t)
        return weight

    embed = read("token_embd.weight")
    weights = Weights(
        embed=embed,
        layers=_read_layers(
            config,
            read,
            "blk.",
            _GGUF_LAYER_NAMES,
            f"loading {path.name}",
            progress,
            unpermute=GGUF_ARCHITECTURES[config.architecture].permuted_qk,
        ),
        final_norm=gguf_fp32(by_name["output_norm.weight"]),
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
        expected |= {f"model.layers.{i}.{n}" for n in layer_names(config, _HF_LAYER_NAMES)}
    # a tied lm_head.weight may be saved too; inv_freq is RoPE's table, recomputed
    check_tensors(path, set(by_name), expected, ["lm_head.weight", "rotary_emb.inv_freq"])
    check_shapes(
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
