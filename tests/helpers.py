"""Shared helpers of the tests: real server processes, their metrics, and pool checks."""

import os

TENANT_KEYS = {"sk-alice-0123456789": "alice", "sk-bob-9876543210": "bob"}

ALLOW_FAULTS = {"KVFENCE_ALLOW_FAULTS": "1"}  # the environment a server with --inject-fault needs

_ports_given: set[int] = set()


def save_tiny_model(tmp_path_factory, tokenizer, arch: str):
    """A 2-layer random-weight model with the real tokenizer, saved as a HF directory."""
    import torch
    from transformers import (
        LlamaConfig,
        LlamaForCausalLM,
        Qwen2Config,
        Qwen2ForCausalLM,
    )

    torch.manual_seed(0)
    common = dict(
        vocab_size=len(tokenizer),
        hidden_size=64,
        intermediate_size=128,
        num_hidden_layers=2,
        num_attention_heads=4,
        num_key_value_heads=2,
        max_position_embeddings=256,
        rope_theta=10000.0,
        initializer_range=0.2,
        eos_token_id=tokenizer.eos_token_id,
    )
    if arch == "qwen2":
        model = Qwen2ForCausalLM(Qwen2Config(tie_word_embeddings=True, **common))
    else:
        model = LlamaForCausalLM(LlamaConfig(tie_word_embeddings=False, **common))
    path = tmp_path_factory.mktemp(f"tiny-{arch}")
    model.save_pretrained(path)
    tokenizer.save_pretrained(path)
    return path


def assert_pool_empty(engine):
    """Every page is free again (or an unreferenced prefix-cache page) and nothing is queued."""
    a = engine.allocator
    assert engine.scheduler.num_unfinished == 0
    owned = (a.owner >= 0).nonzero()[0].tolist()
    assert not owned, f"pages still owned by requests: {owned}"
    assert not a.refcount.any(), "prefix-cache pages still referenced"


def write_tenant_keys(tmp_path):
    """Writes TENANT_KEYS as an --api-keys file in `tmp_path`; returns its path."""
    import json

    keys = tmp_path / "keys.json"
    keys.write_text(json.dumps(TENANT_KEYS))
    return keys


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
            log = (tmp_path / f"server-{port}.log").read_text()
            raise RuntimeError(f"server exited: {log[-3000:]}")
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
    import subprocess

    proc.terminate()
    try:
        proc.wait(15)
    except subprocess.TimeoutExpired:
        proc.kill()


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
        if (
            metric(base, "kvfence_kv_pages_in_use_by_requests") == 0
            and metric(base, "kvfence_requests_running") == 0
        ):
            return
        time.sleep(0.2)
    raise AssertionError("KV pages still held by requests")
