"""What the loader refuses: every model feature kvfence does not implement is named, with its
value, instead of being run approximately."""

import json
import shutil

import gguf
import pytest

from helpers import save_tiny_gguf, save_tiny_model
from kvfence import LLM
from kvfence.config import ConfigError
from kvfence.model.loader import ModelLoadError, llama3_rope_factors


def edited_copy(src, dst, **edits):
    shutil.copytree(src, dst)
    raw = json.loads((dst / "config.json").read_text())
    (dst / "config.json").write_text(json.dumps(raw | edits))
    return dst


@pytest.mark.parametrize(
    "edits, message",
    [
        (
            {"rope_parameters": {"rope_type": "yarn", "factor": 4.0, "rope_theta": 1e4}},
            "rope_scaling.rope_type = 'yarn' is not implemented",
        ),
        (
            {"rope_parameters": {"rope_type": "dynamic", "factor": 2.0, "rope_theta": 1e4}},
            "rope_scaling.rope_type = 'dynamic'",
        ),
        ({"hidden_act": "gelu"}, "hidden_act = 'gelu' is not implemented"),
        ({"mlp_bias": True}, "mlp_bias = True"),
        ({"partial_rotary_factor": 0.5}, "partial_rotary_factor = 0.5"),
    ],
)
def test_unimplemented_config_keys_are_refused_by_name(tiny_llama_dir, tmp_path, edits, message):
    path = edited_copy(tiny_llama_dir, tmp_path / "model", **edits)
    with pytest.raises(ModelLoadError, match=message):
        LLM(str(path))


def test_tensors_the_model_would_drop_are_refused(default_model_path, tmp_path_factory, tokenizer):
    """Llama with attention_bias also has an output-projection bias; a loader that fused Q/K/V's
    biases and skipped o_proj's would run a different model."""
    path = save_tiny_model(tmp_path_factory, tokenizer, "llama", attention_bias=True)
    with pytest.raises(
        ModelLoadError, match=r"does not implement: \['model.layers.0.self_attn.o_proj"
    ):
        LLM(str(path))
    gguf_path = save_tiny_gguf(path, path.parent / "m.gguf", default_model_path)
    with pytest.raises(ModelLoadError, match=r"does not implement: \['blk.0.attn_output.bias'"):
        LLM(str(gguf_path))


U32, STR = gguf.GGUFValueType.UINT32, gguf.GGUFValueType.STRING


@pytest.mark.parametrize(
    "metadata, message",
    [
        ({"expert_count": (8, U32)}, "llama.expert_count = 8 is not implemented"),
        ({"rope.dimension_count": (8, U32)}, "llama.rope.dimension_count = 8"),
        ({"attention.value_length": (32, U32)}, "llama.attention.value_length = 32"),
        ({"rope.scaling.type": ("yarn", STR)}, "llama.rope.scaling.type = 'yarn'"),
    ],
)
def test_unimplemented_gguf_keys_are_refused_by_name(
    tiny_llama_dir, default_model_path, tmp_path, metadata, message
):
    path = save_tiny_gguf(tiny_llama_dir, tmp_path / "m.gguf", default_model_path, metadata)
    with pytest.raises(ModelLoadError, match=message):
        LLM(str(path))


def test_gguf_linear_rope_scaling_slows_every_frequency(
    tiny_llama_dir, default_model_path, tmp_path
):
    f32 = gguf.GGUFValueType.FLOAT32
    path = save_tiny_gguf(
        tiny_llama_dir,
        tmp_path / "m.gguf",
        default_model_path,
        {"rope.scaling.type": ("linear", STR), "rope.scaling.factor": (4.0, f32)},
    )
    assert LLM(str(path)).engine.model_config.rope_factors == (4.0,) * 8


def test_mistral_context_stops_at_its_sliding_window(tiny_model):
    """Within the window, sliding attention is full attention; a longer context is refused
    with the window named, from either file format."""
    for fmt in ("safetensors", "gguf"):
        assert LLM(str(tiny_model("mistral", fmt))).engine.max_model_len == 32
        with pytest.raises(ConfigError, match="over the model's 32 sliding_window"):
            LLM(str(tiny_model("mistral", fmt)), max_model_len=64)


def test_llama3_rope_factors_follow_the_three_bands():
    """Wavelengths under 64/4 keep their frequency, over 64/1 slow down 8 times, and those
    between are interpolated smoothly."""
    factors = llama3_rope_factors(16, 1e4, 8.0, 1.0, 4.0, 64)
    assert factors[0] == 1.0 and factors[-1] == 8.0
    assert all(1.0 < f < 8.0 for f in factors if f not in (1.0, 8.0))
    assert list(factors) == sorted(factors) and len(set(factors)) > 3
