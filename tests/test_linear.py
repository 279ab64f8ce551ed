"""The packed linear kernel (csrc/linear.cpp): exact sums, rows independent of the batch,
GGUF blocks giving the bits of their fp32 values; and its 8-bit-activation mode."""

import numpy as np
import pytest
import torch
from gguf.quants import Q4_K

from helpers import random_k_quant_blocks
from kvfence.model.kernels import build, cpu_variant, linear_kernel, packed_rows_kernel
from kvfence.model.linear import (
    ONEDNN_MIN_ROWS,
    Linear,
    onednn_prepacked,
    pack,
    pack_for_int8,
)
from kvfence.model.loader import _cat_rows
from kvfence.model.quant import (
    BLOCK_BYTES,
    blocks_to_float,
    gguf_blocks,
    k_quant_nibbles,
    q6_k_codes,
    sub_blocks,
)


@pytest.fixture(scope="module", params=["this CPU's", "avx2"])
def kernel(request):
    """The kernel build this CPU loads, and the AVX2 build, whose code runs on AVX-512 CPUs
    too: every test below holds for both, bits included."""
    if request.param == "avx2":
        if cpu_variant() is None:
            pytest.skip("this CPU cannot run AVX2 code")
        kernel = build("linear", "avx2").packed_linear
    else:
        kernel = linear_kernel("cpu")
    assert kernel is not None, "the linear kernel must be installed here"
    return kernel


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize(
    "n, k", [(96, 64), (77, 40), (5, 3)]
)  # N and K off the panel and vector widths
def test_matches_float64_reference(kernel, dtype, n, k):
    gen = torch.Generator().manual_seed(n)
    w = torch.randn(n, k, generator=gen).to(dtype)
    bias = torch.randn(n, generator=gen)
    for m in (1, 5, 12, 13, 30):
        x = torch.randn(m, k, generator=gen)
        ref = x.double() @ w.double().T + bias.double()
        torch.testing.assert_close(kernel(x, pack(w), n, bias).double(), ref, atol=1e-4, rtol=1e-5)
        torch.testing.assert_close(
            kernel(x, pack(w), n, None).double(),
            ref - bias.double(),
            atol=1e-4,
            rtol=1e-5,
        )


def test_rows_do_not_depend_on_the_batch(kernel):
    gen = torch.Generator().manual_seed(0)
    w, x = torch.randn(300, 576, generator=gen), torch.randn(64, 576, generator=gen)
    full = kernel(x, pack(w), 300, None)
    for start, rows in [(0, 1), (5, 1), (63, 1), (3, 3), (10, 7), (8, 16), (20, 44)]:
        assert torch.equal(
            kernel(x[start : start + rows], pack(w), 300, None),
            full[start : start + rows],
        )


def test_each_output_is_one_multiply_add_chain_in_k_order(kernel):
    """The bits every CPU must give, AVX-512 or AVX2, any batch: acc = fma(x[k], w[k], acc) for
    k = 0..K-1, then + bias. An fma in fp32 is the fp64 product (exact) plus acc, rounded once
    to fp32 (the fp64 sum's own rounding could only matter at an exact fp32 midpoint)."""
    gen = torch.Generator().manual_seed(4)
    m, n, k = 7, 45, 96
    x, w, bias = (
        torch.randn(m, k, generator=gen),
        torch.randn(n, k, generator=gen),
        torch.randn(n, generator=gen),
    )
    acc = torch.zeros(m, n)
    for i in range(k):
        acc = (x[:, i, None].double() * w[None, :, i].double() + acc.double()).float()
    for rows in (1, 2, 3, 5, 7):
        assert torch.equal(kernel(x[:rows], pack(w), n, bias), acc[:rows] + bias)
    assert not torch.equal(
        kernel(x, pack(w), n, bias), (x.double() @ w.double().T).float() + bias
    )  # order matters


def test_refuses_mismatched_weights(kernel):
    w = pack(torch.randn(64, 32))
    with pytest.raises(RuntimeError, match="weights"):
        kernel(torch.randn(2, 31), w, 64, None)
    with pytest.raises(RuntimeError, match="weights"):
        kernel(torch.randn(2, 32), w, 100, None)
    with pytest.raises(RuntimeError, match="bias"):
        kernel(torch.randn(2, 32), w, 64, torch.randn(63))


@pytest.mark.parametrize("half", [torch.float16, torch.bfloat16])
def test_16_bit_weights_of_fp32_layers_stay_16_bit_with_fp32_bits(kernel, half):
    """A GGUF file's F16/BF16 tensors (or a 16-bit checkpoint) in an fp32 layer: the kernel
    reads them at 2 bytes a weight and widens them exactly, so every batch size gives the bits
    of the same weights held as fp32. Under gguf-int8, x is rounded to their type first, as
    llama.cpp's F16 and BF16 dot products take it."""
    gen = torch.Generator().manual_seed(3)
    w, bias = torch.randn(77, 96, generator=gen).to(half), torch.randn(77, generator=gen)
    cpu = torch.device("cpu")
    layer = Linear(w, bias, torch.float32, cpu, kernel)
    wide = Linear(w.float(), bias, torch.float32, cpu, kernel)
    rounded = Linear(w, bias, torch.float32, cpu, kernel, int8_activations=True)
    assert layer.packed.dtype == rounded.packed.dtype == half
    assert layer.packed.nbytes == wide.packed.nbytes // 2
    for m in (1, 5, 13, 40):
        x = torch.randn(m, 96, generator=gen)
        assert torch.equal(layer(x), wide(x))
        assert torch.equal(rounded(x), wide(x.to(half).float()))
        assert not torch.equal(rounded(x), layer(x))


# Where oneDNN has a bf16 GEMM (AVX-512 BF16, AMX), bf16 layers hand it large batches; elsewhere
# (AVX2) the kernel runs them all.
HAS_ONEDNN_BF16 = onednn_prepacked(torch.zeros(32, 32, dtype=torch.bfloat16)) is not None


def test_bfloat16_large_batches_go_to_onednn_where_it_has_bf16(kernel):
    """bf16 keeps two layouts where oneDNN has bf16: the kernel's below ONEDNN_MIN_ROWS rows,
    oneDNN's prepacked one above. Elsewhere, the kernel's alone, at every batch size."""
    gen = torch.Generator().manual_seed(1)
    w, bias = torch.randn(64, 96, generator=gen), torch.randn(64, generator=gen)
    layer = Linear(w, bias, torch.bfloat16, torch.device("cpu"), kernel)
    assert layer.weight is None and layer.packed.dtype == torch.bfloat16
    assert (layer.onednn is not None) == HAS_ONEDNN_BF16
    for m in (1, ONEDNN_MIN_ROWS - 1, ONEDNN_MIN_ROWS, 100):
        x = torch.randn(m, 96, generator=gen)
        out = layer(x)
        assert out.dtype == torch.bfloat16
        if (
            m < ONEDNN_MIN_ROWS or not HAS_ONEDNN_BF16
        ):  # the kernel keeps x in fp32 and rounds only its result
            assert torch.equal(out, kernel(x, layer.packed, 64, layer.bias).bfloat16())
        else:  # oneDNN rounds x to bf16 first
            exact = (x.double() @ w.bfloat16().double().T + bias.double()).bfloat16()
            assert 1e-3 < (out.float() - exact.float()).abs().max() < 0.3
    fp32 = Linear(w, bias, torch.float32, torch.device("cpu"), kernel)
    assert fp32.weight is None  # fp32 runs the kernel at every batch size


def gguf_weights(
    kind: str, n: int, k: int, magnitude: float, seed: int
) -> tuple[torch.Tensor, torch.Tensor]:
    """Random weights through gguf's own quantizer, or random K-quant blocks (which it cannot
    quantize to): (our blocks, gguf's dequantized fp32)."""
    from gguf import GGMLQuantizationType
    from gguf.quants import dequantize, quantize

    qtype = GGMLQuantizationType[kind]
    if kind.endswith("_K"):
        raw = random_k_quant_blocks(kind, n, k, magnitude, seed)
    else:
        weights = torch.randn(n, k, generator=torch.Generator().manual_seed(seed)) * magnitude
        raw = quantize(weights.numpy(), qtype)
    return gguf_blocks(raw, kind), torch.from_numpy(dequantize(raw, qtype))


@pytest.mark.parametrize(
    "kind, magnitude, k, block_bytes",
    [
        ("Q4_0", 0.1, 96, 640),
        ("Q4_1", 0.1, 96, 640),
        ("Q5_0", 0.1, 96, 1280),
        ("Q5_1", 0.1, 96, 1280),
        ("Q8_0", 0.1, 96, 1280),
        # the K-quants in their own super-blocks of 256 weights, at their file's bytes a weight
        ("Q4_K", 0.1, 512, 4736),
        ("Q5_K", 0.1, 512, 6784),
        ("Q6_K", 0.1, 512, 6720),
        ("Q6_K", 3e3, 768, 6720),  # d * sc * 63 far beyond fp16
        ("Q4_0", 5e4, 96, 768),  # -8 x scale overflows fp16: fp32 scales
    ],
)
def test_gguf_blocks_give_the_fp32_values_bit_for_bit(kernel, kind, magnitude, k, block_bytes):
    """Each type's blocks decode to exactly gguf-py's dequantized values, and the kernel on
    them gives the kernel's results on those fp32 values, in each packed block format."""
    blocks, reference = gguf_weights(kind, 70, k, magnitude, seed=2)
    gen = torch.Generator().manual_seed(2)
    if kind.endswith("_K"):  # the file's blocks as they are
        assert blocks.shape == (70, k // 256, BLOCK_BYTES[kind])
    else:
        assert blocks.shape == (70, k // 16 * 24)
    assert blocks.dtype == torch.uint8
    assert torch.equal(blocks_to_float(blocks), reference)  # as values: d * (8 - 8) may be -0
    bias = torch.randn(70, generator=gen)
    for m in (1, 7, 12, 40):
        x = torch.randn(m, k, generator=gen)
        assert torch.equal(kernel(x, pack(blocks), 70, bias), kernel(x, pack(reference), 70, bias))
    with pytest.raises(RuntimeError, match="weights"):  # blocks packed for another K
        kernel(torch.randn(2, k - 32 if kind.endswith("_K") else 64), pack(blocks), 70, None)
    # rows read back from the packed blocks (a tied embedding's lookup) are gguf's values
    rows = packed_rows_kernel("cpu")
    ids = torch.tensor([0, 69, 31, 32, 5, 5])
    assert torch.equal(rows(pack(blocks), ids, k), reference[ids])
    with pytest.raises(RuntimeError, match="out of range"):
        rows(pack(blocks), torch.tensor([96]), k)
    layer = Linear(blocks, None, torch.float32, torch.device("cpu"), kernel)
    # per weight: 0.625 bytes with 4-bit codes and fp16 scales, 0.75 with fp32 scales, 1.25
    # with 8-bit codes; Q4_K 0.58, Q5_K 0.83, Q6_K 0.82; fp32 would be 4
    group = 256 if kind.endswith("_K") else 32
    assert layer.weight is None and layer.packed.shape == (3, k // group, block_bytes)


def test_a_fused_matrix_of_k_quants_of_different_types_runs_in_their_blocks(kernel):
    """Q/K/V of Q4_K beside a Q6_K V (llama.cpp's Q4_K_M) share no super-block layout: they
    run as one table of panels, each in its own type's layout at about the file's bytes, and
    keep the fp32 values' results. Parts end mid-panel; rows 1 to 40, both tile paths."""
    parts = [
        gguf_weights(kind, n, 512, 0.1, seed=4 + i)
        for i, (kind, n) in enumerate([("Q4_K", 45), ("Q6_K", 32), ("Q5_K", 64)])
    ]
    blocks, reference = [b for b, _ in parts], torch.cat([w for _, w in parts])
    gen = torch.Generator().manual_seed(4)
    bias = torch.randn(141, generator=gen)
    layer = Linear(blocks, bias, torch.float32, torch.device("cpu"), kernel)
    assert layer.packed.dtype == torch.uint8 and layer.packed.dim() == 1
    # each part's own layout, a table and 64-byte alignment: under 0.6x the sub-blocks that a
    # scale per 16 weights would take
    own = sum(pack(b).numel() for b in blocks)
    assert own < layer.packed.numel() <= own + 64 * (2 + 5)
    assert layer.packed.numel() < 0.6 * pack(torch.cat([sub_blocks(b) for b in blocks])).numel()
    for m in (1, 3, 5, 13, 40):
        x = torch.randn(m, 512, generator=gen)
        assert torch.equal(layer(x), kernel(x, pack(reference), 141, bias))
    with pytest.raises(RuntimeError, match="K-quant table"):
        kernel(torch.randn(2, 512), layer.packed, 140, None)
    # bf16: the same table for small batches, oneDNN on the weights widened for large ones
    low = Linear(blocks, bias, torch.bfloat16, torch.device("cpu"), kernel)
    x = torch.randn(ONEDNN_MIN_ROWS - 1, 512, generator=gen)
    assert torch.equal(low(x), kernel(x, pack(reference), 141, bias).bfloat16())
    x = torch.randn(ONEDNN_MIN_ROWS + 8, 512, generator=gen)
    exact = (x.double() @ reference.bfloat16().double().T + bias.double()).float()
    assert (low(x).float() - exact).abs().max() < 0.3


def test_bfloat16_runs_small_batches_on_the_gguf_blocks(kernel):
    """Given blocks, a bf16 layer's kernel path reads them (the exact weights, fewer bytes than
    bf16) and oneDNN, where it has bf16, gets them rounded to bf16."""
    blocks, exact = gguf_weights("Q4_1", 64, 96, 0.1, seed=3)
    gen = torch.Generator().manual_seed(3)
    bias = torch.randn(64, generator=gen)
    layer = Linear(blocks, bias, torch.bfloat16, torch.device("cpu"), kernel)
    assert layer.packed.dtype == torch.uint8 and (layer.onednn is not None) == HAS_ONEDNN_BF16
    for m in (1, ONEDNN_MIN_ROWS - 1, ONEDNN_MIN_ROWS, 100):
        x = torch.randn(m, 96, generator=gen)
        out = layer(x)
        assert out.dtype == torch.bfloat16
        on_blocks = kernel(x, pack(exact), 64, bias).bfloat16()
        if m < ONEDNN_MIN_ROWS or not HAS_ONEDNN_BF16:
            assert torch.equal(out, on_blocks)
        else:  # oneDNN: x and the weights rounded to bf16
            assert not torch.equal(out, on_blocks)
            reference = (x.double() @ exact.bfloat16().double().T + bias.double()).bfloat16()
            assert (out.float() - reference.float()).abs().max() < 0.3


def int8_rows(x: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """x as llama.cpp's Q8_0 and Q8_1 round it: per row and block of 32, codes
    a = round(x * (127 / max|x|)) (ties to even), and d = max|x| / 127 (fp32; stored as fp16)."""
    rows = x.view(x.shape[0], -1, 32)
    top = rows.abs().amax(-1)
    return torch.round(rows * torch.where(top > 0, 127 / top, 0)[..., None]), top / 127


def block_fields(blocks: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """Blocks of 32 (uint8 [N, K/16 * 24], gguf_blocks) -> scales s and offsets o [N, K/32] and
    codes q [N, K/32, 32], w = s q + o (Q8_0: q = code + 128, o = -128 s)."""
    halves = blocks.view(blocks.shape[0], -1, 2, 24)  # both halves of a block have its s, o
    header = halves[:, :, 0, :8].contiguous().view(torch.float32)
    return header[..., 0], header[..., 1], halves[..., 8:].flatten(2).float()


def llama_cpp_int8(x: torch.Tensor, blocks: torch.Tensor, q8_1: bool) -> torch.Tensor:
    """llama.cpp's dot products of rows rounded by int8_rows with blocks of 32, in float64:
    per block s d16 sum(a q) + o S, d16 the fp16 of d and S d16 sum(a) (for Q4_0 and Q5_0,
    o = -8 s, -16 s: s d16 sum(a (q - 8)), llama.cpp's signed codes, in exact arithmetic), or
    with Q8_1's rows (for Q4_1 and Q5_1) the fp16 of d sum(a)."""
    a, d = int8_rows(x)
    s, o, q = block_fields(blocks)
    d16 = d.half().double()
    total = a.sum(-1)
    scaled = (d * total).half().double() if q8_1 else d16 * total
    dots = torch.einsum("mbk,nbk->mnb", a.double(), q.double())
    return (dots * s.double()[None] * d16[:, None] + o.double()[None] * scaled[:, None]).sum(-1)


@pytest.mark.parametrize(
    "kind, block_bytes",
    [("Q4_0", 576), ("Q4_1", 640), ("Q5_0", 704), ("Q5_1", 768), ("Q8_0", 1088)],
)
def test_int8_activations_compute_llama_cpp_arithmetic(kernel, kind, block_bytes):
    """--dtype gguf-int8: rows rounded to 8 bits per block of 32 with fp16 scales (llama.cpp's
    Q8_1 for Q4_1 and Q5_1, whose offsets take its sums; Q8_0 for the others), integer dot
    products, then the scales. Equal to that arithmetic in float64 up to fp32 rounding (and
    the fp16 scales matter: full ones are further off), not to the fp32 results, and each row
    gives the same bits in any batch. Q4_0 and Q5_0 keep no offsets: the file's bytes."""
    blocks, w = gguf_weights(kind, 70, 96, 0.1, seed=4)
    packed = pack_for_int8(blocks)
    assert packed.dtype == torch.int8 and packed.shape == (3, 3, block_bytes)
    gen = torch.Generator().manual_seed(5)
    bias = torch.randn(70, generator=gen)
    x = torch.randn(40, 96, generator=gen)
    x[3] = 0  # a zero block rounds to codes 0 with scale 0
    x[5, :32] *= 1e3  # an outlier block rounds only itself coarsely
    out = kernel(x, packed, 70, bias)
    reference = llama_cpp_int8(x, blocks, kind in ("Q4_1", "Q5_1")) + bias.double()
    torch.testing.assert_close(out.double(), reference, atol=1e-4, rtol=1e-5)
    a, d = int8_rows(x)
    full_scales = (a * d[..., None]).view_as(x).double() @ w.double().T + bias.double()
    assert (full_scales - reference).abs().max() > 10 * (out.double() - reference).abs().max()
    assert torch.equal(out[3], bias)
    exact = kernel(x, pack(blocks), 70, bias)
    assert 1e-3 < (out - exact).abs().max() < 0.1 * exact.abs().max()
    for m in (1, 2, 3, 4, 5, 7, 12):
        assert torch.equal(kernel(x[:m], packed, 70, bias), out[:m])
        assert torch.equal(kernel(x[m : m + 1], packed, 70, bias), out[m : m + 1])
    with pytest.raises(RuntimeError, match="weights"):  # packed for another K
        kernel(torch.randn(2, 64), packed, 70, None)


@pytest.mark.parametrize(
    "kinds, block_bytes, q8_1", [(("Q4_0", "Q5_0"), 704, False), (("Q5_0", "Q5_1"), 768, True)]
)
def test_int8_activations_on_fused_matrices_of_32_weight_types(kernel, kinds, block_bytes, q8_1):
    """Q4_0 beside Q5_0 keeps no offsets either: Q4_0's codes move up by 8 to take Q5_0's zero
    point of 16, which leaves every weight as it was. Q5_0 beside Q5_1 (llama.cpp's Q4_K_S of
    a model whose rows are not of 256, the default one's: Q5_0 Q and K, a Q5_1 V) keeps
    offsets, every row's offset term taking Q8_1's fp16 sum (llama.cpp takes Q8_0's d16
    sum(a) for the Q5_0 rows: fp16 rounding apart)."""
    parts = [gguf_weights(kind, n, 96, 0.1, seed=23 + n) for kind, n in zip(kinds, (48, 40))]
    blocks = _cat_rows([b for b, _ in parts])
    packed = pack_for_int8(blocks)
    assert packed.shape == (3, 3, block_bytes)
    x = torch.randn(6, 96, generator=torch.Generator().manual_seed(24))
    torch.testing.assert_close(
        kernel(x, packed, 88, None).double(), llama_cpp_int8(x, blocks, q8_1), rtol=1e-5, atol=1e-4
    )
    w = torch.cat([w for _, w in parts])
    ids = torch.tensor([0, 47, 48, 87])
    assert torch.equal(packed_rows_kernel("cpu")(packed, ids, 96), w[ids])


@pytest.mark.parametrize("blank", ["Q5_0", "Q8_0"])
def test_blocks_of_zeros_do_not_choose_the_layout(kernel, blank):
    """A block whose scale is 0 is zeros whatever its codes (llama.cpp writes Q5_0's 16 and
    Q8_0's 128 there): beside Q4_0 and Q5_0 rows it neither takes a zero point nor moves
    their codes, where it once put Q4_0's codes under Q5_0's zero point."""
    kinds = ["Q4_0", blank] if blank == "Q5_0" else ["Q4_0", "Q5_0", blank]
    parts = [gguf_weights(kind, 32, 96, 0.1, seed=27 + i) for i, kind in enumerate(kinds)]
    raw = parts[-1][0].clone()
    halves = raw.view(32, -1, 24)
    halves[:, :, :8] = 0  # scale and offset 0: zeros
    halves[:, :, 8:] = 16 if blank == "Q5_0" else 128
    blocks = _cat_rows([b for b, _ in parts[:-1]] + [raw])
    w = torch.cat([w for _, w in parts[:-1]] + [torch.zeros(32, 96)])
    packed = pack_for_int8(blocks)
    x = torch.randn(6, 96, generator=torch.Generator().manual_seed(29))
    torch.testing.assert_close(
        kernel(x, packed, w.shape[0], None).double(),
        llama_cpp_int8(x, blocks, False),
        rtol=1e-5,
        atol=1e-4,
    )
    ids = torch.arange(w.shape[0])
    assert torch.equal(packed_rows_kernel("cpu")(packed, ids, 96), w)


def test_int8_activations_take_q8_0_beside_q4_0_and_q5_0(kernel):
    """A fused Q/K/V of Q5_0, Q4_0 and Q8_0 rows (llama.cpp's Q4_K_M of a model whose rows are
    not of 256) runs as one matrix of signed codes, a Q4_0 whose offset of -8 scales is past
    fp16's range among them."""
    parts = [gguf_weights(kind, 32, 96, 0.1, seed=20) for kind in ("Q5_0", "Q4_0", "Q8_0")]
    parts.append(gguf_weights("Q4_0", 32, 96, 5e4, seed=21))
    packed = pack_for_int8(_cat_rows([blocks for blocks, _ in parts]))
    assert packed.shape == (4, 3, 1088)
    x = torch.randn(6, 96, generator=torch.Generator().manual_seed(22))
    reference = llama_cpp_int8(x, _cat_rows([blocks for blocks, _ in parts]), False)
    # the large Q4_0's blocks' terms, about 1e4 each, cancel to outputs of about 300
    torch.testing.assert_close(
        kernel(x, packed, 128, None).double(), reference, rtol=1e-5, atol=1e-2
    )


def fma(a: torch.Tensor, b: torch.Tensor, c: torch.Tensor) -> torch.Tensor:
    """fp32 a * b + c rounded once: the fp64 product of two fp32 values is exact."""
    return (a.double() * b.double() + c.double()).float()


@pytest.mark.parametrize("kind", ["Q4_0", "Q4_1", "Q5_0", "Q5_1", "Q8_0", "Q4_0+Q5_0"])
def test_int8_activations_give_the_same_bits_on_every_cpu(kernel, kind):
    """The bits of the 8-bit-activation kernel, whatever its instructions (AVX2's vpmaddubsw
    or AVX-512 VNNI's vpdpbusd) and tile: int8_rows' codes a and d16, d's fp16, per row and
    block; per block, in k order, acc = fma(sum(a q), s * d16, acc), q less its zero point
    for Q8_0, Q4_0 and Q5_0 (128, 8, 16: llama.cpp's signed codes), then for Q4_1/Q5_1
    acc = fma(o, S, acc), S the fp16 of d * sum(a); then + bias. The integer sums are exact.
    Q4_0 beside Q5_0 (codes moved up by 8 under Q5_0's zero point) keeps each row's own."""
    kinds = kind.split("+")
    sizes = [70] if len(kinds) == 1 else [40, 30]
    parts = [
        gguf_weights(k, n, 96, 0.1, seed=8 + i)[0] for i, (k, n) in enumerate(zip(kinds, sizes))
    ]
    blocks = parts[0] if len(parts) == 1 else _cat_rows(parts)
    gen = torch.Generator().manual_seed(9)
    x, bias = torch.randn(13, 96, generator=gen), torch.randn(70, generator=gen)
    a, d = int8_rows(x)
    d16 = d.half().float()
    scaled = (d * a.sum(-1)).half().float()
    s, o, q = block_fields(blocks)
    offsets = kind in ("Q4_1", "Q5_1")
    if not offsets:
        zero = {"Q8_0": 128, "Q4_0": 8, "Q5_0": 16}
        q = q - torch.cat([torch.full((n, 1, 1), zero[k]) for k, n in zip(kinds, sizes)])
    acc = torch.zeros(13, 70)
    for b in range(3):
        sums = (
            (a[:, b, None, :].double() * q[None, :, b, :].double()).sum(-1).float()
        )  # exact integers
        acc = fma(sums, s[None, :, b] * d16[:, b, None], acc)
        if offsets:
            acc = fma(o[None, :, b].expand(13, 70), scaled[:, b, None].expand(13, 70), acc)
    expected = acc + bias
    for m in (1, 2, 5, 7, 13):
        assert torch.equal(kernel(x[:m], pack_for_int8(blocks), 70, bias), expected[:m])


def test_int8_activations_need_gguf_weights(kernel):
    with pytest.raises(ValueError, match="GGUF weights"):
        Linear(
            torch.randn(64, 96),
            None,
            torch.float32,
            torch.device("cpu"),
            kernel,
            int8_activations=True,
        )
    offsets, q8_0 = (
        gguf_weights("Q4_1", 32, 96, 0.1, seed=6)[0],
        gguf_weights("Q8_0", 32, 96, 0.1, seed=6)[0],
    )
    with pytest.raises(ValueError, match=r"no 8-bit codes \(Q8_0\) in one matrix with offsets"):
        pack_for_int8(_cat_rows([offsets, q8_0]))
    k_quant, q8_0 = (
        gguf_weights("Q6_K", 64, 256, 0.1, seed=6)[0],
        gguf_weights("Q8_0", 64, 256, 0.1, seed=6)[0],
    )
    with pytest.raises(ValueError, match="all in K-quants or none"):
        pack_for_int8([k_quant, q8_0])  # rounded per 256 k and per 32: no one row of codes
    with pytest.raises(RuntimeError, match="K-quant blocks"):  # parts are K-quants only
        Linear([k_quant, q8_0], None, torch.float32, torch.device("cpu"), kernel)
    layer = Linear(
        gguf_weights("Q4_1", 64, 96, 0.1, seed=7)[0],
        None,
        torch.float32,
        torch.device("cpu"),
        kernel,
        int8_activations=True,
    )
    assert layer.packed.dtype == torch.int8 and layer.weight is None


def q8_k(x: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """x [M, K] as llama.cpp's quantize_row_q8_K rounds it per 256 k: codes
    round(x * (-127 / x_max)) (ties to even, at most 127), x_max the entry of largest
    magnitude, and the scale d = 1 / (-127 / x_max), all in fp32. -> codes [M, K/256, 256]
    (float), d [M, K/256]."""
    blocks = x.view(x.shape[0], -1, 256)
    top = blocks.gather(-1, blocks.abs().argmax(-1, keepdim=True))
    # torch.full_like(...) / top: a number over a tensor would multiply by its reciprocal
    iscale = torch.where(top != 0, torch.full_like(top, -127) / top, torch.zeros_like(top))
    codes = torch.round(blocks * iscale).clamp(max=127)
    return codes, torch.where(top != 0, torch.ones_like(top) / iscale, torch.zeros_like(top))[
        ..., 0
    ]


def k_quant_parts(kinds: list[str], rows: list[int], k: int, seed: int):
    """Random K-quant matrices of each kind, and their fp32 weights stacked."""
    parts = [
        gguf_weights(kind, n, k, 0.1, seed=seed + i) for i, (kind, n) in enumerate(zip(kinds, rows))
    ]
    return [blocks for blocks, _ in parts], torch.cat([w for _, w in parts])


K_MATRICES = [["Q4_K"], ["Q5_K"], ["Q6_K"], ["Q4_K", "Q6_K", "Q5_K"]]


@pytest.mark.parametrize("kinds", K_MATRICES, ids="+".join)
def test_int8_activations_on_k_quants_compute_llama_cpp_arithmetic(kernel, kinds):
    """--dtype gguf-int8 on Q4_K, Q5_K and Q6_K (and a fused matrix mixing them, as a Q4_K_M
    file's Q/K/V does): rows rounded as llama.cpp's Q8_K, per 256 k, then integer dot
    products. Equal to that arithmetic in float64 up to fp32 rounding, and each row gives the
    same bits in any batch."""
    rows = [45, 32, 64][: len(kinds)] if len(kinds) > 1 else [70]  # parts ending mid-panel
    n = sum(rows)
    blocks, w = k_quant_parts(kinds, rows, 512, seed=10)
    packed = pack_for_int8(blocks if len(blocks) > 1 else blocks[0])
    assert packed.dtype == torch.int8 and packed.dim() == 1
    assert torch.equal(build("linear", "avx2").pack_k_quants(blocks, True), packed), (
        "AVX2 CPUs' packing"
    )
    gen = torch.Generator().manual_seed(11)
    bias = torch.randn(n, generator=gen)
    x = torch.randn(40, 512, generator=gen)
    x[3] = 0  # a zero block rounds to codes 0 with scale 0
    x[5, :256] *= 1e3  # an outlier block rounds only its own 256 coarsely
    out = kernel(x, packed, n, bias)
    codes, d = q8_k(x)
    rounded = (codes.double() * d.double()[..., None]).view_as(x)
    reference = rounded @ w.double().T + bias.double()
    torch.testing.assert_close(out.double(), reference, atol=1e-4, rtol=1e-5)
    assert torch.equal(out[3], bias)
    exact = torch.cat([kernel(x, pack(b), b.shape[0], None) for b in blocks], dim=1) + bias
    assert 1e-3 < (out - exact).abs().max() < 0.1 * exact.abs().max()
    for m in (1, 2, 3, 4, 5, 7, 12):
        assert torch.equal(kernel(x[:m], packed, n, bias), out[:m])
        assert torch.equal(kernel(x[m : m + 1], packed, n, bias), out[m : m + 1])
    with pytest.raises(RuntimeError, match="K-quant"):  # packed for another K
        kernel(torch.randn(2, 256), packed, n, None)


def super_block_fields(raw: np.ndarray, kind: str) -> tuple:
    """K-quant blocks (uint8 [R, bytes]) -> d and, but for Q6_K, dmin (fp16 bytes [R, 2]);
    the scales (Q4_K/Q5_K: [R, 8], one per 32 k; Q6_K: int8 bytes [R, 16], one per 16) and
    mins (Q6_K: None); the codes [R, 256] (0-63), as gguf unpacks them."""
    if kind == "Q6_K":
        return raw[:, 208:210], None, raw[:, 192:208], None, q6_k_codes(raw)
    sc, m = Q4_K.get_scale_min(raw[:, 4:16])
    codes = k_quant_nibbles(raw[:, -128:]).reshape(-1, 256)
    if kind == "Q5_K":
        qh = raw[:, 16:48].reshape(-1, 1, 32) >> np.arange(8, dtype=np.uint8).reshape(1, 8, 1)
        codes |= (qh & 1).reshape(-1, 256) << 4
    return raw[:, 0:2], raw[:, 2:4], sc, m, codes


@pytest.mark.parametrize("kind", ["Q4_K", "Q5_K", "Q6_K"])
def test_int8_activations_on_k_quants_give_the_same_bits_on_every_cpu(kernel, kind):
    """The bits of the K-quant kernel, whatever its instructions: per super-block, in k
    order, acc = fma(sumi, d_w * d_x, acc) with sumi = sum_j sc_j (q . a)_j (Q6_K: per 16 k,
    (q . a - 32 sum(a)) times its int8 scale), then for Q4_K/Q5_K acc = fma(sum_j m_j sum(a)_j,
    dmin_w * -d_x, acc); then + bias. The integer sums are exact."""
    supers = 3  # more than a batch's tiles take at a time: their sums wait between chunks
    blocks, _ = k_quant_parts([kind], [70], 256 * supers, seed=12)
    gen = torch.Generator().manual_seed(13)
    x, bias = torch.randn(9, 256 * supers, generator=gen), torch.randn(70, generator=gen)
    a, dx = q8_k(x)  # [9, supers, 256], [9, supers]
    raw = blocks[0].numpy().reshape(-1, blocks[0].shape[2])
    dw, dmin, scales, mins, q = (
        None if t is None else torch.from_numpy(t.copy()) for t in super_block_fields(raw, kind)
    )
    dw = dw.view(torch.float16).float().view(70, supers)
    q = q.view(70, supers, -1, 16 if kind == "Q6_K" else 32).double()
    a = a.view(9, supers, -1, q.shape[-1]).double()
    products = torch.einsum("nsjk,msjk->mnsj", q, a)  # exact integers
    if kind == "Q6_K":
        scales = scales.view(torch.int8).view(70, supers, 16).double()
        products = products - 32 * a.sum(-1)[:, None]
    else:
        scales = torch.from_numpy(scales.numpy().astype("float64")).view(70, supers, 8)
    sumi = (products * scales[None]).sum(-1).float()  # [m, n, super-block]
    acc = torch.zeros(9, 70)
    for sb in range(supers):
        acc = fma(sumi[:, :, sb], dw[None, :, sb] * dx[:, sb, None], acc)
        if dmin is not None:
            m = torch.from_numpy(mins.numpy().astype("float64")).view(70, supers, 8)
            sums = a[:, sb].sum(-1)  # [m, 8]
            summ = (m[None, :, sb] * sums[:, None]).sum(-1).float()
            dm = dmin.view(torch.float16).float().view(70, supers)
            acc = fma(summ, dm[None, :, sb] * -dx[:, sb, None], acc)
    expected = acc + bias
    packed = pack_for_int8(blocks[0])
    for m in (1, 2, 5, 9):
        assert torch.equal(kernel(x[:m], packed, 70, bias), expected[:m])


@pytest.mark.parametrize(
    "kinds", [["Q4_0"], ["Q5_1"], ["Q8_0"], ["Q5_0", "Q8_0"], *K_MATRICES], ids="+".join
)
def test_rows_of_int8_layouts_are_the_dequantized_weights(kinds):
    """A tied embedding under gguf-int8 is looked up in the output layer's 8-bit-activation
    layout: each row decodes to the fp32 values gguf dequantizes to, bit for bit, in any of
    its layouts (a table of K-quant panels of several types included)."""
    rows = [45, 32, 64][: len(kinds)] if len(kinds) > 1 else [70]  # parts ending mid-panel
    k = 512 if kinds[0].endswith("_K") else 96
    parts = [
        gguf_weights(kind, n, k, 0.1, seed=30 + i) for i, (kind, n) in enumerate(zip(kinds, rows))
    ]
    blocks = [b for b, _ in parts]
    packed = pack_for_int8(
        blocks if kinds[0].endswith("_K") and len(blocks) > 1 else _cat_rows(blocks)
    )
    w = torch.cat([w for _, w in parts])
    ids = torch.tensor([0, 1, 31, 32, 33, 63, 64, sum(rows) - 1, 5, 5])
    assert torch.equal(packed_rows_kernel("cpu")(packed, ids, k), w[ids])
    with pytest.raises(RuntimeError, match="out of range"):
        packed_rows_kernel("cpu")(packed, torch.tensor([10_000]), k)
