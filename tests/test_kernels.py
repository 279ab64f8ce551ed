"""The CPU kernels are built at install (setup.py) and only loaded at run time: the widest
build this CPU runs, from this install's own files. Without them the PyTorch paths run, and
the log says what is slower."""

import logging
import os
import subprocess
import sys
from pathlib import Path

import pytest

import kvfence
from kvfence.engine.sampling_params import SamplingParams
from kvfence.llm import LLM
from kvfence.model import kernels

REPO = Path(__file__).resolve().parent.parent
KERNELS = ("fused", "linear", "paged_attention")
# The CPU flags, as Linux reads them from CPUID, that each build's -march needs (setup.py).
X86_64_V3 = {"avx", "avx2", "bmi1", "bmi2", "f16c", "fma", "movbe", "abm"}
X86_64_V4 = X86_64_V3 | {"avx512f", "avx512bw", "avx512cd", "avx512dq", "avx512vl"}
SEES_KERNELS = """
import sys
from kvfence.llm import LLM
from kvfence.model import kernels
print(LLM(model=sys.argv[1], num_kv_pages=64).engine.describe())
print(*[kernels.build(name).__file__ for name in ("fused", "linear", "paged_attention")])
"""


def cpu_flags() -> set[str]:
    line = next(x for x in Path("/proc/cpuinfo").read_text().splitlines() if x.startswith("flags"))
    return set(line.split(":", 1)[1].split())


@pytest.fixture
def no_kernels(monkeypatch):
    """Kernels as an install without a C++ compiler has them: none."""
    monkeypatch.setitem(sys.modules, "kvfence.model._ext.cpu", None)  # import raises
    kernels.cpu_variant.cache_clear()
    kernels.build.cache_clear()
    yield
    monkeypatch.undo()
    kernels.cpu_variant.cache_clear()
    kernels.build.cache_clear()


def test_this_cpu_loads_the_widest_build_it_runs():
    flags = cpu_flags()
    if X86_64_V4 <= flags and "avx512_vnni" in flags:
        expected = "avx512"
    elif X86_64_V3 <= flags:
        expected = "avx2"
    else:
        pytest.skip("this CPU runs neither build")
    assert kernels.cpu_variant() == expected
    for name in KERNELS:
        assert kernels.build(name).__name__ == f"kvfence.model._ext.{name}_{expected}"


def test_a_start_compiles_nothing_and_uses_this_installs_kernels(tmp_path, tiny_llama_dir):
    # With no working compiler and an empty extension cache, any build at start would fail and
    # the engine would run attention in PyTorch.
    env = dict(os.environ, CXX="/bin/false", CC="/bin/false", TORCH_EXTENSIONS_DIR=str(tmp_path))
    run = subprocess.run(
        [sys.executable, "-c", SEES_KERNELS, str(tiny_llama_dir)],
        env=env,
        capture_output=True,
        text=True,
        timeout=300,
    )
    assert run.returncode == 0, run.stderr
    description, files = run.stdout.strip().splitlines()[-2:]
    assert "attention kernel" in description
    assert "unavailable" not in run.stderr and "no CPU kernels" not in run.stderr
    package = Path(kvfence.__file__).parent / "model" / "_ext"
    assert all(Path(f).parent == package for f in files.split())
    assert list(tmp_path.iterdir()) == []


def test_without_kernels_the_pytorch_paths_run_and_say_so(no_kernels, tiny_llama_dir, caplog):
    caplog.set_level(logging.WARNING, logger="kvfence.kernels")
    llm = LLM(model=str(tiny_llama_dir), num_kv_pages=64)
    assert "attention torch" in llm.engine.describe()
    params = SamplingParams(max_tokens=4, temperature=0, ignore_eos=True)
    out = llm.generate("Hello there", params)[0].outputs[0]
    assert out.error is None and len(out.token_ids) == 4
    for slower in kernels.FALLBACKS.values():
        assert slower in caplog.text
    with pytest.raises(RuntimeError, match="--attention kernel was asked for"):
        kernels.decode_kernel("kernel", "cpu")


def test_an_install_whose_compiler_fails_goes_on_without_the_kernels(tmp_path):
    # A compiler that reports a version, as torch checks before building, and fails each compile.
    cxx = tmp_path / "c++"
    cxx.write_text('#!/bin/sh\ncase "$*" in *--version*) exec g++ "$@";; esac\nexit 1\n')
    cxx.chmod(0o755)
    run = subprocess.run(
        [sys.executable, "setup.py", "-q", "build_ext"]
        + ["--build-lib", str(tmp_path / "lib"), "--build-temp", str(tmp_path / "tmp")],
        cwd=REPO,
        env=dict(os.environ, CXX=str(cxx), CC=str(cxx)),
        capture_output=True,
        text=True,
        timeout=300,
    )
    assert run.returncode == 0, run.stderr
    for name in KERNELS:
        assert f"kvfence.model._ext.{name}_avx512 not built" in run.stdout
    assert not list(tmp_path.rglob("*.so"))


def test_a_kernel_lets_other_threads_run_while_it_computes():
    """The server's event loop answers requests while a step computes: a kernel lets the GIL
    go, so another Python thread runs in the middle of the call, not only after it."""
    import threading
    import time

    import torch

    ops = kernels.fused_ops("cpu")
    gate_up = torch.randn(2048, 2 * 16384)
    seen, stop = [], threading.Event()

    def tick():
        while not stop.is_set():
            seen.append(time.perf_counter())
            time.sleep(0.0005)

    ticker = threading.Thread(target=tick)
    ticker.start()
    time.sleep(0.01)
    start = time.perf_counter()
    ops.silu_mul(gate_up)
    end = time.perf_counter()
    stop.set()
    ticker.join()
    third = (end - start) / 3
    assert any(start + third < t < end - third for t in seen), f"the call took {end - start:.3f} s"
