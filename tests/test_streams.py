"""Streams and limits seen from a client's side: clients that stop reading or leave, the
sequence limit, metrics on their own listener, cached-token counts on a public address
without keys, and the environment that fault injection needs."""

import asyncio
import json
import socket
import time

import httpx
import pytest

from helpers import (
    ALLOW_FAULTS,
    TENANT_KEYS,
    free_port,
    metric,
    spawn_server,
    start_server,
    stop_server,
    wait_for_idle_pool,
)
from kvfence.config import ConfigError, EngineConfig
from kvfence.engine.llm_engine import LLMEngine
from kvfence.engine.output import RequestOutput
from kvfence.engine.sampling_params import SamplingParams
from kvfence.server.async_engine import AsyncEngine, StreamStalled

MODEL = "SmolLM2-135M-Instruct.Q4_1"
SMALL = ["--threads", "1", "--max-model-len", "1024", "--num-kv-pages", "128"]
# Thousands of tokens: minutes of generation, so a request that ends within seconds was aborted.
LONG = {
    "model": MODEL,
    "prompt": "Tell me a very long story.",
    "max_tokens": 4000,
    "ignore_eos": True,
    "temperature": 0,
}
SHARED = "You are a meticulous assistant for the accounting team. " * 12 + "Question: what is VAT?"


@pytest.fixture(scope="module")
def stream_server(tmp_path_factory):
    tmp = tmp_path_factory.mktemp("streams")
    proc, base = start_server(
        tmp,
        "serve",
        "--threads",
        "1",
        "--max-model-len",
        "4096",
        "--num-kv-pages",
        "300",
        "--max-pending",
        "4",
        "--stream-stall-timeout",
        "2",
    )
    yield base
    stop_server(proc)


def aborted(base: str) -> float:
    prefix = 'kvfence_requests_ended_total{outcome="aborted"} '
    line = next(x for x in httpx.get(base + "/metrics").text.splitlines() if x.startswith(prefix))
    return float(line.removeprefix(prefix))


def send_unread(base: str, body: dict, receive_buffer: int | None = None) -> socket.socket:
    """POSTs `body` to /v1/completions over a raw socket and leaves the answer unread."""
    host, port = base.removeprefix("http://").split(":")
    sock = socket.socket()
    if receive_buffer:  # set before connecting, so the window stays this small
        sock.setsockopt(socket.SOL_SOCKET, socket.SO_RCVBUF, receive_buffer)
    sock.connect((host, int(port)))
    data = json.dumps(body).encode()
    head = b"POST /v1/completions HTTP/1.1\r\nHost: kvfence\r\nContent-Type: application/json\r\n"
    sock.sendall(head + b"Content-Length: %d\r\n\r\n" % len(data) + data)
    return sock


def wait_generating(base: str, timeout: float = 30) -> None:
    deadline = time.monotonic() + timeout
    while metric(base, "kvfence_kv_pages_in_use_by_requests") == 0:
        assert time.monotonic() < deadline, "the request never started"
        time.sleep(0.1)


# --- F7: a stream's memory is bounded, and clients that stop reading or leave are aborted --


def test_a_client_that_stops_reading_is_aborted_and_its_pages_freed(stream_server):
    before = aborted(stream_server)
    sock = send_unread(stream_server, {**LONG, "stream": True}, receive_buffer=4096)
    try:
        wait_generating(stream_server)
        wait_for_idle_pool(stream_server, timeout=40)
        assert aborted(stream_server) == before + 1
    finally:
        sock.close()


@pytest.mark.parametrize("stream", [False, True], ids=["json", "stream"])
def test_a_client_that_leaves_while_outputs_flow_is_aborted_at_once(stream_server, stream):
    before = aborted(stream_server)
    sock = send_unread(stream_server, {**LONG, "stream": stream})
    wait_generating(stream_server)
    time.sleep(1)  # outputs keep arriving: the request is never idle
    sock.close()
    wait_for_idle_pool(stream_server, timeout=5)
    assert aborted(stream_server) == before + 1


def test_a_mid_stream_output_carries_only_its_delta(tiny_llama_dir):
    engine = LLMEngine(
        EngineConfig(model=str(tiny_llama_dir), page_size=4, num_kv_pages=64, max_model_len=128),
        progress=False,
    )
    params = SamplingParams(max_tokens=12, temperature=0, ignore_eos=True, logprobs=1)
    engine.add_request(list(range(10, 20)), params)
    outputs = []
    while engine.has_unfinished():
        outputs += engine.step()
    *steps, final = outputs
    assert len(steps) == 11 and not any(o.finished for o in steps)
    assert all(o.token_ids is None and o.logprobs is None and o.text is None for o in steps)
    assert all(len(o.delta_token_ids) == len(o.delta_logprobs) == 1 for o in steps)
    assert final.finished and len(final.delta_token_ids) == 1
    assert final.token_ids == [t for o in outputs for t in o.delta_token_ids]
    assert final.logprobs == [e for o in outputs for e in o.delta_logprobs]
    assert final.text == "".join(o.delta_text for o in outputs)


class IdleEngine:
    """Stands in for LLMEngine behind AsyncEngine: nothing to run; records aborts."""

    def __init__(self):
        self.aborted = []

    def has_unfinished(self) -> bool:
        return False

    def step(self) -> list:
        return []

    def abort(self, request_id: str) -> list:
        self.aborted.append(request_id)
        return []


def one_token(index: int, token: int) -> RequestOutput:
    return RequestOutput(
        "r",
        index,
        [1],
        None,
        None,
        f"<{token}>",
        [token],
        False,
        delta_logprobs=[{"token_id": token}],
    )


def test_outputs_a_reader_does_not_take_are_merged_one_per_choice():
    async def run():
        handle = AsyncEngine(IdleEngine(), max_pending=8).open(1, 2)
        for token in range(1000):
            for index in (0, 1):
                handle.put(index, one_token(index, token))
        taken = dict([await handle.next(), await handle.next()])
        for out in taken.values():
            assert out.delta_token_ids == list(range(1000))
            assert out.delta_text == "".join(f"<{t}>" for t in range(1000))
            assert [e["token_id"] for e in out.delta_logprobs] == list(range(1000))
        with pytest.raises(TimeoutError):
            await handle.next(timeout=0.05)  # nothing else was held
        return sorted(taken)

    assert asyncio.run(run()) == [0, 1]


def test_a_reader_that_takes_nothing_for_the_stall_timeout_ends_its_request():
    engine = IdleEngine()

    async def run():
        handle = AsyncEngine(engine, max_pending=8, stall_timeout=0.1).open(1, 1)
        handle.put(0, one_token(0, 1))
        await asyncio.sleep(0.2)
        handle.put(0, one_token(0, 2))
        with pytest.raises(StreamStalled):
            await handle.next()
        return handle.ids

    ids = asyncio.run(run())
    deadline = time.monotonic() + 5
    while engine.aborted != ids:
        assert time.monotonic() < deadline, "the stalled request was not aborted in the engine"
        time.sleep(0.05)


# --- F8: --max-pending counts sequences (prompts x n) ---------------------------------------


def complete(base: str, **body) -> httpx.Response:
    return httpx.post(
        base + "/v1/completions",
        timeout=60,
        json={"model": MODEL, "prompt": "hi", "max_tokens": 2, **body},
    )


def test_a_request_of_more_sequences_than_max_pending_is_refused(stream_server):
    for body in ({"n": 5}, {"prompt": ["a", "b", "c"], "n": 2}):
        r = complete(stream_server, **body)
        assert r.status_code == 400, r.text
        error = r.json()["error"]
        assert error["code"] == "too_many_sequences" and error["param"] == "n"
    assert complete(stream_server, prompt=["a", "b"], n=2).status_code == 200  # 4 fit


def test_each_of_n_sequences_counts_toward_max_pending(stream_server):
    with httpx.stream(
        "POST",
        stream_server + "/v1/completions",
        timeout=60,
        json={**LONG, "n": 3, "stream": True},
    ) as running:
        lines = running.iter_lines()  # kept: a dropped iterator closes the stream
        next(lines)  # 3 of the 4 sequences are in flight
        busy = complete(stream_server, n=2)
        assert busy.status_code == 429 and busy.headers.get("retry-after")
        assert busy.json()["error"]["code"] == "too_many_requests"
        assert complete(stream_server, n=1).status_code == 200
    wait_for_idle_pool(stream_server)
    assert complete(stream_server, n=4).status_code == 200


# --- F10: metrics and cached-token counts ------------------------------------------------------


def test_metrics_on_their_own_listener_and_not_on_the_api_port(tmp_path):
    keys = tmp_path / "keys.json"
    keys.write_text(json.dumps(TENANT_KEYS))
    metrics_port = free_port()
    proc, base = start_server(
        tmp_path,
        "serve",
        *SMALL,
        "--api-keys",
        str(keys),
        "--metrics-port",
        str(metrics_port),
    )
    try:
        for key in TENANT_KEYS:
            r = httpx.post(
                base + "/v1/completions",
                headers={"Authorization": f"Bearer {key}"},
                json={"model": MODEL, "prompt": SHARED, "max_tokens": 2},
                timeout=60,
            )
            assert r.status_code == 200, r.text
        on_api = httpx.get(base + "/metrics")
        assert on_api.status_code == 404 and on_api.json()["error"]["code"] == "not_found"
        text = httpx.get(f"http://127.0.0.1:{metrics_port}/metrics").text
        assert 'kvfence_requests_ended_total{outcome="finished"} 2.0' in text
        assert not any(key in text for key in TENANT_KEYS), "a metric names a key"
        # The listener is the operators': per-tenant series are there, never on the API port.
        assert all(
            f'kvfence_tenant_requests_total{{outcome="length",tenant="{t}"}} 1.0' in text
            for t in TENANT_KEYS.values()
        )
    finally:
        stop_server(proc)


def test_a_public_server_without_keys_reports_no_cached_tokens(tmp_path):
    proc, base = start_server(tmp_path, "serve", *SMALL, "--host", "0.0.0.0")
    try:
        for _ in range(2):  # the second one hits the cache the first one filled
            r = complete(base, prompt=SHARED)
            assert r.status_code == 200 and r.json()["usage"]["prompt_tokens"] > 100
            assert "prompt_tokens_details" not in r.json()["usage"]
        assert metric(base, "kvfence_prefix_cache_hit_tokens_total") > 100
    finally:
        stop_server(proc)


# --- F11: faults need KVFENCE_ALLOW_FAULTS=1 and show in /health ----------------------------


def test_an_injected_fault_needs_the_environment_and_shows_in_health(tmp_path, monkeypatch):
    monkeypatch.delenv("KVFENCE_ALLOW_FAULTS", raising=False)
    fault = ["--inject-fault", "legacy-reject-path", *SMALL]
    proc, base = spawn_server(tmp_path, "serve", *fault)
    try:
        assert proc.wait(60) != 0
    finally:
        stop_server(proc)
    log = (tmp_path / f"server-{base.rsplit(':', 1)[1]}.log").read_text()
    assert "KVFENCE_ALLOW_FAULTS=1" in log, log[-2000:]
    proc, base = start_server(tmp_path, "serve", *fault, env=ALLOW_FAULTS)
    try:
        health = httpx.get(base + "/health").json()
        assert health == {
            "status": "ok",
            "role": "unified",
            "fault": "legacy-reject-path",
        }
    finally:
        stop_server(proc)


def test_health_names_no_fault_when_none_is_injected(stream_server):
    assert httpx.get(stream_server + "/health").json() == {
        "status": "ok",
        "role": "unified",
    }


def test_the_offline_api_refuses_a_fault_without_the_environment(tiny_llama_dir, monkeypatch):
    monkeypatch.delenv("KVFENCE_ALLOW_FAULTS", raising=False)
    config = EngineConfig(
        model=str(tiny_llama_dir),
        num_kv_pages=64,
        max_model_len=128,
        inject_fault="truncated-transfer",
    )
    with pytest.raises(ConfigError, match="KVFENCE_ALLOW_FAULTS=1"):
        LLMEngine(config, progress=False)
