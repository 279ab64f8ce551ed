"""One client, or one process that reaches the port, against every other tenant's service:
each attack here is made from outside, over a raw socket or HTTP, on a real server."""

import json
import resource
import shutil
import socket
import subprocess
import sys
import time

import httpx
import pytest

from helpers import free_port, metric, start_server, stop_server, wait_healthy

MODEL = "tiny"
QUOTA, OTHER = "sk-mallory-quota-0001", "sk-bob-plain-000001"
KEYS = {QUOTA: {"tenant": "mallory", "max_tokens_per_minute": 100}, OTHER: "bob"}
# A template that refuses a conversation opening with the assistant, as strict ones do
TEMPLATE = (
    "{% if messages[0]['role'] == 'assistant' %}"
    "{{ raise_exception('a conversation starts with the user') }}{% endif %}"
    "{% for m in messages %}{{ m['role'] }}: {{ m['content'] }}\n{% endfor %}"
)
HEADER_TIMEOUT, BODY_TIMEOUT, MAX_PENDING = 2, 2, 8


def strict_template_model(src, dst):
    shutil.copytree(src, dst)
    (dst / "chat_template.jinja").write_text(TEMPLATE)
    return dst


@pytest.fixture(scope="module")
def hostile(tmp_path_factory, tiny_llama_dir):
    tmp = tmp_path_factory.mktemp("hostile")
    (tmp / "keys.json").write_text(json.dumps(KEYS))
    model = strict_template_model(tiny_llama_dir, tmp / "model")
    proc, base = start_server(
        tmp,
        "serve",
        "--model",
        str(model),
        "--served-model-name",
        MODEL,
        "--api-keys",
        str(tmp / "keys.json"),
        "--max-model-len",
        "256",
        "--num-kv-pages",
        "256",
        "--threads",
        "1",
        "--max-pending",
        str(MAX_PENDING),
        "--header-timeout",
        str(HEADER_TIMEOUT),
        "--body-timeout",
        str(BODY_TIMEOUT),
    )
    yield base
    stop_server(proc)


def post(base, path, key, **body):
    return httpx.post(
        base + path,
        json={"model": MODEL, **body},
        headers={"Authorization": f"Bearer {key}"},
        timeout=60,
    )


def connect(base: str, receive_buffer: int | None = None) -> socket.socket:
    host, port = base.removeprefix("http://").rsplit(":", 1)
    sock = socket.socket()
    if receive_buffer:  # set before connecting, so that the window stays small
        sock.setsockopt(socket.SOL_SOCKET, socket.SO_RCVBUF, receive_buffer)
    sock.connect((host, int(port)))
    return sock


def request_bytes(path: str, key: str, body: bytes, length: int | None = None) -> bytes:
    head = (
        f"POST {path} HTTP/1.1\r\nHost: x\r\nAuthorization: Bearer {key}\r\n"
        f"Content-Type: application/json\r\nContent-Length: {length or len(body)}\r\n\r\n"
    )
    return head.encode() + body


def read_to_close(sock: socket.socket, seconds: float) -> bytes:
    """All the server sends before it closes the connection."""
    sock.settimeout(seconds)
    answer = b""
    while chunk := sock.recv(65536):
        answer += chunk
    return answer


def closed_within(sock: socket.socket, seconds: float) -> bool:
    """Whether the server closes the connection within `seconds` (whatever it sends first)."""
    sock.settimeout(seconds)
    try:
        while sock.recv(65536):
            pass
        return True
    except ConnectionResetError:
        return True
    except TimeoutError:
        return False


def test_a_poisoned_request_credits_its_tenant_no_tokens(hostile):
    """Hole 1: negative max_tokens, n or max_completion_tokens, and a token-id prompt over the
    context with max_tokens null, each answered 400, must not leave a negative charge that
    lets the tenant generate past its limit afterwards."""
    poisoned = [
        ("/v1/completions", {"prompt": list(range(10, 20)), "max_tokens": -5000}),
        ("/v1/completions", {"prompt": list(range(10, 20)), "max_tokens": 15, "n": -3}),
        ("/v1/completions", {"prompt": list(range(10, 600)), "max_tokens": None}),
        (
            "/v1/chat/completions",
            {"messages": [{"role": "user", "content": "hi"}], "max_completion_tokens": -9000},
        ),
    ]
    for path, body in poisoned:
        r = post(hostile, path, QUOTA, **body)
        assert r.status_code == 400, r.text
    honest = {"prompt": list(range(10, 20)), "max_tokens": 15, "ignore_eos": True}
    codes = [post(hostile, "/v1/completions", QUOTA, **honest).status_code for _ in range(5)]
    assert codes == [200, 200, 200, 200, 429], "10 + 15 tokens each, 100 a minute"


def test_a_reader_that_stops_reading_holds_no_slot_once_its_request_ended(hostile):
    """Hole 2: a stream whose client never reads again, its connection left open, gives its
    --max-pending slots back when the engine has finished it."""
    body = json.dumps(
        {
            "model": MODEL,
            "prompt": "stall",
            "max_tokens": 120,
            "n": MAX_PENDING,
            "ignore_eos": True,
            "stream": True,
        }
    ).encode()
    sock = connect(hostile, receive_buffer=2048)
    try:
        sock.sendall(request_bytes("/v1/completions", OTHER, body))
        sock.recv(1)  # the stream started; from here on nothing is read
        deadline = time.monotonic() + 60
        while metric(hostile, "kvfence_requests_running") or metric(
            hostile, "kvfence_requests_waiting"
        ):
            assert time.monotonic() < deadline, "the stalled request never finished"
            time.sleep(0.2)
        r = post(hostile, "/v1/completions", OTHER, prompt="next", max_tokens=2)
        assert r.status_code == 200, r.text
    finally:
        sock.close()


def test_headers_sent_a_byte_at_a_time_lose_their_connection(hostile):
    """Hole 5, slowloris: a request whose headers never end, or a connection that sends
    nothing, is closed after --header-timeout."""
    silent, dribbling = connect(hostile), connect(hostile)
    try:
        dribbling.sendall(b"POST /v1/completions HTTP/1.1\r\nHost: x\r\n")
        for _ in range(HEADER_TIMEOUT * 2):
            try:
                dribbling.sendall(b"X")
            except OSError:
                break
            time.sleep(0.5)
        assert closed_within(dribbling, HEADER_TIMEOUT + 3)
        assert closed_within(silent, HEADER_TIMEOUT + 3)
    finally:
        silent.close()
        dribbling.close()


def test_a_body_left_unread_after_the_answer_holds_no_connection(hostile):
    """Hole 5: answered before its body was read (401 here), a connection whose client goes on
    sending that body, a byte at a time, is closed: no deadline would cover it otherwise."""
    sock = connect(hostile)
    try:
        sock.sendall(request_bytes("/v1/completions", "sk-not-a-key", b"{", length=10**6))
        sock.settimeout(10)
        assert sock.recv(65536).startswith(b"HTTP/1.1 401")
        for _ in range(3):
            try:
                sock.sendall(b" ")
            except OSError:
                break
            time.sleep(0.5)
        assert closed_within(sock, HEADER_TIMEOUT + 3)
    finally:
        sock.close()


def test_a_withheld_last_body_byte_gets_408(hostile):
    """Hole 5: a body that stops short of its Content-Length is answered 408 after
    --body-timeout, not waited for."""
    body = json.dumps({"model": MODEL, "prompt": "x", "max_tokens": 1}).encode()
    sock = connect(hostile)
    try:
        sock.sendall(request_bytes("/v1/completions", OTHER, body[:-1], length=len(body)))
        answer = read_to_close(sock, BODY_TIMEOUT + 10)
        assert answer.startswith(b"HTTP/1.1 408"), answer[:200]
        assert b'"code":"body_timeout"' in answer
    finally:
        sock.close()


def test_tokenize_with_a_conversation_the_template_refuses_is_a_400(hostile):
    """Hole 8: /tokenize renders messages through the same guard as chat completions."""
    messages = [{"role": "assistant", "content": "I speak first"}]
    for path in ("/tokenize", "/v1/chat/completions"):
        r = post(hostile, path, OTHER, messages=messages)
        assert r.status_code == 400, r.text
        assert r.json()["error"]["param"] == "messages"
        assert "starts with the user" in r.json()["error"]["message"]
    assert post(hostile, "/tokenize", OTHER, prompt="still serving").status_code == 200


def test_a_request_log_that_cannot_grow_stops_admissions_loudly(tmp_path, tiny_llama_dir):
    """Hole 7: a request log past the file size limit (ulimit -f) fails no engine thread:
    the server answers the request in hand, then /health says 503 and why, and every new
    request gets a 503, so that no request is served unrecorded."""
    limit = 4 * 2**20
    log = tmp_path / "requests.jsonl"
    last = json.dumps({"seq": 0, "prev": "0" * 64, "hash": "f" * 64}) + "\n"
    log.write_text("\n" * (limit - 100 - len(last)) + last)  # no room for one more line
    port = free_port()
    base = f"http://127.0.0.1:{port}"
    out = open(tmp_path / f"server-{port}.log", "w")
    cmd = [sys.executable, "-m", "kvfence.cli", "serve", "--model", str(tiny_llama_dir)]
    cmd += ["--max-model-len", "128", "--num-kv-pages", "64", "--threads", "1"]
    cmd += ["--request-log", str(log), "--request-log-max-mb", "64", "--port", str(port)]
    cmd += ["--served-model-name", MODEL]
    proc = subprocess.Popen(
        cmd,
        stdout=out,
        stderr=subprocess.STDOUT,
        preexec_fn=lambda: resource.setrlimit(resource.RLIMIT_FSIZE, (limit, limit)),
    )
    try:
        wait_healthy(tmp_path, proc, base)
        body = {"model": MODEL, "prompt": "hello", "max_tokens": 4}
        first = httpx.post(base + "/v1/completions", json=body, timeout=60)
        assert first.status_code == 200, first.text
        health = httpx.get(base + "/health", timeout=10)
        assert health.status_code == 503 and "request log" in health.json()["reason"]
        refused = httpx.post(base + "/v1/completions", json=body, timeout=60)
        assert refused.status_code == 503, refused.text
        assert refused.json()["error"]["code"] == "service_unavailable"
        assert proc.poll() is None, "the server stays up to say why"
    finally:
        stop_server(proc)


@pytest.fixture(scope="module")
def router(tmp_path_factory):
    """A router alone (its workers are not needed to refuse at the front door)."""
    tmp = tmp_path_factory.mktemp("router")
    (tmp / "keys.json").write_text(json.dumps(KEYS))
    (tmp / "token").write_text("t" * 32)
    proc, base = start_server(
        tmp,
        "router",
        "--prefill",
        "http://127.0.0.1:9",
        "--decode",
        "http://127.0.0.1:9",
        "--internal-token-file",
        str(tmp / "token"),
        "--api-keys",
        str(tmp / "keys.json"),
        "--max-body-bytes",
        "10000",
        "--body-timeout",
        str(BODY_TIMEOUT),
    )
    yield base
    stop_server(proc)


def test_the_router_refuses_an_unauthenticated_upload_before_reading_it(router):
    """Hole 4: a chunked upload without a key gets 401 after its first chunk."""
    sock = connect(router)
    try:
        sock.sendall(
            b"POST /v1/completions HTTP/1.1\r\nHost: x\r\nContent-Type: application/json\r\n"
            b"Transfer-Encoding: chunked\r\n\r\n" + b"10000\r\n" + b"x" * 0x10000 + b"\r\n"
        )
        sock.settimeout(10)
        assert sock.recv(65536).startswith(b"HTTP/1.1 401")
    finally:
        sock.close()


def test_the_router_bounds_a_keyed_clients_body_in_size_and_time(router):
    """Hole 4: with a valid key, a body over --max-body-bytes is a 413, a body withheld a
    408, both without a worker."""
    big = post(router, "/v1/completions", OTHER, prompt="x" * 20000)
    assert big.status_code == 413 and big.json()["error"]["code"] == "body_too_large"
    sock = connect(router)
    try:
        sock.sendall(request_bytes("/v1/completions", OTHER, b'{"prompt": ', length=100))
        sock.settimeout(BODY_TIMEOUT + 10)
        assert sock.recv(65536).startswith(b"HTTP/1.1 408")
    finally:
        sock.close()
