"""Isolation end to end: the incident replay, the sentinel, the auditor, check-config."""

import json
import threading

import httpx
import pytest

from helpers import (
    ALLOW_FAULTS,
    TENANT_KEYS,
    run_audit,
    start_server,
    stop_server,
    wait_for_idle_pool,
    write_tenant_keys,
)
from kvfence import LLM, SamplingParams

FAULT = [
    "--inject-fault",
    "legacy-reject-path",
    "--max-model-len",
    "2048",
    "--num-kv-pages",
    "64",
    "--threads",
    "2",
]


def test_incident_replay_with_sentinel_off_is_found_by_the_audit(tmp_path):
    proc, base = start_server(tmp_path, "serve", *FAULT, "--kv-sentinel", "off", env=ALLOW_FAULTS)
    try:
        code, report = run_audit(base, "--checks", "canary,boundary,timing")
    finally:
        stop_server(proc)
    log = (tmp_path / f"server-{base.rsplit(':', 1)[1]}.log").read_text()
    assert "FAULT INJECTED: legacy-reject-path" in log, "the fault must announce itself at start"
    assert "one-token placeholder" in log, "and on every affected request"
    assert code == 1, report
    checks = {f["check"] for f in report["findings"]}
    assert {"boundary", "timing"} <= checks, report["findings"]
    assert any("accepts a key the audit made up" in i for i in report["info"]), "no --api-keys"


def test_incident_replay_with_sentinel_on_fails_closed(tmp_path):
    proc, base = start_server(
        tmp_path, "serve", *FAULT, "--kv-sentinel", "enforce", env=ALLOW_FAULTS
    )
    try:
        secrets = [f"{n:08d}" for n in (31415926, 27182818, 14142135, 17320508)]
        for s in secrets:  # leave other requests' KV behind in the pool
            r = httpx.post(
                base + "/v1/completions",
                timeout=60,
                json={
                    "model": "SmolLM2-135M-Instruct.Q4_1",
                    "prompt": f"My vault code is {s}. Repeat it: {s}.",
                    "max_tokens": 8,
                    "temperature": 0,
                },
            )
            assert r.status_code == 200
        oversized = {
            "model": "SmolLM2-135M-Instruct.Q4_1",
            "prompt": " hello" * 1500,
            "max_tokens": 16,
            "temperature": 0,
        }
        r = httpx.post(base + "/v1/completions", json=oversized, timeout=60)
        assert r.status_code == 500 and r.json()["error"]["code"] == "request_failed"
        assert "KV ownership" in r.json()["error"]["message"] and "choices" not in r.json()
        with httpx.stream(
            "POST",
            base + "/v1/completions",
            json={**oversized, "stream": True},
            timeout=60,
        ) as s:
            events = [line[6:] for line in s.iter_lines() if line.startswith("data: ")]
        assert events[-1] == "[DONE]" and "error" in json.loads(events[-2])
        assert not any(json.loads(e).get("choices", [{}])[0].get("text") for e in events[:-2]), (
            "text leaked"
        )
        metrics = httpx.get(base + "/metrics").text
        assert "kvfence_kv_sentinel_violations_total 2.0" in metrics
        wait_for_idle_pool(base)
    finally:
        stop_server(proc)


def test_clean_server_passes_an_adversarial_audit(tmp_path):
    keys = write_tenant_keys(tmp_path)
    # a pool of 40 pages x 16 = 640 tokens against a 512-token context: preemption under load
    proc, base = start_server(
        tmp_path,
        "serve",
        "--max-model-len",
        "512",
        "--num-kv-pages",
        "40",
        "--threads",
        "2",
        "--api-keys",
        str(keys),
    )
    key_args = [a for k in TENANT_KEYS for a in ("--api-key", k)]
    aborted = []

    def abort_streams():  # clients that walk away mid-stream while the audit runs
        for i in range(6):
            try:
                with httpx.stream(
                    "POST",
                    base + "/v1/completions",
                    timeout=60,
                    headers={"Authorization": f"Bearer {list(TENANT_KEYS)[i % 2]}"},
                    json={
                        "model": "SmolLM2-135M-Instruct.Q4_1",
                        "prompt": f"Story {i}:",
                        "max_tokens": 200,
                        "stream": True,
                        "ignore_eos": True,
                    },
                ) as r:
                    next(r.iter_lines())
                    aborted.append(i)
            except httpx.HTTPError:
                pass

    try:
        t = threading.Thread(target=abort_streams)
        t.start()
        code, report = run_audit(base, *key_args, "--cache-min-tokens", "128")
        t.join()
        preemptions = [
            line
            for line in httpx.get(base + "/metrics").text.splitlines()
            if line.startswith("kvfence_preemptions_total")
        ]
        wait_for_idle_pool(base)
    finally:
        stop_server(proc)
    assert code == 0, report
    assert not any("made up" in i for i in report["info"]), "a made-up key is refused"
    log = (tmp_path / f"server-{base.rsplit(':', 1)[1]}.log").read_text()
    assert (
        f"unified on {base}: SmolLM2-135M-Instruct.Q4_1: dtype gguf, "
        "KV pool float32 40 pages x 16 tokens (640 tokens), max_model_len 512" in log
    ), "the start-up line tells the operator what runs"
    assert len(aborted) == 6
    assert float(preemptions[0].split()[1]) > 0, "the audit's load should have forced preemption"
    assert {"boundary", "consistency", "canary leak", "timing and accounting"} <= set(
        report["passed"]
    )
    assert any(p.startswith("cross-key prefix cache (key 1 -> key 2") for p in report["passed"])
    assert [t["verdict"] for t in report["cache"]] == ["shared", "not shared"], report["cache"]


def test_audit_exits_2_when_it_cannot_run():
    code, err = run_audit("http://127.0.0.1:9")
    assert code == 2 and "could not run" in err


# --- prefix cache --------------------------------------------------------------------------


def test_prefix_cache_is_reused_within_a_tenant_only_and_changes_nothing(real_llm):
    engine = real_llm.engine
    system = "You are the support assistant of ACME Corp. Answer briefly and politely. " * 6
    params = SamplingParams(temperature=0, max_tokens=12, ignore_eos=True)

    def run(tenant, question):
        (req,) = engine.add_request(system + question, params, tenant=tenant)
        outs = {}
        while engine.has_unfinished():
            for o in engine.step():
                outs[o.request_id] = o
        return outs[req.parent_id], req

    first, _ = run("alice", "How do I reset my password?")
    again, req_a = run("alice", "How do I close my account?")
    other, req_b = run("bob", "How do I close my account?")
    assert req_a.num_cached_tokens >= 64, "alice's shared system prompt was not reused"
    assert req_b.num_cached_tokens == 0, "bob hit alice's cache"
    no_cache = LLM(num_threads=2, max_model_len=2048, num_kv_pages=512, prefix_cache=False)
    plain = no_cache.generate(system + "How do I close my account?", params)[0].outputs[0]
    assert again.token_ids == other.token_ids == plain.token_ids


def test_prefix_cache_pages_are_evicted_under_pressure(tiny_llama_dir):
    from kvfence.config import EngineConfig
    from kvfence.engine.llm_engine import LLMEngine

    engine = LLMEngine(
        EngineConfig(model=str(tiny_llama_dir), page_size=4, num_kv_pages=32, max_model_len=96),
        progress=False,
    )
    params = SamplingParams(temperature=0, max_tokens=4)
    for i in range(12):  # each leaves ~10 cached pages behind; the pool holds 32
        engine.add_request(list(range(100 * i + 1, 100 * i + 42)), params)
        while engine.has_unfinished():
            engine.step()
    assert engine.prefix_cache.num_evictable <= 32
    assert engine.allocator.num_free + engine.prefix_cache.num_evictable == 32


# --- check-config -------------------------------------------------------------------------

QWEN_1M = {
    "architectures": ["Qwen2ForCausalLM"],
    "hidden_size": 5120,
    "intermediate_size": 27648,
    "num_attention_heads": 40,
    "num_hidden_layers": 64,
    "num_key_value_heads": 8,
    "max_position_embeddings": 1048576,
    "vocab_size": 152064,
}


@pytest.fixture
def check_config(capsys):
    """Runs `kvfence check-config ARGS` in-process; returns (exit code, output)."""
    from kvfence.cli import main

    def run(*args):
        code = main(["check-config", *args])
        captured = capsys.readouterr()
        return code, captured.out + captured.err

    return run


@pytest.fixture
def qwen_config(tmp_path):
    path = tmp_path / "config.json"
    path.write_text(json.dumps(QWEN_1M))
    return str(path)


def test_check_config_flags_the_incident(qwen_config, check_config):
    code, out = check_config(
        "--engine",
        "sglang",
        "--model-config",
        qwen_config,
        "--",
        "--context-length",
        "1048576",
        "--max-total-tokens",
        "681280",
        "--tp-size",
        "8",
    )
    assert code == 1
    assert "681,280" in out and "1,048,576" in out and "--max-total-tokens" in out


def test_check_config_passes_the_remedy(qwen_config, check_config):
    code, out = check_config(
        "--engine",
        "sglang",
        "--model-config",
        qwen_config,
        "--",
        "--context-length",
        "1048576",
        "--max-total-tokens",
        "2040000",
    )
    assert code == 0 and "verdict: OK" in out


def test_check_config_estimates_vllm_from_memory(qwen_config, check_config):
    code, out = check_config(
        "--engine",
        "vllm",
        "--model-config",
        qwen_config,
        "--accelerator-memory-gib",
        "141",
        "--weights-gib",
        "62",
        "--json",
        "--",
        "--tensor-parallel-size",
        "2",
        "--max-model-len",
        "1048576",
    )
    report = json.loads(out)
    assert code == 1 and report["pool_is_estimate"] and report["kv_bytes_per_token"] == 262144


def test_check_config_on_kvfence_flags(check_config):
    assert check_config("--", "--num-kv-pages", "100")[0] == 1
    assert check_config("--", "--num-kv-pages", "1024")[0] == 0
    # 0.25 GiB holds 5,825 fp32 tokens of the default model, under its 8,192; in bf16, 11,650
    assert check_config("--", "--kv-memory-gib", "0.25")[0] == 1
    assert check_config("--", "--kv-memory-gib", "0.25", "--kv-cache-dtype", "bfloat16")[0] == 0
    assert (
        check_config("--", "--kv-memory-gib", "0.25", "--dtype", "bfloat16")[0] == 0
    )  # auto follows --dtype


@pytest.mark.parametrize(
    "args",
    [
        ["--model-config", "/no/such/config.json"],
        [
            "--engine",
            "sglang",
            "--",
            "--context-length",
            "1000",
        ],  # pool sized from memory, none given
        ["--", "--num-kv-pages", "many"],
        ["--", "--kv-cache-dtype", "fp64"],  # a KV dtype kvfence serve refuses
    ],
)
def test_check_config_rejects_malformed_input(args, check_config):
    code, out = check_config(*args)
    assert code == 2 and "check-config:" in out
