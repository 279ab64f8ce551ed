// Which build of the kernels this CPU runs, from CPUID. GCC's builtin also checks that the OS
// saves the wide registers, which CPUID's feature bits alone do not say. Compiled for baseline
// x86-64, so that it runs on any CPU.
#include <pybind11/pybind11.h>

#include <string>

namespace {

// The -march of each build in setup.py, as CPUID feature sets.
bool supports(const std::string& variant) {
  __builtin_cpu_init();
  if (variant == "avx512")
    return __builtin_cpu_supports("x86-64-v4") && __builtin_cpu_supports("avx512vnni");
  if (variant == "avx2") return __builtin_cpu_supports("x86-64-v3");
  return false;
}

}  // namespace

PYBIND11_MODULE(TORCH_EXTENSION_NAME, m) {
  m.def("supports", &supports, "whether this CPU runs the kernels built for `variant`");
}
