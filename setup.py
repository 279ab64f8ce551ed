"""Builds the CPU kernels of kvfence/model/csrc at install time, once for AVX2 and once for
AVX-512; kvfence.model.kernels loads the widest this CPU runs (CPUID) and never compiles.

The modules land in kvfence/model/_ext/ of this install (of the checkout, for `pip install -e`),
so two installs on one machine never share a build. Where a kernel cannot be built (no C++
compiler, not an x86-64 CPU), the install goes on without it and the PyTorch paths run.
"""

import platform

from setuptools import setup
from torch.utils.cpp_extension import BuildExtension, CppExtension

CSRC = "kvfence/model/csrc"
# x86-64-v3 is AVX2 with FMA and F16C; the AVX-512 build adds VNNI, which its 8-bit path uses.
VARIANTS = {"avx2": ["-march=x86-64-v3"], "avx512": ["-march=x86-64-v4", "-mavx512vnni"]}
# -ffast-math lets exp and the reductions vectorize; the linear kernel's sums must keep their
# order, so it is built without.
FAST_MATH = {"fused": True, "linear": False, "paged_attention": True}


def kernel(name: str, variant: str) -> CppExtension:
    flags = ["-O3", "-fopenmp", *VARIANTS[variant]] + (["-ffast-math"] if FAST_MATH[name] else [])
    return CppExtension(
        f"kvfence.model._ext.{name}_{variant}",
        [f"{CSRC}/{name}.cpp"],
        depends=[f"{CSRC}/elements.h"],
        extra_compile_args=flags,
        extra_link_args=["-fopenmp"],
    )


class OptionalBuild(BuildExtension):
    """A kernel that fails to build is left out with a warning: kvfence then runs its PyTorch
    path, and says so when it starts."""

    def build_extensions(self) -> None:
        try:
            super().build_extensions()
        except Exception as e:  # torch checks the compiler before building any: none is there
            print(f"warning: no CPU kernels built, the PyTorch paths will run: {e}")

    def build_extension(self, ext) -> None:
        try:
            super().build_extension(ext)
        except Exception as e:  # this kernel's compile failed; the others may still build
            print(f"warning: {ext.name} not built, its PyTorch path will run: {e}")


extensions = []
if platform.machine() in ("x86_64", "AMD64"):
    # Baseline x86-64 code: it must run on any CPU to say which build that CPU can run.
    extensions.append(CppExtension("kvfence.model._ext.cpu", [f"{CSRC}/cpu.cpp"]))
    extensions += [kernel(name, variant) for name in FAST_MATH for variant in VARIANTS]

setup(ext_modules=extensions, cmdclass={"build_ext": OptionalBuild})
