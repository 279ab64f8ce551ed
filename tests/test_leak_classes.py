"""The known leak classes, each re-created by a test-only fault (testing/faults.py) in real
servers. With the sentinel off, `kvfence audit` finds each from outside; with it enforcing,
no response carries another request's KV, the violation is logged and counted, and the
server goes on serving. The incident replay and truncated transfers are in test_isolation.py
and test_disagg.py."""

import asyncio

import httpx
from test_disagg import start_cluster

from helpers import (
    ALLOW_FAULTS,
    TENANT_KEYS,
    metric,
    run_audit,
    start_server,
    start_tenant_server,
    stop_server,
    wait_for_idle_pool,
)
from kvfence.testing.faults import LATE_READ_S

KEY_ARGS = [a for k in TENANT_KEYS for a in ("--api-key", k)]
ALICE, BOB = ({"Authorization": f"Bearer {k}"} for k in TENANT_KEYS)
QUESTIONS = [
    "Explain in two sentences why the sky is blue.",
    "Write a haiku about autumn leaves.",
    "Give three tips for writing readable Python code.",
    "What is the difference between a list and a tuple?",
    "Write a story about a ship.",
    "Write a story about rain.",
    "Name three rivers of Europe.",
    "Why do cats purr?",
]


def audit_then_stop(procs, base: str, *args: str, tries: int = 1):
    """`kvfence audit` of `base`, again until one finds something, up to `tries` (for faults
    whose effect timing decides), then the servers stopped whatever it did."""
    try:
        for _ in range(tries):
            code, report = run_audit(base, *args)
            if code == 1:
                break
        return code, report
    finally:
        for p in procs:
            stop_server(p)


def server_log(tmp_path, base: str) -> str:
    return (tmp_path / f"server-{base.rsplit(':', 1)[1]}.log").read_text()


def audit_checks(report) -> set[str]:
    return {f["check"] for f in report["findings"]}


async def chats(
    base: str, questions: list[str], headers=None, gap_s: float = 0.0
) -> list[httpx.Response]:
    """Greedy chat answers, in flight together, the i-th sent `i * gap_s` seconds in."""

    async def chat(client, i: int, question: str) -> httpx.Response:
        await asyncio.sleep(i * gap_s)
        return await client.post(
            base + "/v1/chat/completions",
            headers=headers or {},
            json={
                "model": "smollm2",
                "messages": [{"role": "user", "content": question}],
                "max_tokens": 32,
                "temperature": 0,
            },
        )

    async with httpx.AsyncClient(timeout=120) as client:
        return await asyncio.gather(*(chat(client, i, q) for i, q in enumerate(questions)))


def answers_alone(base: str, headers=None) -> dict[str, str]:
    return {
        q: asyncio.run(chats(base, [q], headers))[0].json()["choices"][0]["message"]["content"]
        for q in QUESTIONS
    }


def assert_served_answers_are_exact(
    responses, reference: dict[str, str], questions: list[str] = QUESTIONS
) -> int:
    """Every 200 answer is the one its question gets alone; returns how many failed closed."""
    failed = 0
    for q, r in zip(questions, responses, strict=True):
        if r.status_code == 200:
            assert r.json()["choices"][0]["message"]["content"] == reference[q], q
        else:
            assert r.status_code == 500 and "KV ownership" in r.json()["error"]["message"]
            assert "choices" not in r.json()
            failed += 1
    return failed


# --- shared-prefix-cache: the prefix cache keyed without the tenant --------------------------


def test_shared_prefix_cache_is_found_by_the_audit(tmp_path):
    fault = ["--inject-fault", "shared-prefix-cache", "--kv-sentinel", "off"]
    proc, base = start_tenant_server(tmp_path, *fault, env=ALLOW_FAULTS)
    checks = ["--checks", "cache", "--cache-min-tokens", "128", "--budget-minutes", "3"]
    code, report = audit_then_stop([proc], base, *KEY_ARGS, *checks)
    assert code == 1, report
    (finding,) = [f for f in report["findings"] if f["check"] == "cross-key-cache"]
    assert "one prefix cache serves several keys" in finding["message"]
    control, pair = report["cache"]
    assert (control["attacker_key"], pair["attacker_key"]) == (1, 2)
    assert control["verdict"] == pair["verdict"] == "shared"
    assert pair["p_value"] < pair["alpha"] and pair["hit_median_ms"] < pair["miss_median_ms"]
    assert pair["max_cached_tokens"] > 0, "kvfence also says so in usage.cached_tokens"


def test_shared_prefix_cache_fails_closed_under_the_sentinel(tmp_path):
    fault = ["--inject-fault", "shared-prefix-cache", "--kv-sentinel", "enforce"]
    proc, base = start_tenant_server(tmp_path, *fault, env=ALLOW_FAULTS)

    def complete(headers, prompt):
        body = {"model": "smollm2", "prompt": prompt, "max_tokens": 4, "temperature": 0}
        return httpx.post(base + "/v1/completions", json=body, headers=headers, timeout=60)

    secret = "My vault code is 31415926. " * 8
    try:
        first = complete(ALICE, secret + "Repeat it:")
        again = complete(ALICE, secret + "Say it:")
        stolen = complete(BOB, secret + "What is it?")
        fresh = complete(BOB, "A fresh prompt of bob's own, about ships.")
        violations = metric(base, "kvfence_kv_sentinel_violations_total")
        wait_for_idle_pool(base)
    finally:
        stop_server(proc)
    assert first.status_code == again.status_code == fresh.status_code == 200
    assert again.json()["usage"]["prompt_tokens_details"]["cached_tokens"] > 0
    assert stolen.status_code == 500 and "choices" not in stolen.json()
    assert "cached by another tenant" in stolen.json()["error"]["message"]
    assert violations == 1
    log = server_log(tmp_path, base)
    assert "FAULT INJECTED: shared-prefix-cache" in log
    assert "KV SENTINEL" in log and "(tenant bob): page" in log


# --- stale-block-reuse: prefix-cache pages reissued while requests still read them ---------

STALE_REUSE = ["--inject-fault", "stale-block-reuse", "--max-model-len", "512", "--threads", "2"]
SMALL_POOL = ["--num-kv-pages", "40"]  # 640 tokens: the load below evicts cached pages


def test_stale_block_reuse_is_found_by_the_audit(tmp_path):
    args = [*STALE_REUSE, *SMALL_POOL, "--kv-sentinel", "off"]
    proc, base = start_server(tmp_path, "serve", *args, env=ALLOW_FAULTS)
    # Every request in flight at once, so the pool runs short while shared pages are still
    # read. An answer changes only where a dropped page is reissued to a request that writes
    # other KV into it (the same system prompt's KV again changes nothing), which timing
    # decides: about 6 audits in 10 find it, each in seconds, so one of up to eight must.
    checks = ["--checks", "consistency", "--concurrency", "64"]
    code, report = audit_then_stop([proc], base, *checks, tries=8)
    assert code == 1, report
    assert "consistency" in audit_checks(report), report["findings"]


def test_stale_block_reuse_fails_closed_under_the_sentinel(tmp_path):
    args = [*STALE_REUSE, *SMALL_POOL, "--kv-sentinel", "enforce", "--served-model-name", "smollm2"]
    proc, base = start_server(tmp_path, "serve", *args, env=ALLOW_FAULTS)
    try:
        reference = answers_alone(base)
        # twice the pool's pages in demand: pages whose references were dropped are evicted
        # and reissued while their other readers still decode, whatever the timing
        load = QUESTIONS * 2
        failed = assert_served_answers_are_exact(asyncio.run(chats(base, load)), reference, load)
        violations = metric(base, "kvfence_kv_sentinel_violations_total")
        after = answers_alone(base)
        wait_for_idle_pool(base)
    finally:
        stop_server(proc)
    assert failed >= 1 and violations >= failed
    assert after == reference, "the server goes on serving"
    assert "KV SENTINEL" in server_log(tmp_path, base)


# --- unwritten-prefix-read: cached pages a prefill reserved and never wrote ----------------

# Short chunks, so that the audit drops each prompt with most of its prefill still to run.
CHUNKED = ["--max-num-batched-tokens", "64", "--max-num-seqs", "32"]


def test_unwritten_prefix_read_is_found_by_the_audit(tmp_path):
    fault = ["--inject-fault", "unwritten-prefix-read", "--kv-sentinel", "off", *CHUNKED]
    proc, base = start_tenant_server(tmp_path, *fault, env=ALLOW_FAULTS)
    code, report = audit_then_stop([proc], base, *KEY_ARGS, "--checks", "abort")
    assert code == 1, report
    (finding,) = report["findings"]
    assert finding["check"] == "abort" and finding["detail"]["cached_tokens"] > 0
    assert finding["leak_class"].startswith("unwritten-prefix-read")
    assert "FAULT unwritten-prefix-read" in server_log(tmp_path, base)


def test_resent_prompts_are_computed_again_without_the_fault(tmp_path):
    proc, base = start_tenant_server(tmp_path, "--kv-sentinel", "off", *CHUNKED)
    code, report = audit_then_stop([proc], base, *KEY_ARGS, "--checks", "abort")
    assert code == 0 and "aborted prefill" in report["passed"], report
    log = server_log(tmp_path, base)
    assert log.count('"finish_reason": "abort"') == 3, "each trial's drop aborted a prefill"


def test_unwritten_prefix_read_fails_closed_under_the_sentinel(tmp_path):
    fault = ["--inject-fault", "unwritten-prefix-read", "--kv-sentinel", "enforce", *CHUNKED]
    proc, base = start_tenant_server(tmp_path, *fault, env=ALLOW_FAULTS)
    try:
        reference = answers_alone(base, ALICE)
        code, report = run_audit(base, *KEY_ARGS, "--checks", "abort")
        violations = metric(base, "kvfence_kv_sentinel_violations_total")
        after = answers_alone(base, ALICE)
        wait_for_idle_pool(base)
    finally:
        stop_server(proc)
    assert code == 0 and not report["findings"], report
    failed = [i for i in report["inconclusive"] if "aborted prefill: a request failed" in i]
    assert failed and all("KV ownership" in i for i in failed), report["inconclusive"]
    assert violations == len(failed)
    assert after == reference, "the server goes on serving"
    assert "written slots, attention would read" in server_log(tmp_path, base)


# --- truncated-transfer: less KV shipped than the manifest says --------------------------


def test_truncated_transfer_is_found_by_the_audit(tmp_path):
    """The checksums do not depend on the sentinel: with it off, every such request still
    fails with an error, which the audit reports. With it on: test_disagg.py."""
    off = ["--kv-sentinel", "off"]
    fault = ["--inject-fault", "truncated-transfer", *off]
    procs, router, _ = start_cluster(tmp_path, [fault], [off], env=ALLOW_FAULTS)
    code, report = audit_then_stop(procs, router, "--checks", "canary", "--canaries", "6")
    assert code == 1, report
    (finding,) = [f for f in report["findings"] if f["check"] == "canary"]
    assert "checksum mismatch" in finding["detail"]["first_error"]
    assert "canary leak" in report["passed"]


# --- stale-lease: a prefill worker frees parked pages before the decode worker's read ------


def stale_lease_cluster(tmp_path, sentinel: str):
    """The fault on both workers. The prefill worker takes about one prompt a step and keeps
    no prefix cache (cached pages outlive their request), so that the pages each prompt frees
    early are reissued to the next one before the late read (LATE_READ_S)."""
    worker = ["--inject-fault", "stale-lease", "--kv-sentinel", sentinel]
    worker += ["--served-model-name", "smollm2"]
    one_by_one = ["--max-num-batched-tokens", "64", "--max-num-seqs", "8", "--no-prefix-cache"]
    return start_cluster(tmp_path, [worker + one_by_one], [worker], env=ALLOW_FAULTS)


def test_stale_lease_is_found_by_the_audit(tmp_path):
    procs, router, urls = stale_lease_cluster(tmp_path, "off")
    # A read goes wrong only if its pages were reissued before it (timing decides): about 4
    # audits in 5 find it.
    checks = ["--checks", "canary,consistency", "--canaries", "12"]
    code, report = audit_then_stop(procs, router, *checks, tries=4)
    assert code == 1, report
    assert {"leak", "consistency"} & audit_checks(report), report["findings"]
    assert "FAULT stale-lease" in server_log(tmp_path, urls["prefill"][0])


def test_stale_lease_fails_closed_under_the_sentinel(tmp_path):
    procs, router, urls = stale_lease_cluster(tmp_path, "enforce")
    prefill = urls["prefill"][0]
    try:
        reference = answers_alone(router)
        # Staggered less than the late read: each prompt is given the pages its predecessor
        # freed early while that one's loan still runs.
        answers = asyncio.run(chats(router, QUESTIONS, gap_s=LATE_READ_S / 3))
        failed = assert_served_answers_are_exact(answers, reference)
        violations = metric(prefill, "kvfence_kv_sentinel_violations_total")
        after = answers_alone(router)
        for url in urls["prefill"] + urls["decode"]:
            wait_for_idle_pool(url)
    finally:
        for p in procs:
            stop_server(p)
    assert failed >= 1 and violations >= failed
    assert after == reference, "the server goes on serving"
    assert "still lent to a KV transfer" in server_log(tmp_path, prefill)
