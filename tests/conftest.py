import os

import pytest

import kvfence  # before torch: libgomp must load with its wait set (kvfence/openmp.py)

# isort: split
import torch

from helpers import (
    TENANT_KEYS,
    save_tiny_gguf,
    save_tiny_model,
    start_tenant_server,
    stop_server,
)

os.environ.setdefault("TOKENIZERS_PARALLELISM", "false")
torch.set_num_threads(2)


@pytest.fixture(scope="session", autouse=True)
def tokenizer_cache(tmp_path_factory):
    """Tokenizers converted from the tests' GGUF files go to this run's temporary folder (and
    the servers it starts, which inherit the environment), not to the user's cache."""
    os.environ["KVFENCE_CACHE"] = str(tmp_path_factory.mktemp("kvfence-cache"))


@pytest.fixture(scope="session")
def default_model_path():
    from kvfence.model.loader import default_model_path

    return default_model_path()


@pytest.fixture(scope="session")
def tokenizer(default_model_path):
    from kvfence.model.tokenizer import load_tokenizer

    return load_tokenizer(default_model_path)


@pytest.fixture(scope="session")
def tiny_llama_dir(tiny_model):
    return tiny_model("llama")


@pytest.fixture(scope="session")
def tiny_qwen2_dir(tiny_model):
    return tiny_model("qwen2")


@pytest.fixture(scope="session")
def tiny_model(tmp_path_factory, tokenizer, default_model_path):
    """tiny_model(arch, fmt): a tiny model of save_tiny_model's `arch`, as a safetensors
    directory or (fmt "gguf") an F32 GGUF file of the same weights; built once a session."""
    built = {}

    def get(arch: str, fmt: str = "safetensors"):
        if (arch, fmt) not in built:
            if fmt == "gguf":
                out = tmp_path_factory.mktemp(f"gguf-{arch}") / f"tiny-{arch}.gguf"
                built[arch, fmt] = save_tiny_gguf(get(arch), out, default_model_path)
            else:
                built[arch, fmt] = save_tiny_model(tmp_path_factory, tokenizer, arch)
        return built[arch, fmt]

    return get


@pytest.fixture(scope="session")
def real_llm():
    """The embedded default model, shared by the end-to-end engine tests."""
    return kvfence.LLM(num_threads=2, max_model_len=2048, num_kv_pages=1024)


@pytest.fixture(scope="session")
def hf_reference(default_model_path):
    """Hugging Face transformers loading the same GGUF file, fp32: the reference outputs."""
    from transformers import AutoModelForCausalLM

    model = AutoModelForCausalLM.from_pretrained(
        str(default_model_path.parent),
        gguf_file=default_model_path.name,
        dtype=torch.float32,
    )
    return model.eval()


@pytest.fixture(scope="session")
def q4_k_m_path(tmp_path_factory, default_model_path):
    """The default model re-quantized to Q4_K_M by llama.cpp's own quantizer: Q4_K and Q6_K
    where rows have 256 weights (the FFN's down projection), its fallbacks (Q5_0, Q8_0)
    elsewhere, as llama.cpp writes any model of this width."""
    import llama_cpp

    path = tmp_path_factory.mktemp("q4_k_m") / "SmolLM2-135M-Instruct.Q4_K_M.gguf"
    params = llama_cpp.llama_model_quantize_default_params()
    params.ftype = llama_cpp.LLAMA_FTYPE_MOSTLY_Q4_K_M
    params.allow_requantize = True  # from the Q4_1 file: no higher-precision one is embedded
    params.nthread = 2
    assert (
        llama_cpp.llama_model_quantize(str(default_model_path).encode(), str(path).encode(), params)
        == 0
    )
    return path


@pytest.fixture(scope="session")
def server(tmp_path_factory):
    """A real `kvfence serve` process with two tenants' API keys."""
    tmp = tmp_path_factory.mktemp("server")
    proc, base = start_tenant_server(tmp, "--num-kv-pages", "640", "--max-pending", "72")
    yield base
    stop_server(proc)


@pytest.fixture(scope="session")
def client(server):
    """The `openai` client of `server`, with the first tenant's key."""
    import openai

    return openai.OpenAI(
        base_url=server + "/v1", api_key=list(TENANT_KEYS)[0], max_retries=0, timeout=120
    )


@pytest.fixture
def aclient(server):  # one a test: an async client belongs to the event loop it first ran in
    import openai

    return openai.AsyncOpenAI(
        base_url=server + "/v1", api_key=list(TENANT_KEYS)[0], max_retries=0, timeout=300
    )
