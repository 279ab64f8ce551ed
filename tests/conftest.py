import os

import pytest

import kvfence  # noqa: F401 - before torch, so that libgomp loads with its wait set (kvfence/openmp.py)
import torch  # noqa: E402

os.environ.setdefault("TOKENIZERS_PARALLELISM", "false")
torch.set_num_threads(2)


@pytest.fixture(scope="session")
def default_model_path():
    from kvfence.model.loader import default_model_path

    return default_model_path()


@pytest.fixture(scope="session")
def tokenizer(default_model_path):
    from kvfence.model.tokenizer import load_tokenizer

    return load_tokenizer(default_model_path)


def _tiny_model(tmp_path_factory, tokenizer, arch: str):
    """A 2-layer random-weight model with the real tokenizer, saved as a HF directory."""
    from transformers import LlamaConfig, LlamaForCausalLM, Qwen2Config, Qwen2ForCausalLM

    torch.manual_seed(0)
    common = dict(vocab_size=len(tokenizer), hidden_size=64, intermediate_size=128, num_hidden_layers=2,
                  num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=256,
                  rope_theta=10000.0, initializer_range=0.2, eos_token_id=tokenizer.eos_token_id)
    if arch == "qwen2":
        model = Qwen2ForCausalLM(Qwen2Config(tie_word_embeddings=True, **common))
    else:
        model = LlamaForCausalLM(LlamaConfig(tie_word_embeddings=False, **common))
    path = tmp_path_factory.mktemp(f"tiny-{arch}")
    model.save_pretrained(path)
    tokenizer.save_pretrained(path)
    return path


@pytest.fixture(scope="session")
def tiny_llama_dir(tmp_path_factory, tokenizer):
    return _tiny_model(tmp_path_factory, tokenizer, "llama")


@pytest.fixture(scope="session")
def tiny_qwen2_dir(tmp_path_factory, tokenizer):
    return _tiny_model(tmp_path_factory, tokenizer, "qwen2")


@pytest.fixture(scope="session")
def real_llm():
    """The embedded default model, shared by the end-to-end engine tests."""
    from kvfence import LLM

    return LLM(num_threads=2, max_model_len=2048, num_kv_pages=1024)


@pytest.fixture(scope="session")
def hf_reference(default_model_path):
    """Hugging Face transformers loading the same GGUF file, fp32: the reference outputs."""
    from transformers import AutoModelForCausalLM

    model = AutoModelForCausalLM.from_pretrained(str(default_model_path.parent), gguf_file=default_model_path.name,
                                                 dtype=torch.float32)
    return model.eval()


def assert_pool_empty(engine):
    """Every page is free again (or an unreferenced prefix-cache page) and nothing is queued."""
    a = engine.allocator
    assert engine.scheduler.num_unfinished == 0
    assert not (a.owner >= 0).any(), f"pages still owned by requests: {(a.owner >= 0).nonzero()[0].tolist()}"
    assert not a.refcount.any(), "prefix-cache pages still referenced"


TENANT_KEYS = {"sk-alice-0123456789": "alice", "sk-bob-9876543210": "bob"}


_ports_given: set[int] = set()


def free_port() -> int:
    """A free port below Linux's ephemeral range (32768 up): the workers' own listeners (NIXL's
    UCX, ZMQ) bind ephemeral ports, and one once took a port picked there before its server
    had bound it. Never the same port twice in one test run."""
    import random
    import socket

    while True:
        port = random.randrange(20000, 32768)
        if port in _ports_given:
            continue
        with socket.socket() as s:
            try:
                s.bind(("127.0.0.1", port))
            except OSError:
                continue
        _ports_given.add(port)
        return port


ALLOW_FAULTS = {"KVFENCE_ALLOW_FAULTS": "1"}  # the environment a server with --inject-fault needs


def spawn_server(tmp_path, *args, env: dict | None = None):
    """Starts `kvfence serve` (or another subcommand) as a real process, with `env` added to
    this environment; returns (process, base URL)."""
    import subprocess
    import sys

    port = free_port()
    log = open(tmp_path / f"server-{port}.log", "w")
    cmd = [sys.executable, "-m", "kvfence.cli", *args, "--port", str(port)]
    env = {**os.environ, **(env or {})}
    proc = subprocess.Popen(cmd, stdout=log, stderr=subprocess.STDOUT, env=env)
    return proc, f"http://127.0.0.1:{port}"


def wait_healthy(tmp_path, proc, base):
    import time

    import httpx

    port = base.rsplit(":", 1)[1]
    deadline = time.monotonic() + 180
    while time.monotonic() < deadline:
        if proc.poll() is not None:
            raise RuntimeError(f"server exited: {(tmp_path / f'server-{port}.log').read_text()[-3000:]}")
        try:
            if httpx.get(base + "/health", timeout=1).status_code == 200:
                return proc, base
        except httpx.HTTPError:
            pass
        time.sleep(0.5)
    proc.kill()
    raise RuntimeError("server did not become healthy")


def start_server(tmp_path, *args, env: dict | None = None):
    proc, base = spawn_server(tmp_path, *args, env=env)
    return wait_healthy(tmp_path, proc, base)


def stop_server(proc):
    proc.terminate()
    try:
        proc.wait(15)
    except Exception:  # noqa: BLE001
        proc.kill()


@pytest.fixture(scope="session")
def server(tmp_path_factory):
    """A real `kvfence serve` process with two tenants' API keys."""
    import json

    tmp = tmp_path_factory.mktemp("server")
    keys = tmp / "keys.json"
    keys.write_text(json.dumps(TENANT_KEYS))
    proc, base = start_server(tmp, "serve", "--api-keys", str(keys), "--max-model-len", "1024",
                              "--num-kv-pages", "640", "--max-pending", "72", "--threads", "2",
                              "--served-model-name", "smollm2")
    yield base
    stop_server(proc)


def metric(base: str, name: str) -> float:
    """Reads one unlabelled sample from /metrics."""
    import httpx

    for line in httpx.get(base + "/metrics").text.splitlines():
        if line.startswith(name + " ") or line.startswith(name + "{}"):
            return float(line.rsplit(" ", 1)[1])
    raise KeyError(name)


def wait_for_idle_pool(base: str, timeout: float = 30) -> None:
    import time

    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        if metric(base, "kvfence_kv_pages_in_use_by_requests") == 0 and metric(base, "kvfence_requests_running") == 0:
            return
        time.sleep(0.2)
    raise AssertionError("KV pages still held by requests")
