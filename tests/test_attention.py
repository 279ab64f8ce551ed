"""The C++ decode-attention kernel against the PyTorch gather path, and its bounds checks."""

import math

import pytest
import torch

from kvfence import SamplingParams
from kvfence.config import EngineConfig
from kvfence.engine.llm_engine import LLMEngine
from kvfence.model.attention import AttentionMetadata, PrefillChunk, paged_attention
from kvfence.model.kernels import cpu_variant, decode_kernel


@pytest.fixture(scope="module")
def kernel():
    return decode_kernel("kernel", "cpu")  # raises where the kernel does not build


def random_batch(lengths, page_size=5, num_pages=64, kv_heads=3, heads=9, dim=64, seed=0):
    gen = torch.Generator().manual_seed(seed)
    slots = (num_pages + 1) * page_size
    k = torch.randn(slots, kv_heads, dim, generator=gen)
    v = torch.randn(slots, kv_heads, dim, generator=gen)
    width = -(-max(lengths) // page_size)
    pages = torch.randperm(num_pages, generator=gen).tolist()
    table = []
    for n in lengths:
        mine, pages = pages[: -(-n // page_size)], pages[-(-n // page_size) :]
        table.append(mine + [num_pages] * (width - len(mine)))  # padding: the scratch page
    q = torch.randn(len(lengths), heads, dim, generator=gen)
    return q, k, v, torch.tensor(table), torch.tensor(lengths)


def meta(table, lengths, page_size, kernel):
    return AttentionMetadata(
        slot_mapping=torch.zeros(len(lengths), dtype=torch.long),
        page_size=page_size,
        num_decode=len(lengths),
        decode_block_table=table,
        decode_lens=lengths,
        prefills=[],
        decode_kernel=kernel,
    )


@pytest.mark.parametrize("dim", [64, 128, 48])  # the two head sizes compiled for, and any other
@pytest.mark.parametrize("cache_dtype", [torch.float32, torch.bfloat16, torch.float8_e4m3fn])
# 1 to 8 query heads a KV head: with AVX-512 and 64 dims they go in registers 4 at a time
@pytest.mark.parametrize("heads, kv_heads", [(9, 3), (2, 2), (10, 2), (8, 1)])
def test_kernel_matches_gathered_attention(kernel, dim, cache_dtype, heads, kv_heads):
    lengths = [1, 4, 5, 6, 16, 17, 33, 100]
    q, k, v, table, lens = random_batch(lengths, dim=dim, heads=heads, kv_heads=kv_heads)
    k, v = k.to(cache_dtype), v.to(cache_dtype)
    ours = kernel(q, k, v, table, lens, 5, 0.125)  # fp32 math and output from any pool
    ref = paged_attention(q, k.float(), v.float(), meta(table, lens, 5, None), scale=0.125)
    torch.testing.assert_close(ours, ref, atol=1e-5, rtol=1e-5)
    out_dtype = (
        torch.float32 if cache_dtype == torch.float8_e4m3fn else cache_dtype
    )  # fp8: the model's dtype
    # the torch path gathers the pool as it is stored too
    for chosen_kernel in (kernel, None):
        out = paged_attention(q, k, v, meta(table, lens, 5, chosen_kernel), scale=0.125)
        assert out.dtype == out_dtype
        torch.testing.assert_close(out, ref.to(out_dtype))


@pytest.mark.parametrize("dim", [64, 48])  # AVX-512 registers, and the plain loops
def test_fp8_pool_reads_exactly_the_values_it_holds(kernel, dim):
    """The kernel widens fp8 e4m3 exactly, over every code (subnormals, the largest, negative
    zero): with 64 dims on AVX-512 (through fp16, scaled once per sum) it gives the bits of an
    fp32 pool holding the same values; the plain loops (other dims, or an AVX2 build), whose
    vectorized sums the compiler may order otherwise for each pool type, agree to 1e-4."""
    q, k, v, table, lens = random_batch([1, 7, 40, 130], num_pages=64, dim=dim)
    codes = torch.arange(256, dtype=torch.uint8)
    codes = codes[~codes.view(torch.float8_e4m3fn).float().isnan()]  # 0x7f and 0xff are NaN
    gen = torch.Generator().manual_seed(1)
    k, v = (
        codes[torch.randint(len(codes), t.shape, generator=gen)].view(torch.float8_e4m3fn)
        for t in (k, v)
    )
    q = q / 1000  # scores of a few units over keys up to 448: softmax far from one-hot
    ours, ref = (
        kernel(q, k, v, table, lens, 5, 0.125),
        kernel(q, k.float(), v.float(), table, lens, 5, 0.125),
    )
    if dim == 64 and cpu_variant() == "avx512":
        assert torch.equal(ours, ref)
    else:
        torch.testing.assert_close(ours, ref, rtol=0, atol=1e-4)


def test_prefill_reads_a_bf16_pool_in_the_models_dtype():
    """Under fp32 layers (gguf-int8's bf16 pool), prefill attention widens the pool and runs
    in fp32, as decode does: CPUs without bf16 arithmetic run it several times slower in
    bf16. bf16 layers keep it in bf16. Either way the result is handed on in the pool's dtype."""
    gen = torch.Generator().manual_seed(0)
    q = torch.randn(6, 9, 64, generator=gen)
    k, v = (torch.randn(10, 3, 64, generator=gen).to(torch.bfloat16) for _ in range(2))
    context = torch.tensor([7, 2, 9, 0, 4, 5])  # the request's slots, in position order
    chunk = AttentionMetadata(
        slot_mapping=context,
        page_size=5,
        num_decode=0,
        decode_block_table=None,
        decode_lens=None,
        prefills=[PrefillChunk(0, 6, context, None)],
    )

    def sdpa(dtype):
        q4, k4, v4 = (t.to(dtype).transpose(0, 1)[None] for t in (q, k[context], v[context]))
        o = torch.nn.functional.scaled_dot_product_attention(
            q4, k4, v4, is_causal=True, scale=0.125, enable_gqa=True
        )
        return o[0].transpose(0, 1).to(torch.bfloat16)

    assert torch.equal(paged_attention(q, k, v, chunk, scale=0.125), sdpa(torch.float32))
    assert torch.equal(paged_attention(q, k, v, chunk, 0.125, torch.bfloat16), sdpa(torch.bfloat16))
    assert not torch.equal(sdpa(torch.float32), sdpa(torch.bfloat16))


def run_with_threads(kernel, threads, *args):
    before = torch.get_num_threads()
    torch.set_num_threads(threads)
    try:
        return kernel(*args)
    finally:
        torch.set_num_threads(before)


@pytest.mark.parametrize("threads", [1, 2, 3])
def test_kernel_runs_every_request_however_the_threads_split_the_batch(kernel, threads):
    """The threads share out the batch's positions times its KV heads, not its requests: a
    long request among short ones, or a share that holds no task's middle, still leaves none
    out. Each request's result is the same bits alone, in the batch, and on any thread count."""
    lengths = [200, 1, 1, 3, 90, 1, 17]
    q, k, v, table, lens = random_batch(lengths, num_pages=80)
    ours = run_with_threads(kernel, threads, q, k, v, table, lens, 5, 0.125)
    ref = paged_attention(q, k, v, meta(table, lens, 5, None), scale=0.125)
    torch.testing.assert_close(ours, ref, atol=1e-5, rtol=1e-5)
    for i in (0, 4):
        alone = run_with_threads(
            kernel, 2, q[i : i + 1], k, v, table[i : i + 1], lens[i : i + 1], 5, 0.125
        )
        assert torch.equal(alone[0], ours[i])


def test_kernel_reads_only_its_own_pages(kernel):
    """Filling every page a request does not own with garbage changes nothing it computes."""
    q, k, v, table, lens = random_batch([7, 12])
    before = kernel(q, k, v, table, lens, 5, 0.125)
    own = {int(p) for row, n in zip(table, lens) for p in row[: -(-int(n) // 5)]}
    for page in set(range(65)) - own:
        k[page * 5 : (page + 1) * 5] = 1e6
        v[page * 5 : (page + 1) * 5] = float("nan")
    torch.testing.assert_close(kernel(q, k, v, table, lens, 5, 0.125), before, atol=0, rtol=0)


def test_kernel_refuses_pages_outside_the_pool(kernel):
    q, k, v, table, lens = random_batch([7, 12])
    table[1, 1] = 65  # one past the scratch page
    with pytest.raises(RuntimeError, match="page outside the pool"):
        kernel(q, k, v, table, lens, 5, 0.125)
    table[1, 1] = -1
    with pytest.raises(RuntimeError, match="page outside the pool"):
        kernel(q, k, v, table, lens, 5, 0.125)
    lens[0] = 100  # longer than its block table
    with pytest.raises(RuntimeError, match="length outside the block table"):
        kernel(q, k, v, table, lens, 5, 0.125)


def readable_slots(table, lens, page_size, num_slots):
    """[slots] bool: the slots some row of the batch may read, positions below its length."""
    readable = torch.zeros(num_slots, dtype=torch.bool)
    for row, n in zip(table.tolist(), lens.tolist()):
        pos = torch.arange(n)
        readable[torch.tensor(row)[pos // page_size] * page_size + pos % page_size] = True
    return readable


@pytest.mark.parametrize("path", ["kernel", "torch"])
def test_stale_nan_past_a_rows_length_stays_out_of_attention(kernel, path):
    """NaN that an earlier owner left in a page (past a row's length in its last page, in
    the scratch page that pads block tables) reaches no output: a masked slot's weight of
    zero times NaN would still be NaN."""
    q, k, v, table, lens = random_batch([1, 4, 6, 17, 33])
    attend = meta(table, lens, 5, kernel if path == "kernel" else None)
    clean = paged_attention(q, k, v, attend, scale=0.125)
    stale = ~readable_slots(table, lens, 5, k.shape[0])
    k[stale], v[stale] = float("nan"), float("nan")
    out = paged_attention(q, k, v, attend, scale=0.125)
    assert torch.isfinite(out).all()
    torch.testing.assert_close(out, clean, atol=0, rtol=0)


@pytest.mark.parametrize("attention", ["kernel", "torch"])
def test_nan_left_in_freed_pages_changes_no_output(tiny_llama_dir, attention):
    """Every page of the pool holds NaN, as if freed by an owner whose KV overflowed: prefill
    and decode, on either attention path, read none of it."""

    def outputs(poisoned: bool):
        config = EngineConfig(
            model=str(tiny_llama_dir),
            page_size=4,
            num_kv_pages=64,
            max_model_len=128,
            attention=attention,
            num_threads=1,
        )
        engine = LLMEngine(config, progress=False)
        if poisoned:
            engine.pool.k.fill_(float("nan"))
            engine.pool.v.fill_(float("nan"))
        params = SamplingParams(temperature=0, max_tokens=6, ignore_eos=True, logprobs=1)
        reqs = [engine.add_request(list(range(3, 3 + n)), params)[0] for n in (1, 5, 10)]
        done = {}
        while engine.has_unfinished():
            done.update({out.request_id: out for out in engine.step() if out.finished})
        finished = [done[r.parent_id] for r in reqs]
        return [(out.token_ids, [entry["logprob"] for entry in out.logprobs]) for out in finished]

    clean, poisoned = outputs(False), outputs(True)
    assert all(math.isfinite(lp) for _, logprobs in poisoned for lp in logprobs)
    assert poisoned == clean
