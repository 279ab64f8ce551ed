"""kvfence: an LLM inference server whose requests never read each other's KV cache."""
from kvfence.engine.sampling_params import SamplingParams
from kvfence.llm import LLM

__all__ = ["LLM", "SamplingParams"]
