"""kvfence: an LLM inference server whose requests never read each other's KV cache."""

import importlib

from kvfence import openmp as openmp  # first: it must run before anything loads torch

# Imported on first use, so that the audit (kvfence.audit) imports without the engine or torch
_LAZY = {
    "LLM": "kvfence.llm",
    "SamplingParams": "kvfence.engine.sampling_params",
    "StructuredOutputs": "kvfence.engine.sampling_params",
}
__all__ = list(_LAZY)


def __getattr__(name: str):
    if name not in _LAZY:
        raise AttributeError(f"module 'kvfence' has no attribute {name!r}")
    return getattr(importlib.import_module(_LAZY[name]), name)
