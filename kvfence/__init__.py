"""kvfence: an LLM inference server whose requests never read each other's KV cache."""
import os
import sys

# PyTorch's OpenMP (libgomp) reads this once, as torch loads. With its defaults, threads
# waiting between parallel regions gave up their cores so soon that each region cost
# 3-5 us at one row here, against 1-2 us spinning: a decode step runs about 150 of them
# (10-20% of a single request's step). 300000 spins is libgomp's own figure for an unset
# OMP_WAIT_POLICY (about 3 ms): an idle server's threads still go to sleep. A user's own
# GOMP_SPINCOUNT or OMP_WAIT_POLICY is left as it is.
OPENMP_WAIT_CHOSEN = "GOMP_SPINCOUNT" in os.environ or "OMP_WAIT_POLICY" in os.environ
if not OPENMP_WAIT_CHOSEN:
    os.environ["GOMP_SPINCOUNT"] = "300000"
    OPENMP_WAIT_CHOSEN = "torch" not in sys.modules  # False: torch loaded libgomp first, with its defaults

from kvfence.engine.sampling_params import SamplingParams  # noqa: E402
from kvfence.llm import LLM  # noqa: E402

__all__ = ["LLM", "SamplingParams"]
