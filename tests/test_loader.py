"""What the loader refuses: every model feature kvfence does not implement is named, with its
value, instead of being run approximately. And what it keeps of a GGUF file's blocks."""

import json
import logging
import os
import shutil
import subprocess
import sys

import gguf
import numpy as np
import pytest
import torch

from helpers import edited_config, save_tiny_gguf, save_tiny_model
from kvfence import LLM, SamplingParams
from kvfence.config import ConfigError
from kvfence.model.arch import llama3_rope_factors
from kvfence.model.config import ModelLoadError
from kvfence.model.gguf import open_gguf
from kvfence.model.quant import HALF_TYPES


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
        # these loaded, then failed every step
        (
            {"rope_parameters": {"rope_type": "default", "rope_theta": float("nan")}},
            "rope_theta = nan: a positive finite number",
        ),
        ({"partial_rotary_factor": 0.5}, "partial_rotary_factor = 0.5"),
        (
            {"rope_parameters": {"rope_type": "default", "partial_rotary_factor": 0.5}},
            "partial_rotary_factor = 0.5",
        ),
        (
            {"quantization_config": {"quant_method": "gptq", "bits": 4}},
            "quantization_config.quant_method = 'gptq' is not implemented",
        ),
    ],
)
def test_unimplemented_config_keys_are_refused_by_name(tiny_llama_dir, tmp_path, edits, message):
    path = edited_config(tiny_llama_dir, tmp_path / "model", **edits)
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


U32, F32, STR = gguf.GGUFValueType.UINT32, gguf.GGUFValueType.FLOAT32, gguf.GGUFValueType.STRING
NAN, INF = float("nan"), float("inf")


@pytest.mark.parametrize(
    "metadata, message",
    [
        ({"expert_count": (8, U32)}, "llama.expert_count = 8 is not implemented"),
        ({"rope.dimension_count": (8, U32)}, "llama.rope.dimension_count = 8"),
        ({"attention.value_length": (32, U32)}, "llama.attention.value_length = 32"),
        ({"rope.scaling.type": ("yarn", STR)}, "llama.rope.scaling.type = 'yarn'"),
        # these crashed with a traceback, in the tokenizer's conversion or the configuration
        (
            {"tokenizer.ggml.eos_token_id": (49157, U32)},
            "tokenizer.ggml.eos_token_id = 49157 is not one of the 49152 tokens",
        ),
        ({"attention.head_count": (0, U32)}, "llama.attention.head_count = 0: a positive"),
        (
            {"attention.layer_norm_rms_epsilon": ("1e-5", STR)},
            "llama.attention.layer_norm_rms_epsilon = '1e-5': a positive finite number",
        ),
        # these loaded, then failed every step
        ({"rope.freq_base": (NAN, F32)}, "llama.rope.freq_base = nan: a positive finite"),
        (
            {"attention.layer_norm_rms_epsilon": (INF, F32)},
            "llama.attention.layer_norm_rms_epsilon = inf: a positive finite",
        ),
        ({"rope.scaling.factor": (NAN, F32)}, r"rope_factors \(nan, .*\): positive finite"),
        (
            {k: (15, U32) for k in ("attention.key_length", "attention.value_length")}
            | {"rope.dimension_count": (15, U32)},
            "head_dim = 15: rotary embeddings turn pairs",
        ),
        # these ran: a token id with no token, text split as GPT-2's
        (
            {"vocab_size": (49153, U32)},
            "llama.vocab_size = 49153, but tokenizer.ggml.tokens has 49152 tokens",
        ),
        (
            {"tokenizer.ggml.pre": ("no-such-split", STR)},
            "tokenizer.ggml.pre = 'no-such-split' is not implemented",
        ),
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


def test_mistral_slides_as_transformers_does_without_a_window_or_with_use_sliding_window_off(
    tiny_model, tmp_path
):
    """transformers' Mistral slides every layer, reads no use_sliding_window, and takes a
    window of 4096 where config.json leaves sliding_window out."""
    off = edited_config(tiny_model("mistral"), tmp_path / "off", use_sliding_window=False)
    with pytest.raises(ConfigError, match="over the model's 32 sliding_window"):
        LLM(str(off), max_model_len=64)
    missing = edited_config(
        tiny_model("mistral"),
        tmp_path / "missing",
        drop=["sliding_window"],
        max_position_embeddings=8192,
    )
    with pytest.raises(ConfigError, match="over the model's 4096 sliding_window"):
        LLM(str(missing), max_model_len=5000)


def test_kv_heads_that_do_not_divide_the_heads_are_refused(
    tmp_path_factory, tokenizer, default_model_path
):
    """Such a model loaded, ran its prompt, then failed at its first decode step."""
    path = save_tiny_model(tmp_path_factory, tokenizer, "llama", num_key_value_heads=3)
    with pytest.raises(
        ModelLoadError, match="num_key_value_heads = 3 does not divide num_attention_heads = 4"
    ):
        LLM(str(path))
    gguf_path = save_tiny_gguf(path, path.parent / "m.gguf", default_model_path)
    with pytest.raises(
        ModelLoadError,
        match="llama.attention.head_count_kv = 3 does not divide llama.attention.head_count = 4",
    ):
        LLM(str(gguf_path))


def test_tensors_of_other_shapes_than_the_configuration_are_refused(
    tiny_llama_dir, default_model_path, tmp_path
):
    """A head_dim the configuration gets wrong would read the heads wrong, or fail in the
    first request: the load names the first tensor that differs, and the configuration."""
    path = edited_config(tiny_llama_dir, tmp_path / "model", head_dim=32)
    with pytest.raises(
        ModelLoadError,
        match=r"model.layers.0.self_attn.q_proj.weight is \[64, 64\], where the configuration "
        r"makes it \[128, 64\] \(.* heads of head_dim 32",
    ):
        LLM(str(path))
    metadata = {
        key: (32, U32)
        for key in ("attention.key_length", "attention.value_length", "rope.dimension_count")
    }
    gguf_path = save_tiny_gguf(tiny_llama_dir, tmp_path / "m.gguf", default_model_path, metadata)
    with pytest.raises(ModelLoadError, match=r"blk.0.attn_q.weight is \[64, 64\], where"):
        LLM(str(gguf_path))


def test_qwen3s_q_k_norms_go_with_its_gguf_architecture(tiny_model, default_model_path, tmp_path):
    """As llama.cpp reads them: a qwen3 file without its norms is refused rather than run
    without them, and a llama file with them is refused rather than run with them."""
    without = save_tiny_gguf(
        tiny_model("llama"), tmp_path / "q.gguf", default_model_path, arch="qwen3"
    )
    with pytest.raises(ModelLoadError, match=r"lacks tensors \['blk.0.attn_k_norm.weight'"):
        LLM(str(without))
    extra = save_tiny_gguf(
        tiny_model("qwen3"), tmp_path / "l.gguf", default_model_path, arch="llama"
    )
    with pytest.raises(ModelLoadError, match=r"does not implement: \['blk.0.attn_k_norm.weight'"):
        LLM(str(extra))


def test_a_bf16_rope_freqs_tensor_is_read_as_its_values(tiny_model, default_model_path, tmp_path):
    """gguf-py hands BF16 tensors over as raw bytes; they were once counted as two values each."""
    hf_dir = tiny_model("llama3")
    f32 = save_tiny_gguf(hf_dir, tmp_path / "f32.gguf", default_model_path)
    bf16 = save_tiny_gguf(
        hf_dir, tmp_path / "bf16.gguf", default_model_path, types={"rope_freqs.weight": "BF16"}
    )
    exact = torch.tensor(LLM(str(f32)).engine.model_config.rope_factors)
    rounded = LLM(str(bf16)).engine.model_config.rope_factors
    assert rounded == tuple(exact.bfloat16().double().tolist())
    assert rounded != tuple(exact.tolist())  # the rounding shows: BF16 was read, not F32


def test_llama3_rope_factors_follow_the_three_bands():
    """Wavelengths under 64/4 keep their frequency, over 64/1 slow down 8 times, and those
    between are interpolated smoothly."""
    factors = llama3_rope_factors(16, 1e4, 8.0, 1.0, 4.0, 64)
    assert factors[0] == 1.0 and factors[-1] == 8.0
    assert all(1.0 < f < 8.0 for f in factors if f not in (1.0, 8.0))
    assert list(factors) == sorted(factors) and len(set(factors)) > 3


MIXES = {
    # Q4_K_M's pattern: Q4_K for most weights, more bits for V, the FFN's down projection and
    # the output layer. K-quants need rows of 256, hence the wider model.
    "k-quants": (
        {"hidden_size": 256, "intermediate_size": 512},
        {"attn_v.weight": "Q6_K", "ffn_down.weight": "Q5_K", "output.weight": "Q6_K", "*": "Q4_K"},
        ["Q4_K", "Q5_K", "Q6_K"],  # Q/K/V too: a table of Q4_K and Q6_K panels
        [],
    ),
    "legacy": (
        {},
        {
            "attn_q.weight": "Q5_0",
            "attn_k.weight": "Q4_0",
            "attn_v.weight": "Q8_0",
            "ffn_gate.weight": "Q5_1",
            "ffn_down.weight": "F16",
            "output.weight": "BF16",
            "*": "Q4_1",
        },
        ["Q5_0", "Q4_0", "Q8_0", "Q5_1", "Q4_1", "F16", "BF16"],  # 16-bit floats stay 16-bit
        [],
    ),
    "unsupported": ({}, {"attn_output.weight": "MXFP4", "*": "Q8_0"}, ["Q8_0"], ["MXFP4"]),
}


@pytest.mark.parametrize("mix", MIXES)
def test_gguf_type_mixes_run_in_blocks_with_float32s_bits(
    mix, tmp_path_factory, tokenizer, default_model_path, caplog
):
    """--dtype auto keeps every type it runs as stored and dequantizes the rest, says so in
    one line, and gives --dtype float32's logprobs bit for bit; gguf-int8 names the tensor
    it cannot run."""
    shape, types, kept, dequantized = MIXES[mix]
    hf_dir = save_tiny_model(tmp_path_factory, tokenizer, "llama", **shape)
    path = save_tiny_gguf(hf_dir, hf_dir.parent / f"{mix}.gguf", default_model_path, types=types)
    small = dict(page_size=5, num_kv_pages=200, max_num_batched_tokens=16, max_num_seqs=8)
    with caplog.at_level(logging.INFO, "kvfence.loader"):
        blocks = LLM(str(path), **small)
    assert blocks.engine.config.dtype == "gguf"
    assert blocks.engine.runner.model.embed.dtype == torch.uint8  # rows decoded as looked up
    (record,) = [r for r in caplog.records if "kept as stored" in r.getMessage()]
    line = record.getMessage()
    # a warning, with the cost, where a type it does not keep in blocks is dequantized
    assert (record.levelno == logging.WARNING) == bool(dequantized)
    assert ("x their bytes in the file" in line) == bool(dequantized)
    kept_part, _, dequantized_part = line.partition("dequantized to float32")
    assert all(f" {kind} (" in kept_part for kind in kept)
    assert all(f" {kind} (" in dequantized_part for kind in dequantized)
    assert bool(dequantized_part) == bool(dequantized)
    params = SamplingParams(temperature=0, max_tokens=8, ignore_eos=True, logprobs=3)
    prompts = ["hello", "a longer prompt that needs chunks of prefill", "x y z w"]
    fp32 = LLM(str(path), dtype="float32", **small)
    assert [o.outputs[0].logprobs for o in blocks.generate(prompts, params)] == [
        o.outputs[0].logprobs for o in fp32.generate(prompts, params)
    ]
    if dequantized:
        with pytest.raises(
            ModelLoadError,
            match=r"gguf-int8 runs on Q4_0, .*, Q6_K blocks and F16, BF16; \S+ is MXFP4",
        ):
            LLM(str(path), dtype="gguf-int8", **small)
        return
    int8 = LLM(str(path), dtype="gguf-int8", **small)
    for llm in (blocks, int8):
        model = llm.engine.runner.model
        if mix == "legacy":  # F16 and BF16 kept as stored; gguf-int8 rounds x to their type
            assert model.layers[0].down.packed.dtype == torch.float16
            assert model.lm_head.packed.dtype == torch.bfloat16
            assert (model.lm_head.round_to is not None) == (llm is int8)
    if mix == "k-quants":  # a fused Q/K/V of Q4_K and Q6_K rows: one table of both types
        for llm, dtype in ((blocks, torch.uint8), (int8, torch.int8)):
            qkv = llm.engine.runner.model.layers[0].qkv.packed
            assert qkv.dtype == dtype and qkv.dim() == 1
    ours, exact = (
        [o.outputs[0].logprobs[0] for o in llm.generate(prompts, params)] for llm in (int8, fp32)
    )
    for a, b in zip(ours, exact):
        assert b["token_id"] in [t for t, _ in a["top"]]
        assert 0 < abs(a["logprob"] - b["logprob"]) < 0.05


@pytest.mark.parametrize("kind", ["F16", "BF16"])
def test_a_16_bit_gguf_runs_at_its_own_bytes_with_float32s_bits(
    kind, tmp_path_factory, tokenizer, default_model_path
):
    """An F16 or BF16 file (here Qwen2's, whose output layer is its embedding) stays 16-bit:
    the kernel widens its weights exactly and the tied embedding is looked up in the output
    layer's panels, so --dtype auto gives float32's logprobs at half its bytes; gguf-int8 runs
    it on x rounded to the file's type."""
    hf_dir = save_tiny_model(tmp_path_factory, tokenizer, "qwen2")
    path = save_tiny_gguf(
        hf_dir, hf_dir.parent / f"{kind}.gguf", default_model_path, {}, {"*": kind}
    )
    small = dict(page_size=5, num_kv_pages=200, max_num_batched_tokens=16, max_num_seqs=8)
    llms = {
        dtype: LLM(str(path), dtype=dtype, **small) for dtype in ("auto", "float32", "gguf-int8")
    }
    assert llms["auto"].engine.config.dtype == "gguf"
    model = llms["auto"].engine.runner.model
    assert model.embed is None and model.lm_head.packed.dtype == HALF_TYPES[kind]
    assert {layer.gate_up.packed.dtype for layer in model.layers} == {model.lm_head.packed.dtype}
    params = SamplingParams(temperature=0, max_tokens=8, ignore_eos=True, logprobs=3)
    prompts = ["hello", "a longer prompt that needs chunks of prefill"]
    auto, fp32, int8 = (
        [o.outputs[0].logprobs for o in llm.generate(prompts, params)] for llm in llms.values()
    )
    assert auto == fp32
    for a, b in zip(int8, fp32):
        assert 0 < abs(a[0]["logprob"] - b[0]["logprob"]) < 0.05


def test_a_model_that_would_not_fit_is_refused_before_it_is_read(
    tiny_llama_dir, default_model_path, tmp_path, monkeypatch
):
    """Under --dtype gguf, the weights' size once loaded (blocks kept, the rest as fp32) is
    checked against the memory available before a tensor is read; over it, the error names
    the sizes and what would be dequantized."""
    from kvfence.model import memory

    path = save_tiny_gguf(
        tiny_llama_dir, tmp_path / "m.gguf", default_model_path, types={"*": "Q8_0"}
    )
    monkeypatch.setattr(memory, "_available_memory", lambda: 1024)
    with pytest.raises(
        ModelLoadError,
        match=r"would take about [\d.]+ [KM]iB once loaded, [\d.]+ [KM]iB of it dequantized to "
        r"float32 \(none\), more than the 1 KiB of memory available",
    ):
        LLM(str(path))
    assert LLM(str(path), dtype="float32").engine.config.dtype == "float32"  # no blocks, no check


@pytest.mark.parametrize(
    "v_type, others, why",
    [
        ("Q8_0", "Q4_K", "rounds rows per 256 k for K-quants but per 32"),
        ("Q8_0", "Q4_1", "runs Q8_0 as signed codes"),
        ("F16", "Q8_0", "which it runs in one type"),
    ],
)
def test_gguf_int8_refuses_fused_matrices_it_has_no_one_arithmetic_for(
    tmp_path_factory, tokenizer, default_model_path, v_type, others, why
):
    """Q/K/V is one matrix: Q4_K rows (activations rounded per 256) beside a Q8_0 V (per 32),
    Q8_0's signed codes beside Q4_1's offsets, or F16 beside blocks have no one arithmetic,
    so gguf-int8 names the tensors, their types and why; gguf runs the file."""
    hf_dir = save_tiny_model(
        tmp_path_factory, tokenizer, "llama", hidden_size=256, intermediate_size=512
    )
    path = save_tiny_gguf(
        hf_dir,
        hf_dir.parent / "mix.gguf",
        default_model_path,
        types={"attn_v.weight": v_type, "*": others},
    )
    small = dict(page_size=5, num_kv_pages=200, max_num_batched_tokens=16, max_num_seqs=8)
    kinds = ", ".join(sorted({v_type, others}))
    with pytest.raises(
        ModelLoadError, match=rf"fuses blk\.0\.attn_k\.weight, .*{why}.* {kinds} in mix\.gguf"
    ):
        LLM(str(path), dtype="gguf-int8", **small)
    assert LLM(str(path), **small).engine.config.dtype == "gguf"


def test_bf16_safetensors_reach_the_model_without_a_float32_copy(tiny_llama_dir, tmp_path):
    """A bf16 checkpoint's tensors leave the loader as stored and stay bf16 in the layers:
    --dtype bfloat16 computes with them, float32 widens each exactly as it reads it."""
    import shutil

    from transformers import AutoModelForCausalLM

    from kvfence.model.loader import load_model

    bf16_dir = tmp_path / "bf16"
    shutil.copytree(tiny_llama_dir, bf16_dir)
    AutoModelForCausalLM.from_pretrained(tiny_llama_dir, dtype=torch.bfloat16).save_pretrained(
        bf16_dir
    )
    _, weights = load_model(bf16_dir, progress=False)
    layer = next(iter(weights.layers))
    assert layer.qkv.dtype == layer.down.dtype == weights.embed.dtype == torch.bfloat16
    params = SamplingParams(temperature=0, max_tokens=4, ignore_eos=True, logprobs=1)
    llms = [LLM(str(bf16_dir), dtype=dtype) for dtype in ("bfloat16", "float32")]
    fp32_layer = llms[1].engine.runner.model.layers[0]
    assert fp32_layer.down.packed.dtype == fp32_layer.qkv.packed.dtype == torch.bfloat16
    bf16, fp32 = (llm.generate(["hello there"], params)[0].outputs[0] for llm in llms)
    assert bf16.token_ids == fp32.token_ids
    assert max(abs(a["logprob"] - b["logprob"]) for a, b in zip(bf16.logprobs, fp32.logprobs)) < 0.1


@pytest.mark.parametrize("endian", [gguf.GGUFEndian.LITTLE, gguf.GGUFEndian.BIG])
def test_the_gguf_reader_reads_every_field_as_gguf_py_does(tmp_path, endian, default_model_path):
    """open_gguf reads arrays in one pass; each field must come out as gguf-py's own reader
    gives it, for strings, numbers and nested arrays, in either byte order."""
    path = tmp_path / "fields.gguf"
    writer = gguf.GGUFWriter(str(path), "llama", endianess=endian)
    writer.add_array("test.tokens", ["a", "", "héllo wörld", "<|eot|>"] * 50)
    writer.add_array("test.scores", [0.5 * i for i in range(300)])
    writer.add_array("test.types", list(range(-5, 5)))
    writer.add_array("test.nested", [[1, 2], [3, 4, 5]])
    writer.add_array("test.empty", [])
    writer.add_string("test.after", "the fields after the arrays")
    writer.add_tensor("x", np.arange(8, dtype=np.float32))
    for write in (writer.write_header_to_file, writer.write_kv_data_to_file):
        write()
    writer.write_tensors_to_file()
    writer.close()
    for file in (path, default_model_path):
        stock, ours = gguf.GGUFReader(str(file)), open_gguf(file)
        assert list(ours.fields) == list(stock.fields)
        for name, field in stock.fields.items():
            got = ours.fields[name]
            assert (got.types, got.contents(), len(got.data)) == (
                field.types,
                field.contents(),
                len(field.data),
            ), name
            if field.types[0] == gguf.GGUFValueType.ARRAY and len(field.data) > 3:
                assert got.contents(3) == field.contents(3), name
        assert ours.data_offset == stock.data_offset
        assert [t.data.tobytes() for t in ours.tensors] == [t.data.tobytes() for t in stock.tensors]


@pytest.mark.parametrize("values", [list(range(1000)), ["token"] * 500], ids=["numbers", "strings"])
def test_a_gguf_array_longer_than_the_file_is_refused(tmp_path, values):
    path = tmp_path / "long.gguf"
    writer = gguf.GGUFWriter(str(path), "llama")
    writer.add_array("test.values", values)
    writer.add_tensor("x", np.arange(8, dtype=np.float32))
    for write in (writer.write_header_to_file, writer.write_kv_data_to_file):
        write()
    writer.write_tensors_to_file()
    writer.close()
    raw = path.read_bytes()
    count_at = raw.index(b"test.values") + len("test.values") + 8  # past value and item types
    path.write_bytes(raw[:count_at] + (10**9).to_bytes(8, "little") + raw[count_at + 8 :])
    with pytest.raises(ModelLoadError, match="not a readable GGUF file"):
        open_gguf(path)


def test_a_gguf_tokenizer_is_converted_once_then_read_from_the_cache(
    default_model_path, tmp_path, monkeypatch
):
    from kvfence.model import tokenizer as tok

    monkeypatch.setenv("KVFENCE_CACHE", str(tmp_path / "cache"))
    path = tmp_path / "model.gguf"
    shutil.copy(default_model_path, path)
    calls = []
    read = tok.AutoTokenizer.from_pretrained
    monkeypatch.setattr(
        tok.AutoTokenizer,
        "from_pretrained",
        lambda *a, **k: calls.append((a, k)) or read(*a, **k),
    )
    converted = tok.load_tokenizer(path)
    cached = tok.load_tokenizer(path)
    entries = list((tmp_path / "cache" / "tokenizers").iterdir())
    assert len(entries) == 1 and (entries[0] / "tokenizer.json").is_file()
    assert calls[0][1] == {"gguf_file": "model.gguf"}
    assert calls[1] == ((str(entries[0]),), {})  # no second conversion
    text = "Héllo, wörld! 12345 <|im_start|>"
    assert cached.encode(text) == converted.encode(text)
    messages = [{"role": "user", "content": "hi"}]
    assert tok.apply_chat_template(cached, messages) == tok.apply_chat_template(converted, messages)
    # a file changed in place is converted again, not served the old file's tokenizer
    stat = path.stat()
    os.utime(path, ns=(stat.st_atime_ns, stat.st_mtime_ns + 10**9))
    tok.load_tokenizer(path)
    assert calls[2][1] == {"gguf_file": "model.gguf"}
    assert len(list((tmp_path / "cache" / "tokenizers").iterdir())) == 2


def test_a_raw_prompt_gets_the_tokenizers_bos_and_a_chat_no_second_one(tiny_llama_dir, tmp_path):
    """Llama's and Mistral's tokenizers put BOS before a prompt (a post-processor, or GGUF's
    add_bos_token); their chat templates write it themselves."""
    from transformers import AutoTokenizer

    path = shutil.copytree(tiny_llama_dir, tmp_path / "model")
    raw = json.loads((path / "tokenizer.json").read_text())
    bos = {"SpecialToken": {"id": "<|im_start|>", "type_id": 0}}
    raw["post_processor"] = {
        "type": "TemplateProcessing",
        "single": [bos, {"Sequence": {"id": "A", "type_id": 0}}],
        "pair": [
            bos,
            {"Sequence": {"id": "A", "type_id": 0}},
            {"Sequence": {"id": "B", "type_id": 1}},
        ],
        "special_tokens": {
            "<|im_start|>": {"id": "<|im_start|>", "ids": [1], "tokens": ["<|im_start|>"]}
        },
    }
    (path / "tokenizer.json").write_text(json.dumps(raw))
    reference = AutoTokenizer.from_pretrained(str(path))
    llm = LLM(str(path), num_kv_pages=64)
    params = SamplingParams(temperature=0, max_tokens=1)
    [out] = llm.generate("hello world", params)
    assert out.prompt_token_ids == reference("hello world").input_ids
    assert out.prompt_token_ids[0] == 1 and out.prompt_token_ids[1] != 1
    messages = [{"role": "user", "content": "hello"}]
    [out] = llm.chat(messages, params)
    templated = reference.apply_chat_template(messages, add_generation_prompt=True, tokenize=False)
    assert out.prompt_token_ids == reference(templated, add_special_tokens=False).input_ids
    assert out.prompt_token_ids[:2] != [1, 1]


def test_serve_refuses_a_model_in_one_line_not_a_traceback(
    tiny_model, default_model_path, tmp_path
):
    path = save_tiny_gguf(
        tiny_model("llama"),
        tmp_path / "yarn.gguf",
        default_model_path,
        metadata={"rope.scaling.type": ("yarn", gguf.GGUFValueType.STRING)},
    )
    done = subprocess.run(
        [sys.executable, "-m", "kvfence.cli", "serve", "--model", str(path), "--port", "8093"],
        capture_output=True,
        text=True,
        timeout=300,
    )
    assert done.returncode == 2, done.stderr[-2000:]
    assert "llama.rope.scaling.type = 'yarn' is not implemented" in done.stderr
    assert "Traceback" not in done.stderr, done.stderr[-2000:]


@pytest.mark.parametrize(
    "key, value",
    [("attention.head_count_kv", [2, 2]), ("feed_forward_length", [128, 256])],
)
def test_a_gguf_hyperparameter_per_layer_is_refused_by_name(
    key, value, tiny_model, default_model_path, tmp_path
):
    """llama.cpp takes these as arrays, a value per layer (models of other families than
    kvfence runs), and transformers' tokenizer reader cannot read them."""
    array = {key: (value, gguf.GGUFValueType.ARRAY)}
    path = save_tiny_gguf(tiny_model("llama"), tmp_path / "a.gguf", default_model_path, array)
    with pytest.raises(ModelLoadError, match=rf"llama.{key} = \[.*\]: a value per layer"):
        LLM(str(path))


def test_a_split_gguf_model_loads_from_its_first_part(tiny_model, default_model_path, tmp_path):
    """As llama-gguf-split writes one (gguf-py's writer splits the same way): the metadata in
    the first part, the tensors spread over all; the model equals the whole file's."""
    hf_dir = tiny_model("llama")
    whole = save_tiny_gguf(hf_dir, tmp_path / "whole.gguf", default_model_path, types={"*": "Q8_0"})
    save_tiny_gguf(
        hf_dir, tmp_path / "m.gguf", default_model_path, types={"*": "Q8_0"}, split_max_tensors=8
    )
    first, *rest = sorted(tmp_path.glob("m-*-of-*.gguf"))
    assert first.name == f"m-00001-of-{len(rest) + 1:05d}.gguf" and len(rest) >= 2
    params = SamplingParams(temperature=0, max_tokens=8, ignore_eos=True, logprobs=3)
    prompts = ["hello", "a longer prompt that needs chunks of prefill"]
    small = dict(page_size=5, num_kv_pages=200, max_num_batched_tokens=16, max_num_seqs=8)
    for dtype in ("float32", "gguf-int8"):
        split, one = (LLM(str(p), dtype=dtype, **small) for p in (first, whole))
        assert split.engine.model_name == "m", "served by the model's name, not the part's"
        assert [o.outputs[0].logprobs for o in split.generate(prompts, params)] == [
            o.outputs[0].logprobs for o in one.generate(prompts, params)
        ]
    with pytest.raises(ModelLoadError, match=rf"part 2 of .*: give its first part, {first.name}"):
        LLM(str(rest[0]))
    rest[-1].rename(tmp_path / "elsewhere.gguf")
    with pytest.raises(
        ModelLoadError, match=rf"{rest[-1].name}, part {len(rest) + 1} of .* missing"
    ):
        LLM(str(first))
    shutil.copy(tmp_path / "elsewhere.gguf", rest[0])  # the last part under the second's name
    with pytest.raises(ModelLoadError, match=rf"{rest[0].name} has split.no = {len(rest)}, "):
        LLM(str(first))
    with pytest.raises(ModelLoadError, match=r"split into \d+ files .* not named PREFIX-00001-"):
        LLM(str(first.rename(tmp_path / "renamed.gguf")))


def test_an_untied_model_without_its_lm_head_is_refused(tiny_llama_dir, tmp_path):
    from safetensors.torch import load_file, save_file

    path = shutil.copytree(tiny_llama_dir, tmp_path / "model")
    tensors = load_file(path / "model.safetensors")
    del tensors["lm_head.weight"]
    save_file(tensors, path / "model.safetensors", metadata={"format": "pt"})
    with pytest.raises(ModelLoadError, match="tie_word_embeddings = False, but .* no lm_head"):
        LLM(str(path))
    # left out, it is transformers' default, false (it was once taken as tied)
    left_out = edited_config(path, tmp_path / "left-out", drop=["tie_word_embeddings"])
    with pytest.raises(ModelLoadError, match="tie_word_embeddings = False, but .* no lm_head"):
        LLM(str(left_out))


def test_a_sharded_model_reads_the_files_its_index_names(tiny_llama_dir, tmp_path):
    """As Mistral's repositories ship it: the shards and their index, and beside them the
    same weights in another layout (consolidated.safetensors), which the index does not name."""
    from safetensors.torch import load_file, save_file

    path = shutil.copytree(tiny_llama_dir, tmp_path / "model")
    tensors = load_file(path / "model.safetensors")
    names = sorted(tensors)
    (path / "model.safetensors").unlink()
    shards = {
        "model-00001-of-00002.safetensors": names[::2],
        "model-00002-of-00002.safetensors": names[1::2],
    }
    for shard, part in shards.items():
        save_file({n: tensors[n] for n in part}, path / shard, metadata={"format": "pt"})
    weight_map = {n: shard for shard, part in shards.items() for n in part}
    (path / "model.safetensors.index.json").write_text(json.dumps({"weight_map": weight_map}))
    save_file(
        {"layers.0.attention.wk.weight": torch.zeros(2, 2)}, path / "consolidated.safetensors"
    )
    params = SamplingParams(temperature=0, max_tokens=6, ignore_eos=True)
    [ours] = LLM(str(path), num_kv_pages=64).generate("hello", params)
    [whole] = LLM(str(tiny_llama_dir), num_kv_pages=64).generate("hello", params)
    assert ours.outputs[0].token_ids == whole.outputs[0].token_ids
    (path / "model-00002-of-00002.safetensors").unlink()
    with pytest.raises(ModelLoadError, match="names files that are not there"):
        LLM(str(path))


def test_a_gguf_file_without_a_tokenizer_is_refused_before_its_weights(tiny_model):
    from kvfence.model.arch import gguf_model_config

    reader = open_gguf(tiny_model("llama", "gguf"))
    del reader.fields["tokenizer.ggml.model"]
    with pytest.raises(ModelLoadError, match="lacks 'tokenizer.ggml.model'"):
        gguf_model_config(reader)
