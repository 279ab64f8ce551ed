"""kvfence: an LLM inference server whose requests never read each other's KV cache."""

from kvfence import openmp as openmp  # first: it must run before anything loads torch
from kvfence.engine.sampling_params import SamplingParams
from kvfence.llm import LLM

__all__ = ["LLM", "SamplingParams"]
