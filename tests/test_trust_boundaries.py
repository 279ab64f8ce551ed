"""The edges of a disaggregated deployment, attacked from outside: a client holding a valid
key that can reach worker ports, a forged router, and stalling or vanishing transfer peers."""

import json
import socket
import threading
import time

import httpx
import pytest
import torch
from test_disagg import MODEL, start_cluster, stop_server

from helpers import TENANT_KEYS, wait_for_idle_pool, write_tenant_keys
from kvfence.config import EngineConfig
from kvfence.disagg import INTERNAL_TOKEN_HEADER
from kvfence.disagg.transfer import KVTransfer, TransferError
from kvfence.engine.llm_engine import LLMEngine
from kvfence.engine.sampling_params import SamplingParams
from kvfence.kv.pool import KVPool
from kvfence.model.config import ModelConfig

ALICE, BOB = list(TENANT_KEYS)
INTERNAL = [
    ("POST", "/internal/prefill/v1/completions"),
    ("POST", "/internal/prefill/v1/chat/completions"),
    ("GET", "/internal/transfer/{tid}"),
    ("POST", "/internal/release/{tid}"),
    ("POST", "/internal/decode/v1/completions"),
    ("POST", "/internal/decode/v1/chat/completions"),
]
BODY = {
    "model": MODEL,
    "prompt": "The capital of France is a city that",
    "max_tokens": 4,
    "temperature": 0,
}


class Canary:
    """A listener that records every connection: a worker must never call out to it."""

    def __init__(self):
        self.sock = socket.create_server(("127.0.0.1", 0))
        self.url = f"http://127.0.0.1:{self.sock.getsockname()[1]}"
        self.connections = 0
        threading.Thread(target=self._accept, daemon=True).start()

    def _accept(self):
        while True:
            conn, _ = self.sock.accept()
            self.connections += 1
            conn.close()


@pytest.fixture(scope="module")
def keyed_cluster(tmp_path_factory):
    tmp = tmp_path_factory.mktemp("keyed")
    keys = write_tenant_keys(tmp)
    worker = ["--api-keys", str(keys), "--num-kv-pages", "64"]
    procs, router, urls = start_cluster(tmp, [worker], [[*worker, "--kv-sentinel", "off"]])
    yield router, urls, (tmp / "internal-token").read_text()
    for p in procs:
        stop_server(p)


def bearer(key: str) -> dict:
    return {"Authorization": f"Bearer {key}"}


def test_internal_endpoints_refuse_client_keys(keyed_cluster):
    """Finding 1: a client key (or a wrong token) opens no internal endpoint, so no client
    ever sees agent metadata or pool addresses; the router's health lists no worker URL."""
    router, urls, token = keyed_cluster
    tid = "0" * 32
    for url in urls["prefill"] + urls["decode"]:
        for method, path in INTERNAL:
            for headers in (
                bearer(ALICE),
                {**bearer(ALICE), INTERNAL_TOKEN_HEADER: token[:-1] + "x"},
                {},
            ):
                r = httpx.request(
                    method,
                    url + path.format(tid=tid),
                    json=BODY,
                    headers=headers,
                    timeout=30,
                )
                assert r.status_code == 401, (url, path, r.text[:200])
                assert r.json()["error"]["code"] == "invalid_internal_token"
    health = httpx.get(router + "/health").text
    assert all(u.split("//")[1] not in health for u in urls["prefill"] + urls["decode"])


def test_manifest_goes_to_token_holders_only(keyed_cluster):
    """A parked transfer's manifest needs the token, then the key of the tenant who sent the
    prompt; with both, a second NIXL agent can read exactly the parked KV (what a decode
    worker does, and what finding 1 let any client do)."""
    router, urls, token = keyed_cluster
    prefill = urls["prefill"][0]
    internal = {INTERNAL_TOKEN_HEADER: token}
    parked = httpx.post(
        prefill + "/internal/prefill/v1/completions",
        json=BODY,
        headers={**internal, **bearer(ALICE)},
        timeout=60,
    ).json()
    tid = parked["transfer_id"]
    try:
        assert (
            httpx.get(f"{prefill}/internal/transfer/{tid}", headers=bearer(ALICE)).status_code
            == 401
        )
        other = httpx.get(f"{prefill}/internal/transfer/{tid}", headers={**internal, **bearer(BOB)})
        assert other.status_code == 404  # another tenant's transfer does not exist for bob
        manifest = httpx.get(
            f"{prefill}/internal/transfer/{tid}", headers={**internal, **bearer(ALICE)}
        ).json()
        assert manifest["token_count"] == parked["kv_tokens"] > 0 and 0 < manifest["lease_s"] <= 60
    finally:
        httpx.post(f"{prefill}/internal/release/{tid}", headers={**internal, **bearer(ALICE)})
    wait_for_idle_pool(prefill)


def test_decode_worker_takes_no_bare_headers(keyed_cluster):
    """Findings 2 and 5: sent straight to a decode worker, a client's prefill URL is never
    fetched (no SSRF) and an empty transfer cannot make it decode over stale pages."""
    router, urls, token = keyed_cluster
    decode = urls["decode"][0] + "/internal/decode/v1/completions"
    canary = Canary()
    # Fill the decode pool's free list with another request's KV first (the sentinel is off there).
    assert (
        httpx.post(
            router + "/v1/completions",
            json={**BODY, "prompt": "Secret: 4417. " * 20},
            headers=bearer(BOB),
            timeout=60,
        ).status_code
        == 200
    )
    forged = {"x-kvfence-prefill-url": canary.url, "x-kvfence-transfer-id": "ab" * 16}
    r = httpx.post(decode, json=BODY, headers={**bearer(ALICE), **forged}, timeout=30)
    assert r.status_code == 401 and canary.connections == 0
    r = httpx.post(
        decode,
        json=BODY,
        headers={**bearer(ALICE), **forged, "x-kvfence-transfer-id": ""},
        timeout=30,
    )
    assert r.status_code == 401
    # Even a caller holding the token cannot skip the manifest for a prompt of many tokens.
    internal = {**bearer(ALICE), INTERNAL_TOKEN_HEADER: token}
    r = httpx.post(
        decode,
        json=BODY,
        headers={**internal, **forged, "x-kvfence-transfer-id": ""},
        timeout=30,
    )
    assert r.status_code == 400 and r.json()["error"]["code"] == "invalid_transfer"
    r = httpx.post(
        decode,
        json=BODY,
        headers={**internal, **forged, "x-kvfence-transfer-id": "../x"},
        timeout=30,
    )
    assert r.status_code == 400 and r.json()["error"]["code"] == "invalid_transfer"
    assert canary.connections == 0
    wait_for_idle_pool(urls["decode"][0])


def test_router_forwards_no_client_internal_headers(keyed_cluster):
    router, urls, token = keyed_cluster
    canary = Canary()
    forged = {
        "x-kvfence-prefill-url": canary.url,
        "x-kvfence-transfer-id": "",
        INTERNAL_TOKEN_HEADER: "forged",
    }
    r = httpx.post(
        router + "/v1/completions",
        json=BODY,
        headers={**bearer(ALICE), **forged},
        timeout=60,
    )
    assert r.status_code == 200 and r.json()["choices"][0]["text"]
    assert canary.connections == 0


def test_decode_errors_do_not_echo_the_peer(keyed_cluster, tmp_path):
    """A peer's answer is parsed strictly and never quoted back to the client."""
    from http.server import BaseHTTPRequestHandler, HTTPServer

    class Peer(BaseHTTPRequestHandler):
        def do_GET(self):
            body = json.dumps({"transfer_id": "peer-secret-1234", "token_count": "many"}).encode()
            self.send_response(200)
            self.send_header("content-type", "application/json")
            self.send_header("content-length", str(len(body)))
            self.end_headers()
            self.wfile.write(body)

        def do_POST(self):
            self.send_response(404)
            self.end_headers()

        def log_message(self, *args):
            pass

    peer = HTTPServer(("127.0.0.1", 0), Peer)
    threading.Thread(target=peer.serve_forever, daemon=True).start()
    router, urls, token = keyed_cluster
    headers = {
        **bearer(ALICE),
        INTERNAL_TOKEN_HEADER: token,
        "x-kvfence-transfer-id": "cd" * 16,
        "x-kvfence-prefill-url": f"http://127.0.0.1:{peer.server_port}",
    }
    r = httpx.post(
        urls["decode"][0] + "/internal/decode/v1/completions",
        json=BODY,
        headers=headers,
        timeout=30,
    )
    peer.shutdown()
    assert r.status_code == 502 and r.json()["error"]["code"] == "kv_transfer_failed"
    assert "peer-secret" not in r.text and "many" not in r.text
    wait_for_idle_pool(urls["decode"][0])


# --- transfers against real NIXL agents, in one process ---------------------------------

CFG = ModelConfig("llama", 10, 8, 16, 2, 2, 1, 4, 1e4, 1e-5, 64, True)


def parked_source(config: ModelConfig = CFG) -> tuple[KVTransfer, object]:
    """A sending agent with random KV and a manifest of 6 tokens in its pages 5 and 2. It
    does not poll until told to expect the reader, and without its polling the transport
    does not move the data: until then, a stalled peer."""
    pool = KVPool(config, 8, 4)
    pool.k.normal_()
    pool.v.normal_()
    sender = KVTransfer(pool)
    return sender, sender.manifest("t" * 32, [5, 2], 6)


def read_in_thread(receiver: KVTransfer, manifest, pages: list[int], seconds: float) -> tuple:
    """Starts a read that must fail by its deadline; returns (thread, errors seen)."""
    errors = []

    def read():
        try:
            receiver.read(manifest, pages, time.monotonic() + seconds)
        except TransferError as e:
            errors.append(e)

    thread = threading.Thread(target=read)
    thread.start()
    return thread, errors


def test_transfers_to_different_peers_do_not_wait_on_each_other():
    """Finding 6: a read from a stalled peer holds no lock that a read from a live one needs."""
    receiver = KVTransfer(KVPool(CFG, 8, 4))
    _, stalled = parked_source()
    live, manifest = parked_source()
    live.expect(manifest.transfer_id, time.monotonic() + 10)
    slow, errors = read_in_thread(receiver, stalled, [1, 7], 4)
    time.sleep(0.2)
    receiver.read(manifest, [3, 4], time.monotonic() + 3)
    assert slow.is_alive(), "the live peer's read waited for the stalled one"
    slow.join()
    assert errors and "deadline" in str(errors[0])
    got, sent = (
        receiver.pool.k,
        live.pool.k,
    )  # pages 5 and 2 (6 tokens) landed in pages 3 and 4
    assert torch.equal(got[:, 12:16], sent[:, 20:24]) and torch.equal(got[:, 16:18], sent[:, 8:10])


def test_no_read_starts_after_the_deadline():
    """The manifest's lease bounds the read: a reader past it must not touch the sender's pages."""
    receiver = KVTransfer(KVPool(CFG, 8, 4))
    sender, manifest = parked_source()
    sender.expect(manifest.transfer_id, time.monotonic() + 10)
    with pytest.raises(TransferError, match="did not start"):
        receiver.read(manifest, [1, 7], time.monotonic() - 0.01)
    assert not receiver.pool.k.any()


def test_pages_under_transfer_are_quarantined_until_the_read_returns(tiny_llama_dir):
    """Finding 4: aborting a request whose READ is in flight keeps its pages out of the free
    list until the read thread has returned; only then are they freed."""
    engine = LLMEngine(
        EngineConfig(
            model=str(tiny_llama_dir),
            page_size=4,
            num_kv_pages=8,
            max_model_len=32,
            kv_sentinel="enforce",
        ),
        progress=False,
    )
    receiver = KVTransfer(engine.pool)
    _, stalled = parked_source(engine.model_config)
    req = engine.reserve(list(range(1, 8)), SamplingParams(max_tokens=2), "r" * 32, "alice", 6)
    pages = list(req.block_table)
    reader, errors = read_in_thread(receiver, stalled, pages, 2)
    time.sleep(0.2)
    assert engine.abort("r" * 32) and reader.is_alive()
    assert all(engine.allocator.owner[p] == req.owner for p in pages), (
        "pages freed while the read runs"
    )
    assert not set(pages) & set(engine.allocator.allocate(999, engine.allocator.num_free))
    engine.allocator.free_owner(999)
    reader.join()
    assert errors
    engine.end_transfer("r" * 32, None)
    assert engine.allocator.num_free == engine.allocator.num_pages


# --- kvfence audit --workers ------------------------------------------------------------


def audit_workers(urls: list[str], *keys: str) -> tuple[int, dict]:
    import subprocess
    import sys

    args = [a for k in keys for a in ("--api-key", k)]
    r = subprocess.run(
        [
            sys.executable,
            "-m",
            "kvfence.cli",
            "audit",
            "--json",
            *args,
            "--workers",
            *urls,
        ],
        capture_output=True,
        text=True,
        timeout=120,
    )
    return r.returncode, json.loads(r.stdout)


def test_worker_audit_passes_a_token_protected_cluster(keyed_cluster):
    router, urls, token = keyed_cluster
    code, report = audit_workers(urls["prefill"] + urls["decode"], ALICE, BOB)
    assert (
        code == 0
        and report["findings"] == []
        and "internal endpoints refuse clients" in report["passed"]
    )


def test_worker_audit_finds_an_internal_endpoint_that_answers_a_client():
    """A worker that serves a transfer manifest to a client key (what finding 1 was) is a
    finding naming the endpoint, and the audit exits 1."""
    from http.server import BaseHTTPRequestHandler, HTTPServer

    class OpenWorker(BaseHTTPRequestHandler):
        def do_GET(self):
            found = self.path.startswith("/internal/transfer/")
            body = json.dumps(
                {"agent_metadata": "..."} if found else {"error": {"code": "not_found"}}
            ).encode()
            self.send_response(200 if found else 404)
            self.send_header("content-type", "application/json")
            self.send_header("content-length", str(len(body)))
            self.end_headers()
            self.wfile.write(body)

        do_POST = do_GET

        def log_message(self, *args):
            pass

    worker = HTTPServer(("127.0.0.1", 0), OpenWorker)
    threading.Thread(target=worker.serve_forever, daemon=True).start()
    try:
        code, report = audit_workers([f"http://127.0.0.1:{worker.server_port}"], ALICE)
    finally:
        worker.shutdown()
    assert code == 1
    paths = {(f["detail"]["path"], f["detail"]["status"]) for f in report["findings"]}
    assert paths == {("/internal/transfer/" + "0" * 32, 200)}
    assert all(f["check"] == "internal_endpoints" for f in report["findings"])


def test_parked_kv_counts_toward_max_pending(tmp_path):
    """Finding 6: prompts parked for a decode worker hold pages, so they hold --max-pending
    slots until their KV is pulled, released or its lease ends."""
    from helpers import start_server

    token = tmp_path / "internal-token"
    token.write_text("t" * 32)
    proc, url = start_server(
        tmp_path,
        "serve",
        "--role",
        "prefill",
        "--internal-token-file",
        str(token),
        "--threads",
        "1",
        "--max-model-len",
        "512",
        "--num-kv-pages",
        "64",
        "--max-pending",
        "2",
        "--park-timeout",
        "120",
    )
    internal = {INTERNAL_TOKEN_HEADER: "t" * 32}
    try:
        parked = [
            httpx.post(
                url + "/internal/prefill/v1/completions",
                json={**BODY, "prompt": f"{i} {BODY['prompt']}"},
                headers=internal,
                timeout=60,
            )
            for i in range(3)
        ]
        assert [r.status_code for r in parked] == [200, 200, 429]
        httpx.post(
            f"{url}/internal/release/{parked[0].json()['transfer_id']}",
            headers=internal,
        )
        again = httpx.post(
            url + "/internal/prefill/v1/completions",
            json=BODY,
            headers=internal,
            timeout=60,
        )
        assert again.status_code == 200
        for r in (parked[1], again):
            httpx.post(f"{url}/internal/release/{r.json()['transfer_id']}", headers=internal)
        wait_for_idle_pool(url)
    finally:
        stop_server(proc)


def test_a_peers_garbage_notification_stops_no_release():
    """A process that reaches the sender's transport and sends a notification that is not a
    transfer id (bytes that are not even text) neither stops the thread that hears readers
    out nor releases anything: the real reader's notification still frees its KV."""
    sender, manifest = parked_source()
    pulled = []
    sender.on_pulled = pulled.append
    sender.expect(manifest.transfer_id, time.monotonic() + 30)
    peer = KVTransfer(KVPool(CFG, 8, 4))
    name = peer._remote(manifest)
    for note in (b"\xff\xfe\x00", b"u" * 32, manifest.transfer_id.encode()):
        peer.agent.send_notif(name, note)
    deadline = time.monotonic() + 10
    while not pulled and time.monotonic() < deadline:
        peer.agent.get_new_notifs()  # drives the peer's side of the transport, as a reader does
        time.sleep(0.05)
    time.sleep(0.2)
    assert pulled == [manifest.transfer_id]
