"""Disaggregated prefill/decode with real worker processes, NIXL transfers and the router."""

import json
import secrets
import signal
import threading
import time

import httpx
import openai
import pytest
import torch

from helpers import (
    ADMIN_KEY,
    ALLOW_FAULTS,
    metric,
    run_audit,
    spawn_server,
    start_server,
    stop_server,
    wait_for_idle_pool,
    wait_healthy,
)
from kvfence import SamplingParams, StructuredOutputs
from kvfence.disagg.transfer import KVTransfer, Manifest, TransferError, verify
from kvfence.kv.pool import KVPool
from kvfence.model.config import ModelConfig

MODEL = "SmolLM2-135M-Instruct.Q4_1"
WORKER = ["--threads", "1", "--max-model-len", "1024"]
PROMPTS = [
    "The capital of France is",
    "def fibonacci(n):",
    "Once upon a time, in a small village,",
    "Water boils at",
    "x",
    "List three prime numbers:" * 10,
]


def start_cluster(
    tmp_path,
    prefills: list[list[str]],
    decodes: list[list[str]],
    env: dict | None = None,
    common: tuple[str, ...] = (),
):
    """Workers (with `env` added to their environment) and a router sharing the internal
    token in tmp_path / "internal-token"; `common` flags go to every worker and the router."""
    token = tmp_path / "internal-token"
    token.write_text(secrets.token_urlsafe(32))
    auth = ["--internal-token-file", str(token)]
    procs, urls = [], {"prefill": [], "decode": []}
    try:
        for role, configs in (("prefill", prefills), ("decode", decodes)):
            for extra in configs:  # start together, then wait: start-up is mostly imports
                proc, url = spawn_server(
                    tmp_path, "serve", "--role", role, *WORKER, *auth, *common, *extra, env=env
                )
                procs.append(proc)
                urls[role].append(url)
        for proc, url in zip(procs, urls["prefill"] + urls["decode"]):
            wait_healthy(tmp_path, proc, url)
        router_args = [a for u in urls["prefill"] for a in ("--prefill", u)] + [
            a for u in urls["decode"] for a in ("--decode", u)
        ]
        proc, router = start_server(tmp_path, "router", *router_args, *auth, *common)
        procs.append(proc)
    except Exception:
        for p in procs:
            stop_server(p)
        raise
    return procs, router, urls


@pytest.fixture(scope="module")
def cluster(tmp_path_factory):
    """One prefill worker with a big pool and context, two decode workers with smaller ones."""
    tmp = tmp_path_factory.mktemp("cluster")
    small = ["--num-kv-pages", "40", "--max-model-len", "512"]
    procs, router, urls = start_cluster(tmp, [["--num-kv-pages", "256"]], [small, small])
    yield router, urls
    for p in procs:
        stop_server(p)


def complete(router, prompt, **kw):
    body = {"model": MODEL, "prompt": prompt, "max_tokens": 12, "temperature": 0, **kw}
    return httpx.post(router + "/v1/completions", json=body, timeout=120)


def idle(urls):
    for url in urls["prefill"] + urls["decode"]:
        wait_for_idle_pool(url, timeout=20)


def test_pd_greedy_output_equals_unified(cluster, real_llm):
    router, urls = cluster
    expected = real_llm.generate(
        PROMPTS, SamplingParams(temperature=0, max_tokens=12, ignore_eos=True)
    )
    client = openai.OpenAI(base_url=router + "/v1", api_key="none", max_retries=0)
    for prompt, ref in zip(PROMPTS, expected):
        r = client.completions.create(
            model=MODEL,
            prompt=prompt,
            max_tokens=12,
            temperature=0,
            extra_body={"ignore_eos": True},
        )
        assert r.choices[0].text == ref.outputs[0].text, prompt
        assert r.usage.prompt_tokens == len(ref.prompt_token_ids)
    stream = client.chat.completions.create(
        model=MODEL,
        messages=[{"role": "user", "content": "What is the capital of France?"}],
        temperature=0,
        stream=True,
    )
    assert (
        "".join(c.choices[0].delta.content or "" for c in stream)
        == "The capital of France is Paris."
    )
    idle(urls)


def test_structured_outputs_and_tool_calls_through_the_router(cluster, real_llm):
    """The decode worker applies the constraint: the same greedy answer as unified."""
    router, urls = cluster
    client = openai.OpenAI(base_url=router + "/v1", api_key="none", max_retries=0)
    schema = {
        "type": "object",
        "properties": {"city": {"type": "string", "maxLength": 16}},
        "required": ["city"],
        "additionalProperties": False,
    }
    messages = [{"role": "user", "content": "What is the capital of France?"}]
    r = client.chat.completions.create(
        model=MODEL,
        messages=messages,
        temperature=0,
        max_tokens=40,
        response_format={"type": "json_schema", "json_schema": {"name": "c", "schema": schema}},
    )
    expected = real_llm.chat(
        messages,
        SamplingParams(
            temperature=0, max_tokens=40, structured_outputs=StructuredOutputs(json=schema)
        ),
    )
    assert r.choices[0].message.content == expected[0].outputs[0].text
    tool = {"type": "function", "function": {"name": "lookup", "parameters": schema}}
    r = client.chat.completions.create(
        model=MODEL,
        messages=messages,
        tools=[tool],
        tool_choice="required",
        parallel_tool_calls=False,
        max_tokens=60,
    )
    (call,) = r.choices[0].message.tool_calls
    assert call.function.name == "lookup" and set(json.loads(call.function.arguments)) == {"city"}
    assert r.choices[0].finish_reason == "tool_calls"
    idle(urls)


def test_refused_at_prefill_never_reaches_decode(cluster):
    router, urls = cluster
    decode_before = [httpx.get(u + "/metrics").text for u in urls["decode"]]
    r = complete(router, "hello " * 1100)
    assert r.status_code == 400 and r.json()["error"]["code"] == "context_length_exceeded"
    r = complete(router, "hello", temperature=-1)
    assert r.status_code == 400 and r.json()["error"]["param"] == "temperature"
    assert [
        httpx.get(u + "/metrics").text.count("kvfence_requests_rejected_total{")
        for u in urls["decode"]
    ] == [t.count("kvfence_requests_rejected_total{") for t in decode_before]
    assert all("kvfence_generation_tokens_total" in t for t in decode_before)
    idle(urls)


def test_each_side_admits_against_its_own_pool(cluster):
    router, urls = cluster
    # 700 prompt tokens fit the prefill worker (context 1024, 256 pages),
    # not a decode worker (512, 40 pages)
    r = complete(router, " hello" * 700, max_tokens=10)
    assert r.status_code == 400 and r.json()["error"]["code"] == "context_length_exceeded"
    assert "512" in r.json()["error"]["message"]
    idle(urls)  # the prefill side released the KV it had parked


def test_workers_keep_idle_connections_past_their_callers_pools(cluster):
    """The router and decode workers drop a pooled connection after WORKER_KEEPALIVE_S / 6;
    a worker keeps one longer than that. Were both 5 s (uvicorn's and httpx's defaults), a
    request sent as the worker closed the connection would be reset: a spurious 502."""
    import http.client
    from urllib.parse import urlsplit

    from kvfence.disagg import WORKER_KEEPALIVE_S

    router, urls = cluster
    for url in (urls["prefill"][0], urls["decode"][0]):
        conn = http.client.HTTPConnection(urlsplit(url).netloc, timeout=10)
        conn.request("GET", "/health")
        assert conn.getresponse().read() and conn.sock is not None
        sock = conn.sock
        time.sleep(
            WORKER_KEEPALIVE_S / 6 + 1
        )  # past what a caller keeps it, and past uvicorn's default
        conn.request("GET", "/health")  # on the same connection: the worker has not closed it
        assert conn.getresponse().status == 200 and conn.sock is sock
        conn.close()


def test_manifest_checks_catch_every_mismatch():
    cfg = ModelConfig("llama", 10, 8, 16, 2, 2, 1, 4, 1e4, 1e-5, 64, True)
    pool = KVPool(cfg, 8, 4)
    good = dict(
        transfer_id="t",
        token_count=6,
        page_size=4,
        page_count=2,
        dtype="float32",
        num_layers=2,
        kv_heads=1,
        head_dim=4,
        checksums=[1, 2],
        agent_name="a",
        agent_metadata="",
        descs=[[0, 0, 0]] * 8,
    )
    verify(Manifest(**good), 6, pool, [1, 2])
    for change, expected_tokens, sums in [
        ({"token_count": 1}, 6, None),
        ({"page_size": 8}, 6, None),
        ({"dtype": "bfloat16"}, 6, None),
        ({"num_layers": 3}, 6, None),
        ({"page_count": 1}, 6, None),
        ({"descs": [[0, 0, 0]] * 6}, 6, None),
        ({}, 6, [1, 3]),
        ({}, 7, None),
    ]:
        with pytest.raises(TransferError):
            verify(Manifest(**{**good, **change}), expected_tokens, pool, sums)


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float8_e4m3fn])
def test_narrow_pool_pages_arrive_bit_for_bit(dtype):
    """Two agents in one process: a bf16 or fp8 pool's pages land in other pages, and the
    receiver's checksums of what landed match the sender's manifest."""
    cfg = ModelConfig("llama", 10, 8, 16, 2, 2, 1, 4, 1e4, 1e-5, 64, True)
    src, dst = KVPool(cfg, 8, 4, dtype=dtype), KVPool(cfg, 8, 4, dtype=dtype)
    for cache in (src.k, src.v):
        cache.copy_(torch.randn(cache.shape).to(dtype))
    sender, receiver = KVTransfer(src), KVTransfer(dst)
    manifest = sender.manifest("t", [5, 2], 6)  # 6 tokens: a full page of 4, then 2 slots
    assert manifest.dtype == str(dtype).removeprefix("torch.")
    sender.expect("t", time.monotonic() + 10)
    receiver.read(manifest, [1, 7], time.monotonic() + 10)
    verify(manifest, 6, dst, receiver.checksums([1, 7], 6))
    for cache_src, cache_dst in ((src.k, dst.k), (src.v, dst.v)):
        cache_src, cache_dst = (
            cache_src.view(torch.uint8),
            cache_dst.view(torch.uint8),
        )  # bits
        assert torch.equal(cache_dst[:, 4:8], cache_src[:, 20:24]) and torch.equal(
            cache_dst[:, 28:30], cache_src[:, 8:10]
        )
    assert not dst.k.view(torch.uint8)[
        :, 30:32
    ].any()  # the last page's unwritten slots were not sent


def test_truncated_transfer_fails_with_an_error_and_frees_pages(tmp_path):
    procs, router, urls = start_cluster(
        tmp_path, [["--inject-fault", "truncated-transfer"]], [[]], env=ALLOW_FAULTS
    )
    try:
        r = complete(router, "The capital of France is a city that")
        assert r.status_code == 502 and r.json()["error"]["code"] == "kv_transfer_failed"
        assert "checksum mismatch" in r.json()["error"]["message"]
        r = complete(router, "The capital", stream=True)
        assert r.status_code == 502 and "choices" not in r.text
        idle(urls)
    finally:
        for p in procs:
            stop_server(p)


def test_transfer_past_its_timeout_fails_cleanly(tmp_path):
    procs, router, urls = start_cluster(tmp_path, [[]], [["--kv-transfer-timeout", "0.000001"]])
    try:
        r = complete(router, "Tell me about the history of Rome. " * 10)
        assert r.status_code == 502 and "deadline" in r.json()["error"]["message"]
        idle(urls)
        ok = complete(router, "x")  # one-token prompts move no KV and still work
        assert ok.status_code == 200 and ok.json()["choices"][0]["text"]
    finally:
        for p in procs:
            stop_server(p)


def kill_while_running(proc, url):
    """SIGKILL once the worker has a request running: mid-work, however fast the machine."""
    deadline = time.monotonic() + 60
    while metric(url, "kvfence_requests_running") < 1:
        assert time.monotonic() < deadline, "the worker never had a request running"
        time.sleep(0.05)
    proc.send_signal(signal.SIGKILL)


def test_killed_decode_worker_fails_its_requests_only(tmp_path):
    procs, router, urls = start_cluster(tmp_path, [["--park-timeout", "5"]], [[], []])
    victim = procs[1]
    results = {}

    def send(i):
        try:
            results[i] = complete(
                router,
                f"Story number {i}: once upon a time",
                max_tokens=400,
                ignore_eos=True,
            )
        except httpx.HTTPError as e:
            results[i] = e

    try:
        threads = [threading.Thread(target=send, args=(i,)) for i in range(6)]
        for t in threads:
            t.start()
        kill_while_running(victim, urls["decode"][0])
        for t in threads:
            t.join(120)
        codes = [r.status_code if isinstance(r, httpx.Response) else None for r in results.values()]
        assert codes.count(200) >= 2, [
            r.text[:300] for r in results.values()
        ]  # on the surviving decode worker
        failed = [
            r for r in results.values() if isinstance(r, httpx.Response) and r.status_code != 200
        ]
        assert failed and all(r.json()["error"]["code"] == "decode_unavailable" for r in failed), [
            r.text for r in failed
        ]
        assert all(
            r.status_code == 200 and r.json()["choices"][0]["text"]
            for r in results.values()
            if isinstance(r, httpx.Response) and r.status_code == 200
        )
        for url in [urls["prefill"][0], urls["decode"][1]]:
            wait_for_idle_pool(url, timeout=20)
    finally:
        for p in procs:
            stop_server(p)


def test_killed_prefill_worker_fails_its_requests_only(tmp_path):
    procs, router, urls = start_cluster(tmp_path, [[], []], [[]])
    try:
        long = " hello" * 900
        slow = {}
        t = threading.Thread(target=lambda: slow.update(r=complete(router, long)))
        t.start()  # round robin: this one goes to the first prefill worker
        kill_while_running(procs[0], urls["prefill"][0])
        t.join(60)
        assert (
            slow["r"].status_code == 502
            and slow["r"].json()["error"]["code"] == "prefill_unavailable"
        )
        ok = complete(router, "Water boils at")  # the second prefill worker
        assert ok.status_code == 200 and ok.json()["choices"][0]["text"]
        for url in [urls["prefill"][1], urls["decode"][0]]:
            wait_for_idle_pool(url, timeout=20)
    finally:
        for p in procs:
            stop_server(p)


def test_incident_replay_in_pd_mode(tmp_path):
    """Oversized for the prefill pool: one token of KV is shipped. Without the sentinel the
    audit finds it; with it the request fails closed."""
    fault = ["--inject-fault", "legacy-reject-path"]
    procs, router, urls = start_cluster(
        tmp_path,
        [[*fault, "--num-kv-pages", "40", "--max-model-len", "2048"]],
        [
            [
                *fault,
                "--kv-sentinel",
                "off",
                "--max-model-len",
                "2048",
                "--num-kv-pages",
                "200",
            ],
            [
                *fault,
                "--kv-sentinel",
                "enforce",
                "--max-model-len",
                "2048",
                "--num-kv-pages",
                "200",
            ],
        ],
        env=ALLOW_FAULTS,
    )
    try:
        answers = [complete(router, " hello" * 1000, max_tokens=8) for _ in range(2)]
        by_status = sorted(r.status_code for r in answers)
        assert by_status == [200, 500], [
            r.text[:200] for r in answers
        ]  # sentinel off answers, enforce fails
        failed = next(r for r in answers if r.status_code == 500)
        assert "KV ownership" in failed.json()["error"]["message"]
    finally:
        for p in procs:
            stop_server(p)
    procs, router, urls = start_cluster(
        tmp_path,
        [[*fault, "--num-kv-pages", "40", "--max-model-len", "2048"]],
        [
            [
                *fault,
                "--kv-sentinel",
                "off",
                "--max-model-len",
                "2048",
                "--num-kv-pages",
                "200",
            ]
        ],
        env=ALLOW_FAULTS,
    )
    try:
        code, report = run_audit(
            router, "--max-model-len", "2048", "--pool-tokens", "640", "--checks", "boundary,timing"
        )
        assert code == 1, report
        assert {"boundary", "timing"} & {f["check"] for f in report["findings"]}
    finally:
        for p in procs:
            stop_server(p)


def test_audit_is_clean_over_pd_with_a_killed_decode_worker(tmp_path):
    pool = ["--num-kv-pages", "128"]
    procs, router, urls = start_cluster(tmp_path, [pool], [pool, pool])
    try:
        procs[2].send_signal(
            signal.SIGKILL
        )  # the router routes around a worker that refuses connections
        procs[2].wait(10)
        checks = "canary,boundary,consistency,timing"  # one tenant: no cross-key cache test
        code, report = run_audit(router, "--canaries", "12", "--checks", checks)
        assert code == 0, report["findings"] if isinstance(report, dict) else report
        for url in [urls["prefill"][0], urls["decode"][0]]:
            wait_for_idle_pool(url, timeout=20)
    finally:
        for p in procs:
            stop_server(p)


def test_a_busy_decode_worker_frees_the_prefills_parked_kv_at_once(tmp_path):
    """A decode worker at --max-pending answers 429, and the KV parked for that request at the
    prefill worker is freed then, not held for its whole lease: decode saturation must not
    become a prefill lockout."""
    procs, router, urls = start_cluster(
        tmp_path, [["--park-timeout", "60"]], [["--max-pending", "1"]]
    )
    try:
        body = {"model": MODEL, "prompt": "Count: one, two,", "max_tokens": 400}
        with httpx.stream(
            "POST",
            router + "/v1/completions",
            json={**body, "ignore_eos": True, "stream": True},
            timeout=120,
        ) as busy:
            lines = busy.iter_lines()  # kept: a dropped iterator closes the stream
            next(lines)  # decoding: the decode worker's one slot is taken
            r = complete(router, "The capital of France is")
            assert r.status_code == 429 and r.json()["error"]["code"] == "too_many_requests"
            wait_for_idle_pool(urls["prefill"][0], timeout=10)
    finally:
        for p in procs:
            stop_server(p)


def test_tenant_limits_hold_once_across_workers(tmp_path):
    """Two decode workers behind the router: a tenant's token and concurrency limits are its
    own, charged once at the router, not once per worker. A streamed request that stops early
    gives back what it did not generate (the decode worker's count, which the client never
    sees), but one whose client leaves gives back nothing; a prompt the prefill worker
    computed stays charged even when max_tokens is then refused. Another tenant is served
    all along."""
    keys = tmp_path / "keys.json"
    keys.write_text(
        json.dumps(
            {
                "sk-rate": {"tenant": "rate", "max_tokens_per_minute": 400},
                "sk-one": {"tenant": "one", "max_concurrent_requests": 1},
                "sk-cut": {"tenant": "cut", "max_tokens_per_minute": 500},
                "sk-pre": {"tenant": "pre", "max_tokens_per_minute": 400},
                "sk-other": "other",
                ADMIN_KEY: {"tenant": "ops", "admin": True},  # reads the workers' pools
            }
        )
    )
    procs, router, urls = start_cluster(tmp_path, [[]], [[], []], common=("--api-keys", str(keys)))
    try:

        def post(key, stream=False, **body):
            body = {"model": MODEL, "prompt": "Once upon a time", "temperature": 0, **body}
            return httpx.post(
                router + "/v1/completions",
                json=body | {"stream": stream},
                headers={"Authorization": f"Bearer {key}"},
                timeout=120,
            )

        # 5 prompt tokens + 300: within 400 once, but not twice, whichever worker serves it
        first = post("sk-rate", max_tokens=300, ignore_eos=True)
        assert first.status_code == 200
        assert first.json()["usage"]["completion_tokens"] == 300
        second = post("sk-rate", max_tokens=300, ignore_eos=True)
        assert second.status_code == 429 and int(second.headers["retry-after"]) >= 1
        assert "tokens per minute" in second.json()["error"]["message"]
        assert post("sk-other", max_tokens=300, ignore_eos=True).status_code == 200
        # 305 + 8 + 2: a small request still fits, streamed, stopped at its first space
        streamed = post("sk-rate", stream=True, max_tokens=80, stop=[" "])
        assert streamed.status_code == 200
        assert "generated-tokens" not in streamed.text and streamed.text.endswith("[DONE]\n\n")
        assert post("sk-rate", max_tokens=60).status_code == 200  # only if the stream refunded

        # a client that leaves its stream early keeps the whole charge: 305 of 500 stay
        with httpx.stream(
            "POST",
            router + "/v1/completions",
            json={
                "model": MODEL,
                "prompt": "Once upon a time",
                "max_tokens": 300,
                "ignore_eos": True,
                "stream": True,
            },
            headers={"Authorization": "Bearer sk-cut"},
            timeout=120,
        ) as cut:
            lines = cut.iter_lines()
            for _ in range(3):
                next(lines)
        assert post("sk-cut", max_tokens=300).status_code == 429

        # 305 of 400 used; a 150-token prompt is prefilled, then its max_tokens refused: the
        # prompt stays charged, so not even a one-token request is prefilled after it
        assert post("sk-pre", max_tokens=300, ignore_eos=True).status_code == 200
        long_prompt = "the quick brown fox jumps " * 30
        assert post("sk-pre", prompt=long_prompt, max_tokens=60).status_code == 429
        assert post("sk-pre", max_tokens=1).status_code == 429

        # one request in flight at a time for "one": a second waits for the first to end
        with httpx.stream(
            "POST",
            router + "/v1/completions",
            json={
                "model": MODEL,
                "prompt": "x",
                "max_tokens": 200,
                "ignore_eos": True,
                "stream": True,
            },
            headers={"Authorization": "Bearer sk-one"},
            timeout=120,
        ) as running:
            assert running.status_code == 200
            lines = running.iter_lines()
            next(lines)
            busy = post("sk-one", max_tokens=4)
            assert busy.status_code == 429, busy.text
            assert "in flight" in busy.json()["error"]["message"]
            assert post("sk-other", max_tokens=4).status_code == 200
            for _ in lines:
                pass
        assert post("sk-one", max_tokens=4).status_code == 200
        idle(urls)
    finally:
        for p in procs:
            stop_server(p)
