"""Our paged forward pass against Hugging Face transformers on the same weights."""

from collections import defaultdict

import gguf
import pytest
import torch

from helpers import edited_config, save_tiny_gguf, save_tiny_model
from kvfence import LLM, SamplingParams
from kvfence.model.tokenizer import apply_chat_template

PROMPTS = [
    "The capital of France is",
    "Write a haiku about the sea.",
    "def fibonacci(n):",
    "List three prime numbers:",
    "Translate 'good morning' into Spanish:",
    "The quick brown fox",
    "In 1969, Neil Armstrong",
    "Water boils at",
    "A recipe for pancakes needs",
    "The largest planet in the solar system is",
    "import numpy as np\nx = np.arange(10)\n",
    "Q: What is 12 times 12?\nA:",
    "My favourite colour is blue because",
    "Photosynthesis is the process by which",
    "Once upon a time, in a small village,",
    "The three laws of robotics are",
    "SELECT name FROM users WHERE",
    "Dear hiring manager,",
    "The meaning of life is",
    "Rust and Python differ in that",
    "<|im_start|>user\nWhat is 2+2?<|im_end|>\n<|im_start|>assistant\n",
    "Le chat est",
]


def record_logits(llm: LLM) -> dict[str, list[torch.Tensor]]:
    """Keeps every logits row the engine samples from, per request."""
    recorded = defaultdict(list)
    run = llm.engine.runner.run

    def spy(batch):
        logits, sampled = run(batch)
        for row, req in zip(logits, sampled):
            recorded[req.parent_id].append(row.clone())
        return logits, sampled

    llm.engine.runner.run = spy
    return recorded


def hf_logits(hf_model, prompt_ids: list[int], output_ids: list[int]) -> torch.Tensor:
    """HF logits at the positions where our engine sampled each output token."""
    ids = torch.tensor([prompt_ids + output_ids[:-1]])
    with torch.no_grad():
        logits = hf_model(ids).logits[0]
    return logits[len(prompt_ids) - 1 :]


def compare_batched(llm, hf_model, prompts, max_tokens, atol):
    recorded = record_logits(llm)
    results = llm.generate(
        prompts, SamplingParams(temperature=0, max_tokens=max_tokens, ignore_eos=True)
    )
    for res in results:
        ours = torch.stack(recorded[res.request_id])
        ref = hf_logits(hf_model, res.prompt_token_ids, res.outputs[0].token_ids)
        assert ours.shape == ref.shape
        torch.testing.assert_close(ours, ref, atol=atol, rtol=0)
    return results


TINY_PROMPTS = [
    "hello",
    "a longer prompt that will need several chunks of prefill to get through",
    "x y z w",
]


def tiny_llm(path, **kwargs) -> LLM:
    """Page size 5 and 16-token steps: prompts prefill in chunks, batched with other lengths."""
    return LLM(
        str(path),
        page_size=5,
        num_kv_pages=200,
        max_num_batched_tokens=16,
        max_num_seqs=8,
        **kwargs,
    )


def hf_float32(path):
    from transformers import AutoModelForCausalLM

    return AutoModelForCausalLM.from_pretrained(str(path), dtype=torch.float32).eval()


@pytest.mark.parametrize("attention", ["kernel", "torch"])
@pytest.mark.parametrize("fmt", ["safetensors", "gguf"])
@pytest.mark.parametrize("arch", ["llama", "llama3", "qwen2", "qwen3", "mistral"])
def test_model_families_match_transformers(arch, fmt, attention, tiny_model):
    """Every family, read from its safetensors or from a GGUF file of the same weights in
    llama.cpp's layout, gives transformers' logits: Llama 3's rope scaling (from config.json
    or rope_freqs), Qwen2's QKV bias, Qwen3's per-head Q/K norms and explicit head_dim, and
    Mistral within its sliding window."""
    llm = tiny_llm(tiny_model(arch, fmt), attention=attention)
    hf = hf_float32(tiny_model(arch))
    compare_batched(llm, hf, TINY_PROMPTS, max_tokens=6, atol=1e-4)


def test_a_llama_gguf_with_qkv_biases_matches_transformers(
    tiny_model, default_model_path, tmp_path
):
    """llama.cpp's converter permutes the Q/K biases with their weights' rows: both are put
    back. Qwen2 is Llama with Q/K/V biases, written here as a llama GGUF file."""
    hf_dir = tiny_model("qwen2")
    path = save_tiny_gguf(hf_dir, tmp_path / "llama-bias.gguf", default_model_path, arch="llama")
    compare_batched(tiny_llm(path), hf_float32(hf_dir), TINY_PROMPTS, max_tokens=6, atol=1e-4)


@pytest.mark.parametrize("key", ["rope.scaling.factor", "rope.scale_linear"])
def test_a_gguf_rope_factor_without_a_type_scales_linearly(
    key, tiny_llama_dir, default_model_path, tmp_path
):
    """llama.cpp takes a rope scaling factor with no type as linear (and rope.scale_linear as
    its older key); transformers reads no GGUF rope scaling, so the reference is config.json's
    linear scaling of the same weights."""
    path = save_tiny_gguf(
        tiny_llama_dir,
        tmp_path / "linear.gguf",
        default_model_path,
        metadata={key: (4.0, gguf.GGUFValueType.FLOAT32)},
    )
    scaled = edited_config(
        tiny_llama_dir, tmp_path / "hf", rope_scaling={"rope_type": "linear", "factor": 4.0}
    )
    compare_batched(tiny_llm(path), hf_float32(scaled), TINY_PROMPTS, max_tokens=6, atol=1e-4)


def test_rope_parameters_theta_wins_over_the_top_level_one(tiny_llama_dir, tmp_path):
    path = edited_config(
        tiny_llama_dir,
        tmp_path / "model",
        rope_theta=10000.0,
        rope_parameters={"rope_type": "default", "rope_theta": 500000.0},
    )
    compare_batched(tiny_llm(path), hf_float32(path), TINY_PROMPTS, max_tokens=6, atol=1e-4)


def test_qwen3_without_head_dim_takes_transformers_default(tmp_path_factory, tokenizer, tmp_path):
    """Qwen3's config class defaults head_dim to 128, not hidden / heads: a config.json that
    leaves it out runs as transformers runs it (which once loaded and then failed in the
    first request)."""
    saved = save_tiny_model(tmp_path_factory, tokenizer, "qwen3", head_dim=128)
    path = edited_config(saved, tmp_path / "model", drop=["head_dim"])
    compare_batched(tiny_llm(path), hf_float32(path), TINY_PROMPTS, max_tokens=6, atol=1e-4)


def test_an_lm_head_unlike_the_embedding_is_the_output_layer_though_tied(tiny_llama_dir, tmp_path):
    """config.json ties them, but the files hold a different lm_head.weight: transformers
    keeps it (with a warning), and so does kvfence."""
    path = edited_config(tiny_llama_dir, tmp_path / "model", tie_word_embeddings=True)
    compare_batched(tiny_llm(path), hf_float32(path), TINY_PROMPTS, max_tokens=6, atol=1e-4)


@pytest.mark.parametrize("attention", ["kernel", "torch"])
@pytest.mark.parametrize("kv_cache_dtype,atol", [("bfloat16", 0.1), ("fp8", 1.5)])
def test_tiny_model_logits_match_transformers(kv_cache_dtype, atol, attention, tiny_llama_dir):
    """A bf16 pool rounds K and V to 8 bits of mantissa and fp8 (e4m3) to 4, hence the looser
    tolerances (docs/precision.md)."""
    llm = tiny_llm(tiny_llama_dir, attention=attention, kv_cache_dtype=kv_cache_dtype)
    hf = hf_float32(tiny_llama_dir)
    compare_batched(llm, hf, TINY_PROMPTS, max_tokens=6, atol=atol)


@pytest.mark.parametrize("arch", ["llama", "llama3", "qwen2"])
@pytest.mark.parametrize("kv_cache_dtype", ["float32", "bfloat16", "fp8"])
def test_decode_layers_in_one_call_give_the_python_loops_bits(arch, kv_cache_dtype, tiny_model):
    """Where every kernel is at hand, a decode step's layers run in one C++ call (fused.cpp's
    decode_layers); every logprob equals the per-layer Python loop's (Qwen2: with qkv bias,
    Llama 3: with scaled rope)."""
    llm = tiny_llm(tiny_model(arch), kv_cache_dtype=kv_cache_dtype, prefix_cache=False)
    model = llm.engine.runner.model
    one_call, calls = model.decode_layers, []
    assert one_call is not None
    model.decode_layers = lambda *args: (
        calls.append(len(args[1])) or one_call(*args)
    )  # args[1]: the pool's layers
    params = SamplingParams(temperature=0, max_tokens=10, ignore_eos=True, logprobs=3)
    fused = [o.outputs[0].logprobs for o in llm.generate(TINY_PROMPTS, params)]
    assert calls and set(calls) == {len(model.layers)}
    model.decode_layers = None
    assert fused == [o.outputs[0].logprobs for o in llm.generate(TINY_PROMPTS, params)]


def test_qwen3_decodes_through_the_python_loop(tiny_model):
    """The one-call decode has no per-head Q/K norms, so Qwen3 never takes it."""
    assert tiny_llm(tiny_model("qwen3")).engine.runner.model.decode_layers is None


def test_default_model_logits_match_transformers(hf_reference):
    llm = LLM(
        page_size=7,
        num_kv_pages=2000,
        max_model_len=1024,
        max_num_batched_tokens=64,
        max_num_seqs=16,
        num_threads=2,
    )
    prompts = [
        PROMPTS[0],
        PROMPTS[14] * 6,
        PROMPTS[10],
    ]  # 6, ~60 and ~20 tokens: chunked, 7 never divides
    compare_batched(llm, hf_reference, prompts, max_tokens=5, atol=2e-3)


def test_bfloat16_logits_stay_near_the_fp32_reference(hf_reference, real_llm):
    """bf16 linear layers and KV pool move logits by tenths (so near-ties can flip a greedy
    token), not more."""
    llm = LLM(
        page_size=7,
        num_kv_pages=2000,
        max_model_len=1024,
        max_num_batched_tokens=64,
        max_num_seqs=16,
        num_threads=2,
        dtype="bfloat16",
    )
    model = llm.engine.runner.model
    assert (
        model.layers[0].qkv.dtype
        == model.lm_head.dtype
        == llm.engine.pool.k.dtype
        == torch.bfloat16
    )
    assert model.layers[0].qkv.packed.dtype == torch.uint8  # below 8 rows: the file's blocks
    prompts = [PROMPTS[0], PROMPTS[14] * 6, PROMPTS[10]]
    compare_batched(llm, hf_reference, prompts, max_tokens=5, atol=1.0)
    # A near-tie: fp32 starts "The capital of France is Paris." 0.08 ahead of llama.cpp's
    # "L'Étoile, ...". bf16 keeps fp32's token in its top two, a few tenths from the top at
    # most: on CPUs with a bf16 GEMM, oneDNN's rounding can put either one first.
    chat = [{"role": "user", "content": "What is the capital of France?"}]
    params = SamplingParams(temperature=0, max_tokens=1, logprobs=2)
    ours = llm.chat(chat, params)[0].outputs[0].logprobs[0]
    fp32 = real_llm.chat(chat, params)[0].outputs[0].logprobs[0]
    assert real_llm.tokenizer.decode([fp32["token_id"]]) == "The"
    top = dict(ours["top"])
    assert fp32["token_id"] in top and ours["logprob"] - top[fp32["token_id"]] < 0.35


def test_greedy_continuations_match_transformers(real_llm, hf_reference):
    tok = real_llm.tokenizer
    results = real_llm.generate(
        PROMPTS, SamplingParams(temperature=0, max_tokens=12, ignore_eos=True)
    )
    for prompt, res in zip(PROMPTS, results):
        ids = tok.encode(prompt, add_special_tokens=False)
        ref = []
        with torch.no_grad():  # plain greedy loop: HF generate would stop at EOS, we ignore it
            for _ in range(12):
                ref.append(int(hf_reference(torch.tensor([ids + ref])).logits[0, -1].argmax()))
        assert res.outputs[0].token_ids == ref, prompt


def test_chat_answers_like_the_reference(real_llm):
    out = real_llm.chat(
        [{"role": "user", "content": "What is the capital of France?"}],
        SamplingParams(temperature=0, max_tokens=20),
    )[0].outputs[0]
    assert out.text == "The capital of France is Paris."
    assert out.finish_reason == "stop"


def test_q4_k_m_file_runs_in_blocks_and_matches_transformers(q4_k_m_path):
    """llama.cpp's Q4_K_M of the default model: every type stays in blocks (Q6_K with its
    scale per 16 weights), greedy continuations equal transformers' on the same file token
    for token, logits stay within 2e-3, and the chat answer is transformers' own."""
    from gguf import GGUFReader
    from transformers import AutoModelForCausalLM

    types = {t.name: t.tensor_type.name for t in GGUFReader(str(q4_k_m_path)).tensors}
    downs = [types[f"blk.{i}.ffn_down.weight"] for i in range(30)]
    assert {"Q4_K", "Q6_K"} <= set(downs)
    llm = LLM(str(q4_k_m_path), num_threads=2, max_model_len=1024, num_kv_pages=400)
    assert llm.engine.config.dtype == "gguf"
    layers = llm.engine.runner.model.layers
    # the down projections in the file's own Q4_K and Q6_K super-blocks
    assert {layers[i].down.packed.shape[2] for i in range(30)} == {4736, 6720}
    assert all(layer.qkv.packed.dtype == torch.uint8 for layer in layers)
    assert llm.engine.runner.model.embed is None  # tied: looked up in the output layer's blocks
    hf = AutoModelForCausalLM.from_pretrained(
        str(q4_k_m_path.parent), gguf_file=q4_k_m_path.name, dtype=torch.float32
    ).eval()
    compare_batched(llm, hf, [PROMPTS[0], PROMPTS[14] * 6, PROMPTS[10]], max_tokens=5, atol=2e-3)
    tok = llm.tokenizer
    results = llm.generate(
        PROMPTS[:4], SamplingParams(temperature=0, max_tokens=12, ignore_eos=True)
    )
    for prompt, res in zip(PROMPTS[:4], results):
        ids = tok.encode(prompt, add_special_tokens=False)
        ref = []
        with torch.no_grad():
            for _ in range(12):
                ref.append(int(hf(torch.tensor([ids + ref])).logits[0, -1].argmax()))
        assert res.outputs[0].token_ids == ref, prompt
    chat = [{"role": "user", "content": "What is the capital of France?"}]
    out = llm.chat(chat, SamplingParams(temperature=0, max_tokens=30))[0].outputs[0]
    ids = tok.encode(apply_chat_template(tok, chat), add_special_tokens=False)
    with torch.no_grad():
        reference = hf.generate(torch.tensor([ids]), max_new_tokens=30, do_sample=False)
    assert out.token_ids == reference[0, len(ids) :].tolist()
    assert "capital of France" in out.text and out.finish_reason == "stop"


def test_gguf_blocks_give_the_float32_results_bit_for_bit(real_llm):
    """The default (auto) reads the file's Q4_1/Q8_0 blocks, a fifth of the fp32 bytes, yet
    every logprob equals the float32 engine's, in batches of mixed prompts."""
    assert real_llm.engine.config.dtype == "gguf"
    model = real_llm.engine.runner.model
    assert model.layers[0].qkv.packed.dtype == model.lm_head.packed.dtype == torch.uint8
    assert (
        model.layers[0].qkv.packed.shape[2] == 640 and model.lm_head.packed.shape[2] == 1280
    )  # 4-bit, 8-bit
    assert model.embed is None  # tied: the lookup decodes rows of the output layer's blocks
    fp32 = LLM(num_threads=2, max_model_len=2048, num_kv_pages=1024, dtype="float32")
    assert fp32.engine.runner.model.layers[0].qkv.packed.dtype == torch.float32
    params = SamplingParams(temperature=0, max_tokens=8, ignore_eos=True, logprobs=3)
    for ours, reference in zip(
        real_llm.generate(PROMPTS[:6], params), fp32.generate(PROMPTS[:6], params)
    ):
        assert ours.outputs[0].token_ids == reference.outputs[0].token_ids
        assert ours.outputs[0].logprobs == reference.outputs[0].logprobs


def test_int8_activations_stay_near_float32_and_batch_invariant(real_llm):
    """--dtype gguf-int8 computes as llama.cpp does (8-bit activations, integer dot products)
    and keeps a bf16 KV pool: not the float32 bits, but the same first greedy token on nearly
    every prompt (docs/precision.md has the tallies), and still bit for bit the same alone or
    in a batch."""
    llm = LLM(num_threads=2, max_model_len=2048, num_kv_pages=1024, dtype="gguf-int8")
    model = llm.engine.runner.model
    assert model.layers[0].qkv.packed.dtype == model.lm_head.packed.dtype == torch.int8
    assert llm.engine.pool.k.dtype == torch.bfloat16  # auto: not an exact mode
    assert (
        model.layers[0].qkv.packed.shape[2] == 640 and model.lm_head.packed.shape[2] == 1088
    )  # 4-bit, Q8_0
    assert_near_float32_and_batch_invariant(
        llm, real_llm, min_same_first_token=20, max_logprob_move=0.3
    )


def test_int8_activations_on_the_q4_k_m_file(q4_k_m_path):
    """gguf-int8 on llama.cpp's Q4_K_M of the default model: the down projections in Q4_K and
    Q6_K (rows rounded per 256 k), Q/K/V and the rest in Q5_0 and Q8_0 (per 32) all run on
    8-bit activations; the answers stay near the exact ones of the same file and a request's
    bits do not depend on its batch."""
    small = dict(num_threads=2, max_model_len=1024, num_kv_pages=400)
    llm = LLM(str(q4_k_m_path), dtype="gguf-int8", **small)
    layers = llm.engine.runner.model.layers
    assert {layers[i].down.packed.dim() for i in range(30)} == {1}  # tables of K-quant panels
    assert all(layer.qkv.packed.dtype == torch.int8 for layer in layers)
    exact = LLM(str(q4_k_m_path), **small)
    assert_near_float32_and_batch_invariant(
        llm, exact, min_same_first_token=19, max_logprob_move=0.3
    )


def test_int8_activations_on_a_q4_k_s_file(default_model_path, tmp_path):
    """llama.cpp's Q4_K_S of the default model fuses Q5_0 Q and K with a Q5_1 V in its first
    layers (rows of 576, not of 256): gguf-int8 runs them as one matrix with offsets."""
    import llama_cpp

    path = tmp_path / "q4_k_s.gguf"
    params = llama_cpp.llama_model_quantize_default_params()
    params.ftype = llama_cpp.LLAMA_FTYPE_MOSTLY_Q4_K_S
    params.allow_requantize = True
    params.nthread = 2
    assert (
        llama_cpp.llama_model_quantize(str(default_model_path).encode(), str(path).encode(), params)
        == 0
    )
    assert {t.tensor_type.name for t in gguf.GGUFReader(path).tensors if ".0.attn_" in t.name} >= {
        "Q5_0",
        "Q5_1",
    }
    small = dict(num_threads=2, max_model_len=1024, num_kv_pages=400)
    llm = LLM(str(path), dtype="gguf-int8", **small)
    assert llm.engine.runner.model.layers[0].qkv.packed.shape[2] == 768
    assert_near_float32_and_batch_invariant(
        llm, LLM(str(path), **small), min_same_first_token=18, max_logprob_move=0.5
    )


def assert_near_float32_and_batch_invariant(
    llm, real_llm, min_same_first_token: int, max_logprob_move: float
):
    """The first greedy token of each test prompt against the exact engine's, and a request's
    bits alone and in a batch."""
    params = SamplingParams(temperature=0, max_tokens=1, logprobs=5)
    ours = [r.outputs[0].logprobs[0] for r in llm.generate(PROMPTS, params)]
    exact = [r.outputs[0].logprobs[0] for r in real_llm.generate(PROMPTS, params)]
    assert sum(a["token_id"] == b["token_id"] for a, b in zip(ours, exact)) >= min_same_first_token
    assert all(b["token_id"] in [t for t, _ in a["top"]] for a, b in zip(ours, exact))
    assert max(abs(a["logprob"] - b["logprob"]) for a, b in zip(ours, exact)) < max_logprob_move
    assert any(a["logprob"] != b["logprob"] for a, b in zip(ours, exact))

    params = SamplingParams(temperature=0, max_tokens=16, ignore_eos=True, logprobs=2)
    alone = llm.generate(PROMPTS[2], params)[0].outputs[0]
    crowd = llm.generate(PROMPTS[:16], params)[2].outputs[0]
    assert crowd.token_ids == alone.token_ids and crowd.logprobs == alone.logprobs


@pytest.mark.parametrize("kind", ["Q4_0", "Q4_1", "Q5_0", "Q5_1", "Q8_0"])
def test_int8_activations_give_llama_cpps_logits(
    kind, tiny_llama_dir, default_model_path, tmp_path
):
    """gguf-int8 is llama.cpp's arithmetic: on a file in each type, its logits are llama.cpp's
    (llama-cpp-python on the same file, fp32 KV cache) up to fp32 rounding, where those of
    exact float32 differ by the rounding of the activations. Before, three roundings of
    kvfence's own moved an 8-bit code of x now and then, and with it the logits by 0.1 to 0.3
    on some prompts: the rows' scales kept fp32 where llama.cpp's Q8_0 and Q8_1 keep fp16,
    Q4_0 and Q5_0's zero points taken off in float, and RMSNorm's 1 / sqrt approximated."""
    import llama_cpp

    path = save_tiny_gguf(
        tiny_llama_dir, tmp_path / "m.gguf", default_model_path, types={"*": kind}
    )
    llm = LLM(str(path), dtype="gguf-int8", kv_cache_dtype="float32")
    recorded = record_logits(llm)
    prompts = [
        "a longer prompt that will need several chunks of prefill",
        "The capital of France is",
        "x y z w",
        "Once upon a time there was",
    ]
    results = llm.generate(prompts, SamplingParams(temperature=0, max_tokens=4))
    peer = llama_cpp.Llama(
        model_path=str(path), n_ctx=128, n_threads=2, logits_all=True, type_k=0, type_v=0,
        verbose=False,
    )  # fmt: skip
    theirs = []
    for result in results:
        ours = torch.stack(recorded[result.request_id])
        ids = result.prompt_token_ids + result.outputs[0].token_ids[:-1]
        peer.reset()
        peer.eval(ids)
        theirs.append(torch.tensor(peer.scores[len(result.prompt_token_ids) - 1 : len(ids)]))
        torch.testing.assert_close(ours, theirs[-1], atol=1e-5, rtol=0)
    peer.close()
    exact = record_logits(float32 := LLM(str(path), kv_cache_dtype="float32"))
    float32.generate(prompts[:1], SamplingParams(temperature=0, max_tokens=1))
    assert (next(iter(exact.values()))[0] - theirs[0][0]).abs().max() > 5e-3


def test_fp8_kv_cache_stays_near_float32_and_batch_invariant(real_llm):
    """An fp8 (e4m3) pool under gguf-int8 rounds K and V to 4 significant bits: the first
    greedy token still agrees with float32's on nearly every prompt and stays in its top 5,
    logprobs move by tenths (docs/precision.md), and a request gives the same bits alone or
    in a batch."""
    llm = LLM(
        num_threads=2,
        max_model_len=2048,
        num_kv_pages=1024,
        dtype="gguf-int8",
        kv_cache_dtype="fp8",
    )
    assert llm.engine.pool.k.dtype == llm.engine.pool.v.dtype == torch.float8_e4m3fn
    assert_near_float32_and_batch_invariant(
        llm, real_llm, min_same_first_token=19, max_logprob_move=0.6
    )


def test_gguf_dtype_needs_a_gguf_file(tiny_llama_dir):
    from kvfence.model.config import ModelLoadError

    assert LLM(str(tiny_llama_dir)).engine.config.dtype == "float32"  # auto, on safetensors
    with pytest.raises(
        ModelLoadError,
        match="--dtype gguf and gguf-int8 read the blocks of a GGUF file",
    ):
        LLM(str(tiny_llama_dir), dtype="gguf")
