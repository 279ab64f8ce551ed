"""Tenants' share of the engine: fair scheduling on the engine's step trace, not wall time."""

from collections import Counter

import pytest

from kvfence.config import EngineConfig
from kvfence.engine.llm_engine import LLMEngine
from kvfence.engine.sampling_params import SamplingParams
from kvfence.engine.scheduler import PRESENT_S, Share


def engine_for(tiny_llama_dir, scheduling="fair", **cfg):
    config = dict(
        page_size=8,
        num_kv_pages=512,
        max_model_len=256,
        max_num_seqs=16,
        max_num_batched_tokens=64,
    )
    return LLMEngine(
        EngineConfig(model=str(tiny_llama_dir), scheduling=scheduling, **{**config, **cfg}),
        progress=False,
    )


def traced(engine):
    """Records each step's batch as (tenant, tokens) pairs."""
    trace, schedule = [], engine.scheduler.schedule

    def schedule_and_record():
        batch = schedule()
        trace.append([(req.tenant, n) for req, n in batch])
        return batch

    engine.scheduler.schedule = schedule_and_record
    return trace


def add(engine, tenant, count, prompt_len, max_tokens, start=0):
    params = SamplingParams(temperature=0, max_tokens=max_tokens, ignore_eos=True)
    for i in range(count):
        engine.add_request(
            [1 + (start + i + j) % 500 for j in range(prompt_len)],
            params,
            request_id=f"{tenant}-{start + i}",
            tenant=tenant,
        )


def served_in_steps(engine, trace, steps: int) -> Counter:
    """Tokens computed for each tenant in the engine's next `steps` steps."""
    start = len(trace)
    for _ in range(steps):
        engine.step()
    served = Counter()
    for batch in trace[start:]:
        for tenant, n in batch:
            served[tenant] += n
    return served


def first_step_of(trace, tenant) -> int:
    return next(i for i, batch in enumerate(trace) if any(t == tenant for t, _ in batch))


@pytest.mark.parametrize("scheduling", ["fair", "fifo"])
def test_a_flood_delays_another_tenant_only_under_fifo(tiny_llama_dir, scheduling):
    engine = engine_for(tiny_llama_dir, scheduling)
    trace = traced(engine)
    add(engine, "flood", 64, prompt_len=120, max_tokens=16)
    for _ in range(5):
        engine.step()
    add(engine, "short", 1, prompt_len=6, max_tokens=2)
    while engine.has_unfinished() and "short" in {r.tenant for r in engine.scheduler.waiting}:
        engine.step()
    waited = first_step_of(trace, "short") - 5
    if scheduling == "fair":
        assert waited == 0  # admitted in the very step after it arrived
    else:
        assert waited > 50  # behind every flood request before it
    while engine.has_unfinished():
        engine.step()


def phases(engine):
    """Records each step's batch as (tenant, tokens, decoding) triples."""
    trace, schedule = [], engine.scheduler.schedule

    def schedule_and_record():
        batch = schedule()
        trace.append(
            [(r.tenant, n, r.num_computed_tokens >= len(r.prompt_token_ids)) for r, n in batch]
        )
        return batch

    engine.scheduler.schedule = schedule_and_record
    return trace


def split(step) -> tuple[int, int]:
    """(decode tokens, prefill tokens) of one recorded step."""
    decodes = sum(n for _, n, decoding in step if decoding)
    return decodes, sum(n for _, n, _ in step) - decodes


def test_a_newcomer_gets_a_step_of_its_own_and_the_others_wait_one_step_at_most(
    tiny_llama_dir,
):
    """A request of a tenant with nothing running waits for the step in progress and for
    one short step of its own; the running requests' decodes skip that step, never two in
    a row."""
    engine = engine_for(tiny_llama_dir, max_num_seqs=32)
    trace = phases(engine)
    add(engine, "flood", 32, prompt_len=100, max_tokens=60)
    for _ in range(30):
        engine.step()
    decoding = split(trace[-1])[0]
    assert decoding >= engine.scheduler.newcomer_min_decodes  # they would hold a newcomer back
    add(engine, "chat", 1, prompt_len=6, max_tokens=3)
    before = engine.scheduler.counters["chat"]
    engine.step()
    assert trace[-1] == [("chat", 6, False)]
    assert engine.scheduler.counters["chat"] >= before + 6 + decoding  # charged what it held
    add(engine, "late", 1, prompt_len=6, max_tokens=3)
    engine.step()  # the flood decodes again; the late newcomer comes in with it
    tenants = Counter(t for t, _, decoding in trace[-1] if decoding)
    assert tenants["flood"] >= decoding and ("late", 6, False) in trace[-1]
    for rid in list(engine.requests):
        engine.abort(rid)


def test_tiny_requests_cannot_buy_steps_of_their_own_cheaply(tiny_llama_dir):
    """A tenant that always has nothing running (one-token requests, one after another) gets
    a step of its own only while the decodes it holds back are many, is charged for them, and
    never gets two in a row; while few decode, every step carries them."""
    engine = engine_for(tiny_llama_dir, max_num_seqs=32)
    trace = phases(engine)
    add(engine, "flood", 32, prompt_len=100, max_tokens=150)
    for _ in range(30):
        engine.step()
    start, counter = len(trace), engine.scheduler.counters["tiny"]
    held = 0
    for i in range(30):
        add(engine, "tiny", 1, prompt_len=1, max_tokens=1, start=i)
        decoding = sum(r.num_uncomputed_tokens <= 1 for r in engine.scheduler.running)
        engine.step()
        if trace[-1] == [("tiny", 1, False)]:
            assert decoding >= engine.scheduler.newcomer_min_decodes
            held += decoding
    decoded = [any(t == "flood" and decoding for t, _, decoding in step) for step in trace[start:]]
    assert held and "False, False" not in str(decoded)
    assert engine.scheduler.counters["tiny"] - counter >= held
    for rid in list(engine.requests):
        engine.abort(rid)
    engine = engine_for(tiny_llama_dir, max_num_seqs=32)
    trace = phases(engine)
    add(engine, "flood", engine.scheduler.newcomer_min_decodes - 1, prompt_len=100, max_tokens=150)
    for _ in range(10):
        engine.step()
    start = len(trace)
    for i in range(10):
        add(engine, "tiny", 1, prompt_len=1, max_tokens=1, start=i)
        engine.step()
    assert all(any(t == "flood" for t, _, _ in step) for step in trace[start:])
    for rid in list(engine.requests):
        engine.abort(rid)


def test_while_another_tenant_is_present_a_step_prefills_at_most_its_decodes(tiny_llama_dir):
    """So that the step in progress when a request arrives is short; once the other tenant
    has been gone PRESENT_S seconds, the flood has the whole budget again."""
    now = [0.0]
    engine = engine_for(tiny_llama_dir, max_num_seqs=64)
    engine.scheduler.clock = lambda: now[0]
    trace = phases(engine)
    add(engine, "flood", 48, prompt_len=200, max_tokens=30)
    add(engine, "chat", 1, prompt_len=6, max_tokens=2)
    for _ in range(40):
        engine.step()
    assert not any(r.tenant == "chat" for r in engine.scheduler.running)
    short = engine.scheduler.max_num_batched_tokens // 8
    assert all(split(step)[1] <= max(split(step)[0], short) for step in trace), [
        split(step) for step in trace
    ]
    assert any(split(step)[1] > 0 for step in trace[-10:])  # the flood's prefill goes on
    now[0] = PRESENT_S + 1
    start = len(trace)
    for _ in range(5):
        engine.step()
    assert any(split(step)[1] > max(split(step)[0], short) for step in trace[start:])
    for rid in list(engine.requests):
        engine.abort(rid)


def test_weights_give_proportional_service(tiny_llama_dir):
    engine = engine_for(tiny_llama_dir, max_num_seqs=64)
    engine.scheduler.shares = {"heavy": Share(weight=2.0)}
    trace = traced(engine)
    add(engine, "heavy", 24, prompt_len=200, max_tokens=1)
    add(engine, "light", 24, prompt_len=200, max_tokens=1)
    for _ in range(60):
        engine.step()
    served = Counter()
    for batch in trace:
        for tenant, n in batch:
            served[tenant] += n
    assert 1.8 <= served["heavy"] / served["light"] <= 2.2, served
    for rid in list(engine.requests):
        engine.abort(rid)


def test_an_idle_tenant_banks_no_service(tiny_llama_dir):
    """A tenant back from idleness starts at the lowest active counter: it shares the budget
    with the one that kept working instead of taking all of it until it catches up."""
    engine = engine_for(tiny_llama_dir, max_num_seqs=64)
    trace = traced(engine)
    add(engine, "steady", 40, prompt_len=200, max_tokens=1)
    add(engine, "returning", 1, prompt_len=16, max_tokens=1)
    for _ in range(60):  # "returning" finishes early, then idles while "steady" works on
        engine.step()
    assert not any(
        r.tenant == "returning" for r in [*engine.scheduler.waiting, *engine.scheduler.running]
    )
    add(engine, "returning", 20, prompt_len=200, max_tokens=1, start=1)
    served = served_in_steps(engine, trace, 20)
    assert 0.4 <= served["returning"] / sum(served.values()) <= 0.6, served
    for rid in list(engine.requests):
        engine.abort(rid)


def test_one_tenant_is_scheduled_as_under_fifo(tiny_llama_dir):
    traces = []
    for scheduling in ("fair", "fifo"):
        engine = engine_for(tiny_llama_dir, scheduling, num_kv_pages=40)
        trace = traced(engine)
        add(engine, "only", 12, prompt_len=70, max_tokens=12)
        while engine.has_unfinished():
            engine.step()
        traces.append((trace, engine.scheduler.num_preemptions))
    assert traces[0] == traces[1] and traces[0][1] > 0  # preemptions included


def test_the_tenant_most_over_its_share_is_preempted_first(tiny_llama_dir):
    engine = engine_for(tiny_llama_dir, num_kv_pages=24, max_model_len=128)
    engine.scheduler.counters["ahead"] = 1e6  # has had far more than its share
    add(engine, "ahead", 2, prompt_len=40, max_tokens=60)
    add(engine, "behind", 2, prompt_len=40, max_tokens=60, start=2)
    while not engine.scheduler.num_preemptions:
        engine.step()
    preempted = [r for r in engine.scheduler.waiting if r.num_preemptions]
    assert preempted and all(r.tenant == "ahead" for r in preempted)
    for rid in list(engine.requests):
        engine.abort(rid)


def test_a_tenant_runs_at_most_its_concurrency(tiny_llama_dir):
    engine = engine_for(tiny_llama_dir)
    engine.scheduler.shares = {"capped": Share(max_running=3)}
    add(engine, "capped", 8, prompt_len=10, max_tokens=20)
    add(engine, "free", 8, prompt_len=10, max_tokens=20, start=8)
    most = Counter()
    while engine.has_unfinished():
        engine.step()
        running = Counter(r.tenant for r in engine.scheduler.running)
        most = most | running
    assert most["capped"] == 3 and most["free"] == 8


# --- limits and per-tenant metrics, over HTTP ------------------------------------------

KEYS = {
    "sk-alice-quota-0001": {"tenant": "alice", "max_tokens_per_minute": 100},
    "sk-bob-free-00000001": "bob",
    "sk-carol-conc-000001": {
        "tenant": "carol",
        "max_concurrent_requests": 1,
        "max_queued_requests": 1,
    },
    "sk-ops-admin-000001": {"tenant": "ops", "admin": True},
}
ALICE, BOB, CAROL, OPS = KEYS


@pytest.fixture(scope="module")
def limited_server(tmp_path_factory):
    import json

    from helpers import start_server, stop_server

    tmp = tmp_path_factory.mktemp("limited")
    (tmp / "keys.json").write_text(json.dumps(KEYS))
    proc, base = start_server(
        tmp,
        "serve",
        "--api-keys",
        str(tmp / "keys.json"),
        "--threads",
        "1",
        "--max-model-len",
        "512",
        "--num-kv-pages",
        "128",
    )
    yield base
    stop_server(proc)


def complete(base, key, **body):
    import httpx

    body = {
        "model": "SmolLM2-135M-Instruct.Q4_1",
        "prompt": list(range(100, 110)),
        "max_tokens": 15,
        "temperature": 0,
        "ignore_eos": True,
        **body,
    }
    return httpx.post(
        base + "/v1/completions",
        json=body,
        headers={"Authorization": f"Bearer {key}"},
        timeout=120,
    )


def test_tokens_per_minute_refuse_exactly_at_the_limit(limited_server):
    answers = [complete(limited_server, ALICE) for _ in range(5)]  # 10 + 15 tokens each, limit 100
    assert [r.status_code for r in answers] == [200, 200, 200, 200, 429]
    refused = answers[-1]
    assert refused.json()["error"]["code"] == "rate_limit_exceeded"
    assert 1 <= int(refused.headers["retry-after"]) <= 60
    assert complete(limited_server, BOB).status_code == 200  # other tenants see nothing


def test_sequences_in_flight_refuse_over_concurrency_plus_queue(limited_server):
    import httpx

    from helpers import wait_for_idle_pool

    body = {
        "model": "SmolLM2-135M-Instruct.Q4_1",
        "prompt": "Count:",
        "max_tokens": 400,
        "ignore_eos": True,
        "stream": True,
    }
    headers = {"Authorization": f"Bearer {CAROL}"}
    with httpx.stream(
        "POST",
        limited_server + "/v1/completions",
        json=body,
        headers=headers,
        timeout=120,
    ) as one:
        lines = one.iter_lines()  # kept: a dropped iterator closes the stream
        next(lines)
        with httpx.stream(
            "POST",
            limited_server + "/v1/completions",
            json=body,
            headers=headers,
            timeout=120,
        ) as two:
            assert two.status_code == 200
            third = complete(limited_server, CAROL)
            assert (
                third.status_code == 429 and third.json()["error"]["code"] == "rate_limit_exceeded"
            )
            assert complete(limited_server, BOB).status_code == 200
    wait_for_idle_pool(limited_server, key=OPS)
    assert complete(limited_server, CAROL).status_code == 200


def test_per_tenant_metrics_need_an_admin_key(limited_server):
    import httpx

    complete(limited_server, BOB)
    public = httpx.get(limited_server + "/metrics", headers={"Authorization": f"Bearer {BOB}"}).text
    assert "tenant" not in public and "bob" not in public
    # polled between requests, these would give another tenant's prompt length and cache hits
    for series in (
        "prompt_tokens_total",
        "prefix_cache_hit_tokens_total",
        "kv_pages_used",
        "kv_pages_evictable",
        "time_to_first_token_seconds_sum",
    ):
        assert f"kvfence_{series}" not in public
    assert "kvfence_requests_running" in public
    private = httpx.get(
        limited_server + "/metrics", headers={"Authorization": f"Bearer {OPS}"}
    ).text
    assert 'kvfence_tenant_requests_total{outcome="length",tenant="bob"}' in private
    assert 'kvfence_tenant_fair_share_counter{tenant="bob"}' in private
    assert 'kvfence_tenant_generation_tokens_total{tenant="bob"}' in private
    assert "kvfence_prefix_cache_hit_tokens_total" in private


def test_kv_usage_returns_to_idle_while_cached_pages_stay_evictable(limited_server):
    from helpers import metric, wait_for_idle_pool

    prompt = "A long shared preamble about the accounts of the quarter. " * 8
    assert complete(limited_server, BOB, prompt=prompt, max_tokens=2).status_code == 200
    wait_for_idle_pool(limited_server, key=OPS)
    assert metric(limited_server, "kvfence_kv_usage_ratio", OPS) == 0
    assert metric(limited_server, "kvfence_kv_pages_evictable", OPS) > 0


def test_quota_window_and_refunds():
    from kvfence.server.auth import ApiKeys, KeyEntry
    from kvfence.server.quotas import OverQuota, Quotas

    now = [0.0]
    quotas = Quotas(
        ApiKeys({"k": KeyEntry(tenant="t", max_tokens_per_minute=100)}),
        clock=lambda: now[0],
    )
    charge = quotas.charge("t", 1, 100)
    with pytest.raises(OverQuota):
        quotas.charge("t", 1, 1)
    quotas.refund(charge, 40)  # it stopped early: 60 used
    quotas.charge("t", 1, 40)
    with pytest.raises(OverQuota) as refused:
        quotas.charge("t", 1, 1)
    assert refused.value.retry_after == 60
    now[0] = 60.0  # the window has passed: back to zero
    quotas.charge("t", 1, 100)


def test_a_tenant_back_at_an_idle_moment_banks_no_service(tiny_llama_dir):
    """A tenant that joins an empty queue starts at the counter of the tenant whose request
    departed last (VTC), not at its own old one: it then shares the budget with that tenant
    instead of winning every admission until it catches up."""
    engine = engine_for(tiny_llama_dir, max_num_seqs=64)
    trace = traced(engine)
    add(engine, "busy", 12, prompt_len=100, max_tokens=1)
    add(engine, "returning", 1, prompt_len=16, max_tokens=1)
    while engine.has_unfinished():  # both done: the server is idle for a moment
        engine.step()
    add(engine, "returning", 20, prompt_len=100, max_tokens=1, start=1)
    add(engine, "busy", 20, prompt_len=100, max_tokens=1, start=12)
    served = served_in_steps(engine, trace, 20)
    assert 0.4 <= served["returning"] / sum(served.values()) <= 0.6, served
    for rid in list(engine.requests):
        engine.abort(rid)


def test_a_tenant_whose_own_request_left_last_is_lifted_to_those_running(tiny_llama_dir):
    """While another tenant's requests all run (none waiting), a tenant that joins the queue
    starts at that tenant's counter, even when its own request was the last to leave."""
    engine = engine_for(tiny_llama_dir, max_num_seqs=64)
    trace = traced(engine)
    add(engine, "steady", 4, prompt_len=100, max_tokens=120)
    add(engine, "trickle", 1, prompt_len=16, max_tokens=1)
    while engine.scheduler.waiting or any(r.tenant == "trickle" for r in engine.scheduler.running):
        engine.step()
    add(engine, "trickle", 20, prompt_len=100, max_tokens=1, start=1)
    add(engine, "steady", 20, prompt_len=100, max_tokens=1, start=4)
    served = served_in_steps(engine, trace, 20)
    assert 0.3 <= served["trickle"] / sum(served.values()) <= 0.6, served
    for rid in list(engine.requests):
        engine.abort(rid)
