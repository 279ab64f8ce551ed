"""`kvfence audit`'s prefix-cache probe and its report: the verdict rules on fixed samples, and
end to end against real servers with and without a prefix cache shared across tenants."""

import random
import xml.etree.ElementTree as ET

from helpers import TENANT_KEYS, run_audit, start_tenant_server, stop_server
from kvfence.audit.auditor import Auditor
from kvfence.audit.cache_probe import (
    LOOKS,
    MIN_TRIALS,
    NEGATIVE_TRIALS,
    CacheTest,
    Calibration,
)
from kvfence.audit.report import Finding, Report, junit_xml

KEY_ARGS = [a for k in TENANT_KEYS for a in ("--api-key", k)]
CALIBRATION = Calibration(noise_s=0.002, per_word_s=0.0005, words=100, expected_gap_s=0.05)


def samples(rng, centre, n, spread=0.002):
    return [centre + rng.gauss(0, spread) for _ in range(n)]


def test_cache_verdicts_follow_the_samples():
    rng = random.Random(0)
    shared = CacheTest(0, 1, alpha=0.005)
    shared.hit_s, shared.miss_s = samples(rng, 0.05, 7), samples(rng, 0.10, 7)
    assert not shared.decide(CALIBRATION, final=False), "no verdict before MIN_TRIALS"
    shared.hit_s.append(0.05)
    shared.miss_s.append(0.10)
    assert shared.decide(CALIBRATION, final=False) and shared.verdict == "shared"
    assert shared.p_value < 0.005 / len(LOOKS) and shared.statistic == 1.0
    shared.hit_s.append(0.05)
    shared.miss_s.append(0.10)
    assert not shared.decide(CALIBRATION, final=False), "the test runs at the looks only"

    fresh = CacheTest(0, 1, alpha=0.005)
    fresh.hit_s, fresh.miss_s = samples(rng, 0.10, MIN_TRIALS), samples(rng, 0.10, MIN_TRIALS)
    assert not fresh.decide(CALIBRATION, final=False), "too few trials to call it not shared"
    assert fresh.decide(CALIBRATION, final=True) is False and fresh.verdict == "inconclusive"
    fresh.hit_s += samples(rng, 0.10, NEGATIVE_TRIALS - MIN_TRIALS)
    fresh.miss_s += samples(rng, 0.10, NEGATIVE_TRIALS - MIN_TRIALS)
    assert fresh.decide(CALIBRATION, final=False) and fresh.verdict == "not shared"

    # a speed-up lost in noise is neither proof of a cache nor of its absence
    small = CacheTest(0, 1, alpha=1e-6)
    small.hit_s, small.miss_s = samples(rng, 0.07, 30, 0.04), samples(rng, 0.10, 30, 0.04)
    assert not small.decide(CALIBRATION, final=True) and small.verdict == "inconclusive"
    assert "budget spent" in small.reason


def test_stopping_at_the_first_decisive_look_keeps_false_positives_under_alpha():
    """Without a cache, hits and misses come from one distribution: the whole procedure, trial
    pairs until decisive, calls it "shared" at most alpha of the time. A test after every
    trial pair would do so about twice as often."""
    rng = random.Random(1)
    runs, false_positives = 2000, 0
    for _ in range(runs):
        test = CacheTest(0, 1, alpha=0.01)
        while not test.decide(CALIBRATION, final=False):
            test.hit_s += samples(rng, 0.10, 1)
            test.miss_s += samples(rng, 0.10, 1)
        false_positives += test.verdict == "shared"
    assert false_positives <= 0.01 * runs, false_positives


def test_a_200_is_a_policy_only_where_the_whole_answer_fits_the_context_and_the_pool():
    def policy(n, limit, pool, completion, exact=True):
        usage = {"prompt_tokens": n, "completion_tokens": completion}
        return Auditor.boundary_policy(n, limit, pool, usage, "some text", exact)

    # a server that shortens max_tokens to what its context has room for
    assert "shortened to 15" in policy(2033, 2048, None, 15)
    assert policy(2033, 2048, None, 16) is None, "it read past its context"
    # the incident's prompts fit the context but not the pool: a 200 means KV never held,
    # however few tokens the answer has (the model may stop early on stale KV)
    assert policy(1025, 2048, 1024, 3) is None
    assert policy(1023, 2048, 1024, 2) is None
    assert "shortened to 1" in policy(1023, 2048, 1024, 1)
    assert policy(2024, 2048, 1024, 0) is None
    assert policy(2024, 2048, 4096, 8) is not None, "a pool larger than the context is no bound"
    assert policy(2033, 2048, None, 15, exact=False) is None, "the prompt's size is not known"


def test_report_exit_codes_and_junit():
    report = Report("http://x", passed=["boundary"], inconclusive=["cross-key prefix cache"])
    assert report.verdict == "inconclusive"
    assert report.exit_code(strict=False) == 0 and report.exit_code(strict=True) == 1
    suite = ET.fromstring(junit_xml(report))
    assert suite.get("tests") == "2" and suite.get("skipped") == "1"
    report.findings.append(Finding("cross-key-cache", "one cache", {"p_value": 1e-5}))
    assert report.exit_code(strict=False) == 1
    suite = ET.fromstring(junit_xml(report))
    failure = suite.find("testcase/failure")
    assert suite.get("failures") == "1" and failure.get("type") == "cross-key-cache"
    assert "p_value: 1e-05" in failure.text
    assert "leak class: shared-prefix-cache" in failure.text


def test_no_visible_cache_is_inconclusive_never_clean(tmp_path):
    """Without a prefix cache the positive control sees none, so the cross-key test cannot
    say "not shared": it is inconclusive, which --strict turns into exit 1."""
    proc, base = start_tenant_server(tmp_path, "--no-prefix-cache")
    junit = tmp_path / "audit.xml"
    try:
        args = ["--checks", "cache", "--cache-min-tokens", "128", "--junit-xml", str(junit)]
        code, report = run_audit(base, *KEY_ARGS, *args, "--strict")
    finally:
        stop_server(proc)
    assert code == 1 and report["verdict"] == "inconclusive" and not report["findings"], report
    (control,) = report["cache"]
    assert control["verdict"] == "not shared" and control["attacker_key"] == 1
    assert control["max_cached_tokens"] == 0, "kvfence reports cached tokens, none here"
    (cross,) = [t for t in report["inconclusive"] if t.startswith("cross-key prefix cache")]
    assert "no cache visible" in cross
    skipped = ET.parse(junit).getroot().findall("testcase/skipped")
    assert [s.get("message") for s in skipped] == [f"inconclusive: {cross}"]


def test_a_request_dropped_before_any_answer_goes_again_once():
    """A server that closes a connection as a request arrives on it (a keep-alive running out
    at that moment) is no finding: the audit sends that request once more, and only a second
    drop is recorded."""
    import asyncio

    from kvfence.audit.client import AuditClient, Exchange

    answer = (
        b"HTTP/1.1 200 OK\r\ncontent-type: text/event-stream\r\nconnection: close\r\n\r\n"
        b'data: {"choices": [{"text": "hi"}]}\n\ndata: [DONE]\n\n'
    )

    async def run(drops: int) -> Exchange:
        seen = []

        async def handle(reader, writer):
            await reader.readuntil(b"\r\n\r\n")
            seen.append(1)
            if len(seen) > drops:
                writer.write(answer)
                await writer.drain()
            writer.close()

        server = await asyncio.start_server(handle, "127.0.0.1", 0)
        port = server.sockets[0].getsockname()[1]
        client = AuditClient(f"http://127.0.0.1:{port}", [None], 1, 10)
        async with server:
            ex = await client.send(Exchange("t", "p", 0), "/v1/completions", {"prompt": "p"})
        await client.http.aclose()
        return ex

    once = asyncio.run(run(drops=1))
    assert once.status == 200 and once.text == "hi" and once.error is None
    twice = asyncio.run(run(drops=2))
    assert twice.status == 0 and twice.error
