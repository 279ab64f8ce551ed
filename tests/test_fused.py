"""The fused element-wise kernel (csrc/fused.cpp) against the PyTorch ops it replaces."""

import subprocess
import sys
from pathlib import Path

import numpy as np
import pytest
import torch

from kvfence.model.kernels import fused_ops
from kvfence.model.llama import TorchOps


@pytest.fixture(scope="module")
def ops():
    module = fused_ops("cpu")
    assert module is not None, "csrc/fused.cpp is not installed (see the warning above)"
    return module


@pytest.mark.parametrize("delta_dtype", [None, torch.float32, torch.bfloat16])
@pytest.mark.parametrize("out_dtype", [torch.float32, torch.bfloat16])
def test_add_rms_norm_matches_torch(ops, delta_dtype, out_dtype):
    gen = torch.Generator().manual_seed(0)
    x, weight = torch.randn(37, 96, generator=gen), torch.randn(96, generator=gen)
    delta = None if delta_dtype is None else torch.randn(37, 96, generator=gen).to(delta_dtype)
    ours_x, ref_x = x.clone(), x.clone()
    ours = ops.add_rms_norm(ours_x, delta, weight, 1e-5, out_dtype)
    ref = TorchOps.add_rms_norm(ref_x, delta, weight, 1e-5, out_dtype)
    assert ours.dtype == out_dtype and torch.equal(
        ours_x, ref_x
    )  # the residual is updated in place, exactly
    tol = 1e-5 if out_dtype == torch.float32 else 1e-2  # bf16: at most one rounding step apart
    torch.testing.assert_close(ours.float(), ref.float(), atol=tol, rtol=tol)


NORM_CASES = [(w, d, o) for w in (576, 2048) for d in (None, "bf16") for o in ("fp32", "bf16")]
DTYPES = {"fp32": torch.float32, "bf16": torch.bfloat16}


def norm_inputs(width: int, delta: str | None):
    gen = torch.Generator().manual_seed(2)
    x, weight = torch.randn(300, width, generator=gen) * 3, torch.randn(width, generator=gen)
    d = None if delta is None else torch.randn(300, width, generator=gen).bfloat16()
    return x, d, weight


def norm_outputs(ops) -> list[torch.Tensor]:
    out = []
    for width, delta, dtype in NORM_CASES:
        x, d, weight = norm_inputs(width, delta)
        out.append(ops.add_rms_norm(x, d, weight, 1e-6, DTYPES[dtype]))
    return out


def test_add_rms_norm_takes_llama_cpps_scale_exactly(ops, tmp_path):
    """llama.cpp's rms_norm: the squares summed in double, the mean rounded to float, then
    1 / sqrtf(mean + eps) rounded once, x * scale * weight. An approximate 1 / sqrt (what
    -ffast-math makes of it) is an ulp off on some rows, and under gguf-int8 that ulp can move
    an 8-bit code of x and the logits by 0.1 against llama.cpp's. Every row, this CPU's build
    and the AVX2 one (in a process of its own: the two builds cannot share one)."""
    script = (
        f"import sys, torch; sys.path.insert(0, {str(Path(__file__).parent)!r})\n"
        "from test_fused import norm_outputs\n"
        "from kvfence.model.kernels import build\n"
        f"torch.save(norm_outputs(build('fused', 'avx2')), {str(tmp_path / 'avx2.pt')!r})"
    )
    subprocess.run([sys.executable, "-c", script], check=True)
    avx2 = torch.load(tmp_path / "avx2.pt")
    for (width, delta, out), *built in zip(NORM_CASES, norm_outputs(ops), avx2, strict=True):
        x, d, weight = norm_inputs(width, delta)
        xs, w = (x if d is None else x + d.float()).numpy(), weight.numpy()
        mean = ((xs * xs).astype(np.float64).sum(axis=1) / width).astype(np.float32)
        scale = np.float32(1) / np.sqrt(mean + np.float32(1e-6))
        ref = torch.from_numpy(xs * scale[:, None] * w).to(DTYPES[out])
        assert all(torch.equal(b, ref) for b in built), (width, delta, out)


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_silu_mul_matches_torch(ops, dtype):
    gate_up = (3 * torch.randn(37, 2 * 80, generator=torch.Generator().manual_seed(1))).to(dtype)
    ours, ref = ops.silu_mul(gate_up), TorchOps.silu_mul(gate_up)
    assert ours.dtype == dtype and ours.shape == (37, 80)
    tol = 1e-5 if dtype == torch.float32 else 2e-2
    torch.testing.assert_close(ours.float(), ref.float(), atol=tol, rtol=tol)


@pytest.mark.parametrize("qkv_dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("cache_dtype", [torch.float32, torch.bfloat16, torch.float8_e4m3fn])
def test_rope_write_kv_matches_torch(ops, qkv_dtype, cache_dtype):
    gen = torch.Generator().manual_seed(3)
    rows, heads, kv_heads, dim = 11, 6, 2, 64
    qkv = torch.randn(rows, (heads + 2 * kv_heads) * dim, generator=gen).to(qkv_dtype)
    angles = torch.randn(rows, dim // 2, generator=gen)
    cos, sin = (
        torch.cat((angles, angles), -1).cos(),
        torch.cat((-angles.sin(), angles.sin()), -1),
    )
    slots = torch.randperm(40, generator=gen)[:rows]
    caches = [torch.zeros(40, kv_heads, dim, dtype=cache_dtype) for _ in range(4)]
    ours = ops.rope_write_kv(qkv, cos, sin, caches[0], caches[1], slots, heads)
    ref = TorchOps.rope_write_kv(qkv, cos, sin, caches[2], caches[3], slots, heads)
    assert ours.dtype == torch.float32 and ours.shape == (rows, heads, dim)
    torch.testing.assert_close(ours, ref, atol=1e-5, rtol=1e-5)
    tol = {torch.float32: 1e-5, torch.bfloat16: 1e-2, torch.float8_e4m3fn: 0.07}[cache_dtype]
    torch.testing.assert_close(caches[0].float(), caches[2].float(), atol=tol, rtol=tol)  # the keys
    assert torch.equal(
        caches[1].view(torch.uint8), caches[3].view(torch.uint8)
    )  # the values, copied (and rounded) alike
    untouched = torch.ones(40, dtype=torch.bool)
    untouched[slots] = False
    assert not caches[0][untouched].any() and not caches[1][untouched].any()


@pytest.mark.parametrize("vocab", [49152, 1001, 7])
def test_argmax_rows_picks_the_first_maximum_like_torch(ops, vocab):
    gen = torch.Generator().manual_seed(3)
    logits = torch.randn(9, vocab, generator=gen)
    logits[1, vocab // 3] = logits[1, vocab - 1] = 50.0  # a tie: the first one wins
    logits[2, vocab - 1] = 60.0  # the last column, past the vector lanes
    logits[3] = 1.0  # all equal: column 0
    logits[4, 1:] = -torch.inf
    assert ops.argmax_rows(logits).tolist() == logits.argmax(dim=-1).tolist()
    assert ops.argmax_rows(logits).tolist()[1:4] == [vocab // 3, vocab - 1, 0]


def test_rows_do_not_depend_on_the_batch(ops):
    gen = torch.Generator().manual_seed(2)
    x, delta, weight = (
        torch.randn(64, 576, generator=gen),
        torch.randn(64, 576, generator=gen),
        torch.randn(576),
    )
    batch = ops.add_rms_norm(x.clone(), delta, weight, 1e-5, torch.float32)
    alone = ops.add_rms_norm(x[5:6].clone(), delta[5:6].clone(), weight, 1e-5, torch.float32)
    assert torch.equal(batch[5:6], alone)
    gate_up = torch.randn(64, 3072, generator=gen)
    assert torch.equal(ops.silu_mul(gate_up)[9:10], ops.silu_mul(gate_up[9:10].clone()))


def test_bad_inputs_are_refused(ops):
    with pytest.raises(RuntimeError, match="x: contiguous fp32"):
        ops.add_rms_norm(torch.randn(4, 8).bfloat16(), None, torch.randn(8), 1e-5, torch.float32)
    with pytest.raises(RuntimeError, match="weight"):
        ops.add_rms_norm(torch.randn(4, 8), None, torch.randn(7), 1e-5, torch.float32)
    with pytest.raises(RuntimeError, match="delta"):
        ops.add_rms_norm(torch.randn(4, 8), torch.randn(4, 7), torch.randn(8), 1e-5, torch.float32)
    with pytest.raises(RuntimeError, match="gate_up"):
        ops.silu_mul(torch.randn(4, 7))
    with pytest.raises(RuntimeError, match="logits"):
        ops.argmax_rows(torch.randn(4, 8).bfloat16())
    cache = torch.zeros(8, 1, 4)
    qkv, cos, sin = torch.randn(2, 12), torch.randn(2, 4), torch.randn(2, 4)
    for slot in (8, -1):  # one past the pool, and negative
        with pytest.raises(RuntimeError, match="slot outside the pool"):
            ops.rope_write_kv(qkv, cos, sin, cache, cache.clone(), torch.tensor([0, slot]), 1)
    assert not cache.any()  # checked before anything is written


def test_fp8_writes_round_to_nearest_even_and_saturate_like_torch(ops):
    """Every e4m3 value, every midpoint between two (ties go to the even code), subnormals,
    values past 448 and infinities: the kernel's integer rounding gives torch's bytes."""
    fp8 = torch.float8_e4m3fn
    values = torch.arange(256, dtype=torch.uint8).view(fp8).float()
    values = values[values.isfinite()].unique()
    midpoints = (values[1:] + values[:-1]) / 2
    gen = torch.Generator().manual_seed(5)
    spread = torch.cat([torch.randn(4000, generator=gen) * s for s in (1e-3, 3e-2, 1.0, 100.0)])
    x = torch.cat(
        [
            values,
            midpoints,
            -midpoints,
            spread,
            torch.tensor([449.0, 464.0, 1e9, -1e9, torch.inf, -torch.inf]),
        ]
    )
    x = torch.cat([x, torch.zeros(-x.numel() % 64)]).view(-1, 1, 64)
    rows = x.shape[0]
    qkv = torch.cat(
        [torch.zeros(rows, 2 * 64), x.view(rows, 64)], dim=1
    )  # one query head, one KV head: the values
    v_ours, v_ref = (torch.zeros(rows, 1, 64, dtype=fp8) for _ in range(2))
    ones, zeros = torch.ones(rows, 64), torch.zeros(rows, 64)
    ops.rope_write_kv(
        qkv,
        ones,
        zeros,
        torch.zeros(rows, 1, 64, dtype=fp8),
        v_ours,
        torch.arange(rows),
        1,
    )
    TorchOps.rope_write_kv(
        qkv,
        ones,
        zeros,
        torch.zeros(rows, 1, 64, dtype=fp8),
        v_ref,
        torch.arange(rows),
        1,
    )
    assert torch.equal(v_ours.view(torch.uint8), v_ref.view(torch.uint8))
    assert torch.equal(v_ours.view(torch.uint8), x.clamp(-448, 448).to(fp8).view(torch.uint8))
    assert v_ours.float().abs().max() == 448
