"""Admission, scheduling, preemption, abort and pool accounting on a tiny model."""

import json
import os
import shutil
import subprocess
import sys

import pytest
import torch

from helpers import assert_pool_empty
from kvfence import SamplingParams
from kvfence.config import ConfigError, EngineConfig
from kvfence.engine.decode_graphs import DecodeGraphs
from kvfence.engine.llm_engine import LLMEngine
from kvfence.engine.request import RequestState
from kvfence.engine.sampling_params import InvalidRequest

GREEDY = dict(temperature=0, ignore_eos=True)


def tiny_engine(path, **kw):
    cfg = dict(
        page_size=4,
        num_kv_pages=128,
        max_model_len=128,
        max_num_batched_tokens=32,
        max_num_seqs=8,
    )
    cfg.update(kw)
    return LLMEngine(EngineConfig(model=str(path), **cfg), progress=False)


def run_all(engine, check=None):
    finished = {}
    while engine.has_unfinished():
        for out in engine.step():
            if out.finished:
                finished[(out.request_id, out.index)] = out
        if check:
            check(engine)
    return finished


def tokens_and_logprobs(engine, prompts, params):
    """Each prompt's (token ids, logprobs), run to the end; the pool is empty after."""
    reqs = [engine.add_request(p, params)[0] for p in prompts]
    done = run_all(engine)
    assert_pool_empty(engine)
    return [
        (
            done[(q.parent_id, 0)].token_ids,
            [e["logprob"] for e in done[(q.parent_id, 0)].logprobs],
        )
        for q in reqs
    ]


def block_tables_disjoint(engine):
    seen = set()
    for req in list(engine.scheduler.running) + list(engine.scheduler.waiting):
        pages = set(req.block_table[req.num_shared_pages :])
        assert not pages & seen, "a page is in two block tables"
        seen |= pages


def test_start_refused_when_pool_smaller_than_context(tiny_llama_dir):
    with pytest.raises(ConfigError) as e:
        tiny_engine(tiny_llama_dir, num_kv_pages=10, max_model_len=128)
    msg = str(e.value)
    assert "40 tokens" in msg and "128" in msg and "--num-kv-pages to at least 32" in msg


def test_unknown_dtype_refused(tiny_llama_dir):
    with pytest.raises(
        ConfigError,
        match="dtype must be one of auto, float32, gguf, gguf-int8, bfloat16, not 'float16'",
    ):
        tiny_engine(tiny_llama_dir, dtype="float16")


def test_bfloat16_and_fp8_kv_caches_hold_two_and_four_times_the_tokens(tiny_llama_dir):
    fp32 = tiny_engine(tiny_llama_dir, num_kv_pages=None, kv_memory_gib=0.01)
    bf16 = tiny_engine(
        tiny_llama_dir, num_kv_pages=None, kv_memory_gib=0.01, kv_cache_dtype="bfloat16"
    )
    fp8 = tiny_engine(tiny_llama_dir, num_kv_pages=None, kv_memory_gib=0.01, kv_cache_dtype="fp8")
    assert (
        fp32.pool.k.dtype == torch.float32
        and bf16.pool.k.dtype == bf16.pool.v.dtype == torch.bfloat16
    )
    assert fp8.pool.k.dtype == fp8.pool.v.dtype == torch.float8_e4m3fn
    assert bf16.allocator.num_pages in (
        2 * fp32.allocator.num_pages,
        2 * fp32.allocator.num_pages + 1,
    )
    assert (
        4 * fp32.allocator.num_pages <= fp8.allocator.num_pages <= 4 * fp32.allocator.num_pages + 3
    )
    assert (
        tiny_engine(tiny_llama_dir, dtype="bfloat16").pool.k.dtype == torch.bfloat16
    )  # auto follows --dtype
    with pytest.raises(
        ConfigError,
        match="kv_cache_dtype must be auto, float32, bfloat16 or fp8, not 'int8'",
    ):
        tiny_engine(tiny_llama_dir, kv_cache_dtype="int8")


def test_start_accepted_when_pool_holds_exactly_the_context(tiny_llama_dir):
    engine = tiny_engine(tiny_llama_dir, num_kv_pages=32, max_model_len=128)
    assert engine.allocator.num_pages * 4 == 128


def test_admission_limits(tiny_llama_dir):
    engine = tiny_engine(tiny_llama_dir)
    ok = SamplingParams(max_tokens=8, **GREEDY)
    engine.add_request(list(range(10, 130)), ok)  # 120 + 8 == max_model_len: accepted
    used_before = engine.allocator.num_used
    for prompt, params in [
        (list(range(10, 131)), ok),  # limit + 1
        (
            list(range(10, 138)),
            SamplingParams(max_tokens=None),
        ),  # prompt fills the context
        (list(range(10, 10 + 128 * 4 + 1)), ok),  # pool + 1 tokens
    ]:
        with pytest.raises(InvalidRequest) as e:
            engine.add_request(prompt, params)
        assert e.value.code == "context_length_exceeded"
        assert "128" in e.value.message
    assert engine.allocator.num_used == used_before
    assert engine.scheduler.num_unfinished == 1, "a rejected request never enters a queue"
    assert engine.rejected["context_length_exceeded"] == 3
    run_all(engine)
    assert_pool_empty(engine)


def test_default_max_tokens_fills_the_context(tiny_llama_dir):
    engine = tiny_engine(tiny_llama_dir)
    (req,) = engine.add_request(list(range(10, 100)), SamplingParams(max_tokens=None, **GREEDY))
    assert req.max_tokens == 38
    out = run_all(engine)[(req.parent_id, 0)]
    assert len(out.token_ids) == 38 and out.finish_reason == "length"


def test_generation_stops_at_the_eos_ids_the_model_declares(tiny_llama_dir, tmp_path):
    """config.json's and generation_config.json's eos ids stop a request, whatever the
    tokenizer calls its eos."""
    prompt = list(range(10, 30))
    free = tiny_engine(tiny_llama_dir)
    (req,) = free.add_request(prompt, SamplingParams(max_tokens=8, **GREEDY))
    tokens = run_all(free)[(req.parent_id, 0)].token_ids
    stop_at = next(i for i, t in enumerate(tokens) if i >= 2 and t not in tokens[:i])
    model = shutil.copytree(tiny_llama_dir, tmp_path / "model")
    config = json.loads((model / "config.json").read_text())
    (model / "config.json").write_text(json.dumps(config | {"eos_token_id": 99}))
    (model / "generation_config.json").write_text(json.dumps({"eos_token_id": [tokens[stop_at]]}))
    engine = tiny_engine(model)
    assert (
        engine.eos_token_ids == {tokens[stop_at], 99}
        and engine.tokenizer.eos_token_id not in engine.eos_token_ids
    )
    (req,) = engine.add_request(prompt, SamplingParams(max_tokens=8, temperature=0))
    out = run_all(engine)[(req.parent_id, 0)]
    assert out.token_ids == tokens[: stop_at + 1] and out.finish_reason == "stop"


@pytest.mark.parametrize(
    "params, field",
    [
        (dict(temperature=-0.1), "temperature"),
        (dict(temperature=2.5), "temperature"),
        (dict(top_p=0.0), "top_p"),
        (dict(top_p=1.5), "top_p"),
        (dict(top_k=-2), "top_k"),
        (dict(n=0), "n"),
        (dict(n=100), "n"),
        (dict(max_tokens=0), "max_tokens"),
        (dict(max_tokens=-5), "max_tokens"),
        (dict(logprobs=21), "logprobs"),
        (dict(presence_penalty=3.0), "presence_penalty"),
        (dict(frequency_penalty=-2.5), "frequency_penalty"),
        (dict(stop=["x"] * 17), "stop"),
        (dict(stop=[""]), "stop"),
        (dict(stop_token_ids=[10**9]), "stop_token_ids"),
        (dict(seed=-1), "seed"),
    ],
)
def test_invalid_sampling_parameters_are_rejected(tiny_llama_dir, params, field):
    engine = tiny_engine(tiny_llama_dir)
    with pytest.raises(InvalidRequest) as e:
        engine.add_request([1, 2, 3], SamplingParams(**params))
    assert e.value.param == field
    assert engine.allocator.num_used == 0 and engine.scheduler.num_unfinished == 0


def test_bad_prompts_are_rejected(tiny_llama_dir):
    engine = tiny_engine(tiny_llama_dir)
    for prompt in ([], "", [1, -1], [1, 10**9]):
        with pytest.raises(InvalidRequest) as e:
            engine.add_request(prompt)
        assert e.value.param == "prompt"
    assert engine.scheduler.num_unfinished == 0


def test_preemption_keeps_outputs_correct(tiny_llama_dir):
    prompts = [list(range(20 + i, 60 + i)) for i in range(6)]
    params = SamplingParams(max_tokens=40, **GREEDY)
    roomy = tiny_engine(tiny_llama_dir)
    for p in prompts:
        roomy.add_request(p, params)
    expected = run_all(roomy)
    tight = tiny_engine(
        tiny_llama_dir, num_kv_pages=40, max_model_len=96
    )  # 6 x 80 tokens need 120 pages
    for p in prompts:
        tight.add_request(p, params)
    got = run_all(tight, check=block_tables_disjoint)
    assert tight.scheduler.num_preemptions > 0
    assert [o.token_ids for o in got.values()] == [o.token_ids for o in expected.values()]
    assert_pool_empty(tight)


def test_abort_at_any_time_frees_every_page(tiny_llama_dir):
    engine = tiny_engine(tiny_llama_dir, max_num_seqs=2)
    params = SamplingParams(max_tokens=30, **GREEDY)
    ids = [engine.add_request(list(range(5, 5 + n)), params)[0].parent_id for n in (70, 10, 12, 9)]
    engine.step()  # first request is mid-prefill (32-token budget), the last two are waiting
    first = engine.requests[ids[0]][0]
    assert first.state == RequestState.RUNNING and 0 < first.num_computed_tokens < 70
    engine.abort(ids[0])  # mid-prefill
    engine.abort(ids[3])  # waiting
    for _ in range(5):
        engine.step()
    second = engine.requests[ids[1]][0]
    assert len(second.output_token_ids) > 0
    outs = engine.abort(ids[1])  # mid-decode
    assert outs[0].finished and outs[0].finish_reason == "abort"
    assert engine.abort("no-such-request") == []
    finished = run_all(engine)
    assert [k[0] for k in finished] == [ids[2]]
    assert_pool_empty(engine)


def test_decode_graph_buckets_change_no_token(tiny_llama_dir):
    """The CUDA graphs' padded buckets (extra rows on the scratch slot, extra block-table
    columns of scratch pages), run eagerly here: every logprob is the same bits as without."""
    params = SamplingParams(max_tokens=12, logprobs=0, **GREEDY)
    prompts = [list(range(10, 10 + n)) for n in (3, 9, 17, 30, 5)]
    results = []
    for graphs in (False, True):
        engine = tiny_engine(tiny_llama_dir)
        if graphs:
            r = engine.runner
            r.graphs = DecodeGraphs(
                r.model, engine.pool, 8, 128 // 4, r.decode_kernel, capture=False
            )
        results.append(tokens_and_logprobs(engine, prompts, params))
    assert results[0] == results[1]
    # Five requests decode in a bucket of 8 rows,
    # block tables of 8 to 11 pages in buckets of 8 and 16.
    assert 8 in {rows for rows, _ in r.graphs.graphs} and {8, 16} <= {p for _, p in r.graphs.graphs}


def test_prefill_rows_attend_through_the_kernel_alike_in_any_chunking(tiny_llama_dir):
    """With fp32 layers every prefill row attends through the kernel, alone: a prompt gives the
    same bits prefilled 5 or 48 tokens a step, beside other requests or not, and agrees with
    PyTorch's causal attention over the same pages."""
    params = SamplingParams(max_tokens=6, logprobs=0, **GREEDY)
    prompts = [list(range(10, 70)), list(range(30, 47))]
    results = []
    for budget, kernel_prefill in ((5, True), (48, True), (48, False)):
        engine = tiny_engine(tiny_llama_dir, max_num_batched_tokens=budget, max_num_seqs=4)
        assert engine.runner.kernel_prefill
        engine.runner.kernel_prefill = kernel_prefill
        results.append(tokens_and_logprobs(engine, prompts, params))
    assert results[0] == results[1]
    for (kernel_ids, kernel_lp), (torch_ids, torch_lp) in zip(results[1], results[2]):
        assert kernel_ids == torch_ids
        assert kernel_lp == pytest.approx(torch_lp, abs=1e-4)


def test_mixed_workload_returns_pool_to_baseline(tiny_llama_dir):
    engine = tiny_engine(tiny_llama_dir, num_kv_pages=48, max_model_len=96, max_num_seqs=6)
    ids = []
    for i in range(12):
        params = SamplingParams(max_tokens=10 + 5 * (i % 4), n=1 + i % 2, seed=i, temperature=0.8)
        ids.append(engine.add_request(list(range(3, 20 + 4 * i)), params)[0].parent_id)
    with pytest.raises(InvalidRequest):
        engine.add_request(list(range(200)), SamplingParams())
    for step in range(200):
        if not engine.has_unfinished():
            break
        engine.step()
        block_tables_disjoint(engine)
        if step in (3, 9):
            engine.abort(ids[step])
    assert engine.stats["aborted"] >= 2
    assert_pool_empty(engine)


def test_sentinel_fails_corrupted_requests_and_serves_the_others(tiny_llama_dir):
    engine = tiny_engine(tiny_llama_dir)
    params = SamplingParams(max_tokens=12, **GREEDY)
    victim = engine.add_request(list(range(5, 25)), params)[0]
    thief = engine.add_request(list(range(30, 50)), params)[0]
    bystander = engine.add_request(list(range(60, 70)), params)[0]
    engine.step()
    engine.step()
    # the thief's block table now points at the victim's first page, and the victim's at the thief's
    victim.block_table[0], thief.block_table[0] = (
        thief.block_table[0],
        victim.block_table[0],
    )
    produced = {r.owner: len(r.output_token_ids) for r in (victim, thief)}
    outs = run_all(engine)
    for req in (victim, thief):
        out = outs[(req.parent_id, 0)]
        assert out.finish_reason == "error" and "KV ownership" in out.error
        assert len(out.token_ids) == produced[req.owner], (
            "no token was produced after the corruption"
        )
    assert outs[(bystander.parent_id, 0)].finish_reason == "length"
    assert engine.runner.sentinel_violations == 2
    assert_pool_empty(engine)
    (after,) = engine.add_request([1, 2, 3], params)
    assert run_all(engine)[(after.parent_id, 0)].finish_reason == "length"


def test_unsupported_models_get_a_clear_error(tmp_path):
    import json

    from kvfence.model.config import ModelLoadError

    (tmp_path / "config.json").write_text(json.dumps({"architectures": ["GPT2LMHeadModel"]}))
    with pytest.raises(ModelLoadError, match="unsupported architecture.*GPT2LMHeadModel"):
        LLMEngine(EngineConfig(model=str(tmp_path)), progress=False)
    with pytest.raises(ModelLoadError, match="does not exist"):
        LLMEngine(EngineConfig(model=str(tmp_path / "missing.gguf")), progress=False)
    (tmp_path / "junk.gguf").write_bytes(b"not a gguf file")
    with pytest.raises(ModelLoadError, match="not a readable GGUF"):
        LLMEngine(EngineConfig(model=str(tmp_path / "junk.gguf")), progress=False)


@pytest.mark.parametrize("scrub", ["off", "on-free"])
@pytest.mark.parametrize("kv_cache_dtype", ["float32", "fp8"])
def test_scrub_on_free_zeroes_freed_pages(tiny_llama_dir, scrub, kv_cache_dtype):
    engine = tiny_engine(
        tiny_llama_dir,
        kv_scrub=scrub,
        prefix_cache=False,
        kv_cache_dtype=kv_cache_dtype,
    )
    (req,) = engine.add_request(list(range(5, 30)), SamplingParams(max_tokens=4, **GREEDY))
    engine.step()
    pages = list(req.block_table)
    run_all(engine)
    k = engine.pool.k.view(engine.pool.k.shape[0], -1, 4, *engine.pool.k.shape[2:])[:, pages]
    assert (not k.view(torch.uint8).any()) == (scrub == "on-free")  # every byte zero


@pytest.mark.parametrize(
    "env, imports, expected",
    [
        ({}, "kvfence", ["300000", "True"]),
        (
            {"GOMP_SPINCOUNT": "1000"},
            "kvfence",
            ["1000", "True"],
        ),  # the user's own figure stays
        (
            {"OMP_WAIT_POLICY": "passive"},
            "kvfence",
            ["None", "True"],
        ),  # so does the user's policy
        (
            {},
            "torch, kvfence",
            ["300000", "False"],
        ),  # too late for libgomp: the engine warns
    ],
)
def test_openmp_threads_keep_spinning_between_regions_unless_the_user_chose(env, imports, expected):
    base = {k: v for k, v in os.environ.items() if k not in ("GOMP_SPINCOUNT", "OMP_WAIT_POLICY")}
    code = (
        f"import os, {imports}; print(os.environ.get('GOMP_SPINCOUNT'), kvfence.openmp.WAIT_CHOSEN)"
    )
    done = subprocess.run(
        [sys.executable, "-c", code],
        env={**base, **env},
        capture_output=True,
        text=True,
        check=True,
    )
    assert done.stdout.split() == expected
