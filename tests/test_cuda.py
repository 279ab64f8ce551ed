"""The engine on a CUDA GPU (skipped where torch sees none), and the refusal where it does not."""

import pytest
import torch

from helpers import assert_pool_empty
from kvfence import LLM, SamplingParams
from kvfence.config import ConfigError

needs_gpu = pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU")


@pytest.mark.skipif(
    torch.cuda.is_available(), reason="checks the refusal on a machine without a GPU"
)
def test_cuda_refused_without_a_gpu():
    with pytest.raises(ConfigError, match="sees no CUDA GPU"):
        LLM(device="cuda", num_kv_pages=200, max_model_len=256)


def test_unknown_device_refused():
    with pytest.raises(ConfigError, match="device must be cpu or cuda"):
        LLM(device="tpu", num_kv_pages=200, max_model_len=256)


@needs_gpu
@pytest.mark.parametrize("dtype", ["float32", "bfloat16"])
@pytest.mark.parametrize("eager", [False, True], ids=["graphs", "eager"])
def test_cuda_matches_cpu(real_llm, dtype, eager):
    gpu = LLM(
        device="cuda",
        dtype=dtype,
        max_model_len=1024,
        num_kv_pages=2000,
        enforce_eager=eager,
    )
    assert gpu.engine.pool.k.is_cuda and gpu.engine.runner.model.layers[0].qkv.weight.is_cuda
    prompts = [
        "The capital of France is",
        "def fibonacci(n):",
        "Once upon a time, in a small village,",
    ]
    params = SamplingParams(temperature=0, max_tokens=8, ignore_eos=True, logprobs=0)
    for ours, ref in zip(gpu.generate(prompts, params), real_llm.generate(prompts, params)):
        ref_lp = [e["logprob"] for e in ref.outputs[0].logprobs]
        gpu_lp = [e["logprob"] for e in ours.outputs[0].logprobs]
        n = next(
            (
                i
                for i, (a, b) in enumerate(zip(ours.outputs[0].token_ids, ref.outputs[0].token_ids))
                if a != b
            ),
            8,
        )
        assert n >= 1, "the first greedy token must agree"
        torch.testing.assert_close(
            torch.tensor(gpu_lp[:n]),
            torch.tensor(ref_lp[:n]),
            atol=1e-3 if dtype == "float32" else 0.2,
            rtol=0,
        )
    answer = (
        gpu.chat(
            [{"role": "user", "content": "What is the capital of France?"}],
            SamplingParams(temperature=0, max_tokens=20),
        )[0]
        .outputs[0]
        .text
    )
    assert answer == "The capital of France is Paris."
    assert_pool_empty(gpu.engine)
    assert (gpu.engine.runner.graphs is None) == eager
    assert eager or gpu.engine.runner.graphs.graphs, "decode steps replay captured graphs"
