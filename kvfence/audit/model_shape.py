"""What `kvfence check-config` needs of a model: the shape of its KV cache and its trained
context, read from config.json or a GGUF file's metadata, without loading the model (nor torch).
"""

import json
import mmap
import struct
from dataclasses import dataclass
from pathlib import Path


@dataclass(frozen=True)
class ModelShape:
    num_layers: int
    num_kv_heads: int
    head_dim: int
    max_position_embeddings: int


def read_model_shape(path: Path) -> ModelShape:
    """From a GGUF file, config.json or a directory holding it; OSError or ValueError naming
    what is missing."""
    if path.is_dir():
        path = path / "config.json"
    if path.suffix == ".gguf":
        return _shape(_gguf_values(path))
    raw = json.loads(path.read_text())
    if not isinstance(raw, dict):
        raise ValueError("config.json is not a JSON object")
    return _shape({key: (f"config.json's {key}", raw.get(key)) for key in GGUF_KEYS})


# config.json's keys, as a GGUF file names them (llama.cpp's LLM_KV names)
GGUF_KEYS = {
    "num_hidden_layers": "{arch}.block_count",
    "num_attention_heads": "{arch}.attention.head_count",
    "num_key_value_heads": "{arch}.attention.head_count_kv",
    "head_dim": "{arch}.attention.key_length",
    "hidden_size": "{arch}.embedding_length",
    "max_position_embeddings": "{arch}.context_length",
}


def _gguf_values(path: Path) -> dict[str, tuple[str, object]]:
    """GGUF_KEYS' values in the file's metadata, by config.json's key: (its name there, value)."""
    metadata = gguf_metadata(path)
    arch = metadata.get("general.architecture")
    if not isinstance(arch, str):
        raise ValueError("the GGUF file lacks general.architecture")
    names = {key: name.format(arch=arch) for key, name in GGUF_KEYS.items()}
    return {key: (name, metadata.get(name)) for key, name in names.items()}


def gguf_metadata(path: Path) -> dict[str, object]:
    """A GGUF file's key-value metadata, arrays left out (None), read from its header alone:
    gguf's own reader also reads the tensor index and every element of every array, seconds
    for a vocabulary of 100k tokens."""
    from gguf import GGUFValueType as T

    formats = {
        T.UINT8: "B",
        T.INT8: "b",
        T.UINT16: "H",
        T.INT16: "h",
        T.UINT32: "I",
        T.INT32: "i",
        T.FLOAT32: "f",
        T.BOOL: "?",
        T.UINT64: "Q",
        T.INT64: "q",
        T.FLOAT64: "d",
    }
    with open(path, "rb") as f, mmap.mmap(f.fileno(), 0, access=mmap.ACCESS_READ) as data:
        at, order = 0, "<"

        def take(fmt: str):
            nonlocal at
            (value,) = struct.unpack_from(order + fmt, data, at)
            at += struct.calcsize(order + fmt)
            return value

        def value(kind: T):
            nonlocal at
            if kind == T.STRING:
                length = take("Q")
                at += length
                return bytes(data[at - length : at]).decode("utf-8", "replace")
            if kind != T.ARRAY:
                return take(formats[kind])
            item, count = T(take("I")), take("Q")
            if item in formats:
                at += count * struct.calcsize(order + formats[item])
            else:  # strings and arrays: each has its own length
                for _ in range(count):
                    value(item)
            return None

        try:
            if take("4s") != b"GGUF":
                raise ValueError("no GGUF magic number")
            if not take("I") & 0xFFFF:  # a big-endian file's version, read little-endian
                order = ">"
            take("Q")  # the tensors, indexed after the metadata
            return {value(T.STRING): value(T(take("I"))) for _ in range(take("Q"))}
        except (struct.error, ValueError) as e:  # ValueError: a type GGUF does not define
            raise ValueError(f"not a readable GGUF file: {e}") from e


def _shape(values: dict[str, tuple[str, object]]) -> ModelShape:
    """The shape from config.json's keys, with its defaults where a key is absent: as many KV
    heads as heads, heads of hidden_size / heads dimensions."""

    def whole(key: str) -> int:
        name, value = values[key]
        if isinstance(value, bool) or not isinstance(value, int) or value <= 0:
            raise ValueError(f"{name} = {value!r}: a positive whole number is needed")
        return value

    def given(key: str) -> bool:
        return values[key][1] is not None

    heads = whole("num_attention_heads")
    return ModelShape(
        num_layers=whole("num_hidden_layers"),
        num_kv_heads=whole("num_key_value_heads") if given("num_key_value_heads") else heads,
        head_dim=whole("head_dim") if given("head_dim") else whole("hidden_size") // heads,
        max_position_embeddings=whole("max_position_embeddings"),
    )
