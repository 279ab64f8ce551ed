"""One request fails only itself: extreme sampling parameters, and errors in one request's
sampling or token handling, never fail the other requests of its step (nor anyone's over HTTP)."""

import asyncio
import json
import math
import random

import httpx
import pytest

from helpers import TENANT_KEYS, assert_pool_empty, start_server, stop_server
from kvfence import SamplingParams
from kvfence.config import EngineConfig
from kvfence.engine import output, sampler
from kvfence.engine.llm_engine import LLMEngine
from kvfence.engine.request import RequestState
from kvfence.engine.sampling_params import InvalidRequest
from kvfence.kv import prefix_cache

ALICE, BOB = list(TENANT_KEYS)
MODEL = "tiny"
NORMAL = dict(temperature=0, max_tokens=8, ignore_eos=True)


def tiny_engine(path):
    config = EngineConfig(
        model=str(path),
        page_size=4,
        num_kv_pages=512,
        max_model_len=128,
        max_num_batched_tokens=256,
        max_num_seqs=64,
        num_threads=1,
    )
    return LLMEngine(config, progress=False)


def run_all(engine) -> dict:
    """Steps until nothing is left; returns each finished (request id, index)'s output."""
    finished = {}
    while engine.has_unfinished():
        for out in engine.step():
            if out.finished:
                finished[(out.request_id, out.index)] = out
    return finished


# Per field: values at or near the bounds that must be served, and values past them (or that
# float32 flushes to zero) that must be refused.
SERVED = dict(
    temperature=[0.0, 1e-46, 1e-6, 1e-5, 0.3, 1.0, 2.0],
    top_p=[1.0, 0.9, 1e-3, 1.2e-38, 1e-30],
    top_k=[-1, 0, 1, 2, 40, 49151, 49152, 10**9],
    min_p=[0.0, 1e-30, 0.5, 1.0],
    presence_penalty=[-2.0, 0.0, 1e-30, 2.0],
    frequency_penalty=[-2.0, 0.0, 1.5, 2.0],
    repetition_penalty=[0.01, 0.5, 1.0, 2.0],
    seed=[None, 0, 2**63 - 1],
    n=[1, 2, 16],
    stop=[[], ["a"], [" the", "\n", "."], ["x" * 256], ["s"] * 16],
    logprobs=[None, 0, 5, 20],
    max_tokens=[1, 2, 3],
    logit_bias=[0, 1, 50, 300],  # how many tokens, each biased by -100, 5.5 or 100
)
REFUSED = dict(
    temperature=[-0.1, 2.5, math.nan],
    top_p=[1e-38, 1e-40, 1e-45, 1e-46, 0.0, 1.5, math.nan],
    top_k=[-2],
    min_p=[1e-46, 1.1, math.nan],
    presence_penalty=[-1e-46, 1e-40, 2.1],
    frequency_penalty=[1e-45, -2.5],
    repetition_penalty=[0.001, 2.5],
    seed=[2**63, -1],
    n=[17, 0],
    stop=[["y" * 257], ["s"] * 17, [""]],
    logprobs=[21, -1],
    max_tokens=[0],
    logit_bias=[301],
)


PAST_BOUNDS = [(name, value) for name, values in REFUSED.items() for value in values]


def extreme_params(rng: random.Random, vocab: int) -> tuple[dict, set[str]]:
    """Sampling parameters among the bounds, with none, one or two values past them (each
    refused value as likely as any other); returns them and the fields past the bounds."""
    params = {name: rng.choice(values) for name, values in SERVED.items()}
    past = dict(rng.sample(PAST_BOUNDS, rng.choice([0, 1, 1, 2])))
    params.update(past)
    refused = set(past)
    biased = rng.sample(range(vocab), params["logit_bias"])
    params["logit_bias"] = {t: rng.choice([-100.0, 5.5, 100.0]) for t in biased}
    if "logit_bias" not in refused and rng.random() < 0.1:
        params["logit_bias"][biased[0] if biased else 0] = rng.choice([1e-46, 100.5])
        refused.add("logit_bias")
    params["ignore_eos"] = rng.random() < 0.5
    return params, refused


@pytest.fixture(scope="module")
def engine(tiny_llama_dir):
    return tiny_engine(tiny_llama_dir)


def test_extreme_sampling_parameters_are_refused_or_served_beside_another_tenant(
    engine,
):
    """Several hundred random combinations, all in flight with another tenant's requests: each
    one is refused at admission (a 400) or served; none fails in the engine, and the other
    tenant's answers are what they are alone."""
    vocab = engine.model_config.vocab_size
    prompts = [[5 + i, 17, 300 + 7 * i, 42, 99] for i in range(8)]
    alone = [run_all_one(engine, prompt) for prompt in prompts]
    rng = random.Random(0)
    refused = served = 0
    for batch in range(16):
        others = [engine.add_request(p, SamplingParams(**NORMAL), tenant="bob")[0] for p in prompts]
        for i in range(40):
            params, past_bounds = extreme_params(rng, vocab)
            try:
                prompt = [3, 1 + i, 500 + batch]
                engine.add_request(prompt, SamplingParams(**params), tenant="alice")
                served += 1
            except InvalidRequest as e:
                assert e.param in past_bounds, (e.param, params)
                refused += 1
                continue
            assert not past_bounds, params
        done = run_all(engine)
        failed = [out for out in done.values() if out.finish_reason not in ("stop", "length")]
        assert not failed, failed[0]
        assert [done[(r.parent_id, 0)].token_ids for r in others] == alone
    assert refused > 50 and served > 50  # both sides of the bounds were exercised
    assert_pool_empty(engine)


def run_all_one(engine, prompt) -> list[int]:
    (req,) = engine.add_request(prompt, SamplingParams(**NORMAL), tenant="bob")
    return run_all(engine)[(req.parent_id, 0)].token_ids


def fail_detokenizing(victim, monkeypatch):
    def broken(token):
        raise UnicodeDecodeError("utf-8", b"\xff", 0, 1, "a token this request cannot decode")

    monkeypatch.setattr(victim.detokenizer, "add", broken)


def fail_sampling(victim, monkeypatch):
    adjust = sampler.adjust_logits

    def broken(logits, req):
        if req is victim:
            raise IndexError("a logits processor failed on this request")
        return adjust(logits, req)

    monkeypatch.setattr(sampler, "adjust_logits", broken)


def fail_stop_check(victim, monkeypatch):
    check = output.hit_stop_string

    def broken(req):
        if req is victim:
            raise RuntimeError("a stop check failed on this request")
        return check(req)

    monkeypatch.setattr(output, "hit_stop_string", broken)


@pytest.mark.parametrize("break_victim", [fail_detokenizing, fail_sampling, fail_stop_check])
def test_an_error_in_one_requests_step_fails_that_request_only(
    tiny_llama_dir, break_victim, monkeypatch
):
    engine = tiny_engine(tiny_llama_dir)
    seeded = SamplingParams(
        temperature=0.8,
        seed=3,
        max_tokens=8,
        ignore_eos=True,
        logit_bias={7: 2.0},
        stop=["zz"],
    )
    params = [SamplingParams(**NORMAL), seeded]
    prompts = [[11, 12, 13], [21, 22, 23, 24], [31, 32]]
    clean = {}
    for prompt in prompts:
        for p in params:
            (req,) = engine.add_request(prompt, p)
            clean[tuple(prompt), p.temperature] = run_all(engine)[(req.parent_id, 0)].token_ids
    reqs = [(prompt, p, engine.add_request(prompt, p)[0]) for prompt in prompts for p in params]
    engine.step()  # every request prefilled and sampled its first token
    victim = reqs[3][2]
    break_victim(victim, monkeypatch)
    done = run_all(engine)
    assert victim.state == RequestState.FAILED and "internal error" in victim.error
    assert done[(victim.parent_id, 0)].finish_reason == "error"
    for prompt, p, req in reqs:
        if req is not victim:
            assert done[(req.parent_id, 0)].token_ids == clean[tuple(prompt), p.temperature]
    assert engine.stats["failed"] == 1
    assert_pool_empty(engine)


KEYS = prefix_cache.page_keys


def keys_without_tenant(tenant, *rest):
    """A keying regression: every tenant's prompt gets the same keys."""
    return KEYS("", *rest)


def test_a_page_another_tenant_cached_fails_the_request_reading_it(tiny_llama_dir, monkeypatch):
    """A regression in the prefix cache's keying (the tenant left out of the key) hands bob
    the pages alice cached: every other record of those pages looks right, the sentinel still
    fails bob's request, and alice's requests go on."""
    monkeypatch.setattr(prefix_cache, "page_keys", keys_without_tenant)
    engine = tiny_engine(tiny_llama_dir)
    prompt = list(range(40, 70))
    (first,) = engine.add_request(prompt, SamplingParams(**NORMAL), tenant="alice")
    expected = run_all(engine)[(first.parent_id, 0)].token_ids
    (bob,) = engine.add_request(prompt, SamplingParams(**NORMAL), tenant="bob")
    (alice,) = engine.add_request(prompt, SamplingParams(**NORMAL), tenant="alice")
    done = run_all(engine)
    assert bob.num_cached_tokens > 0, "the broken keys gave bob alice's pages"
    out = done[(bob.parent_id, 0)]
    assert out.finish_reason == "error" and "KV ownership check failed" in out.error
    assert "another tenant" in out.error
    assert out.token_ids == []
    assert alice.num_cached_tokens > 0 and done[(alice.parent_id, 0)].token_ids == expected
    assert_pool_empty(engine)


def test_a_cached_page_read_without_a_reference_fails_the_request(tiny_llama_dir):
    """A page of alice's prefix cache copied into another of her requests' block table, with
    its generation, by a bug rather than a lookup: the page is referenced (by its holder), but
    not by this request."""
    engine = tiny_engine(tiny_llama_dir)
    params = SamplingParams(temperature=0, max_tokens=12, ignore_eos=True)
    (holder,) = engine.add_request(list(range(40, 70)), params, tenant="alice")
    (copier,) = engine.add_request(list(range(80, 110)), params, tenant="alice")
    engine.step()
    assert holder.num_shared_pages > 0 and copier.num_shared_pages > 0
    copier.block_table[0] = holder.block_table[0]
    copier.page_generations[0] = holder.page_generations[0]
    produced = len(copier.output_token_ids)
    done = run_all(engine)
    out = done[(copier.parent_id, 0)]
    assert out.finish_reason == "error" and "without references" in out.error
    assert len(out.token_ids) == produced, "no token was produced after the copy"
    assert done[(holder.parent_id, 0)].finish_reason == "length"
    assert_pool_empty(engine)


# --- over HTTP, against a real server ---------------------------------------------------


@pytest.fixture(scope="module")
def server(tmp_path_factory, tiny_llama_dir):
    tmp = tmp_path_factory.mktemp("robust-server")
    keys = tmp / "keys.json"
    keys.write_text(json.dumps(TENANT_KEYS))
    proc, base = start_server(
        tmp,
        "serve",
        "--model",
        str(tiny_llama_dir),
        "--served-model-name",
        MODEL,
        "--api-keys",
        str(keys),
        "--max-model-len",
        "256",
        "--num-kv-pages",
        "256",
        "--max-pending",
        "4096",
        "--threads",
        "1",
    )
    yield base
    stop_server(proc)


async def complete(client: httpx.AsyncClient, base: str, key: str, **body) -> httpx.Response:
    """POSTs a completion; NaN goes out as JSON's common extension, the literal NaN."""
    headers = {"Authorization": f"Bearer {key}", "Content-Type": "application/json"}
    body = {"model": MODEL, "prompt": "Once upon a time", **body}
    return await client.post(base + "/v1/completions", headers=headers, content=json.dumps(body))


def test_top_p_that_float32_flushes_to_zero_is_refused_and_fails_no_one(server):
    """The attack: one completion with top_p=1e-46 (0 in float32) beside eight of another
    tenant's. It gets a 400 naming top_p; the eight, and the requests after, are served."""

    async def attack():
        async with httpx.AsyncClient(timeout=120) as client:
            normal = [
                asyncio.create_task(
                    complete(
                        client,
                        server,
                        BOB,
                        prompt=f"Story {i}:",
                        max_tokens=48,
                        ignore_eos=True,
                    )
                )
                for i in range(8)
            ]
            await asyncio.sleep(0.05)  # the eight are decoding
            bad = await complete(client, server, ALICE, top_p=1e-46, max_tokens=4)
            normal = await asyncio.gather(*normal)
            return bad, normal, await complete(client, server, ALICE, max_tokens=4)

    bad, normal, after = asyncio.run(attack())
    assert bad.status_code == 400, bad.text
    assert bad.json()["error"]["param"] == "top_p"
    assert bad.json()["error"]["type"] == "invalid_request_error"
    assert [r.status_code for r in normal] == [200] * 8, [r.text for r in normal]
    assert all(r.json()["usage"]["completion_tokens"] == 48 for r in normal)
    assert after.status_code == 200


def http_body(params: dict) -> dict:
    """The OpenAI form of SamplingParams' fields: logit_bias keys are strings in JSON."""
    return {
        **params,
        "logit_bias": {str(t): b for t, b in params["logit_bias"].items()},
    }


def test_extreme_parameters_over_http_get_200_or_400_never_500(server, tokenizer):
    """The same fuzz through the API, beside another tenant's eight requests: 200 or an
    OpenAI 400 error for each, and the eight are served."""
    rng = random.Random(1)
    bodies = [http_body(extreme_params(rng, len(tokenizer))[0]) for _ in range(400)]

    async def fuzz():
        async with httpx.AsyncClient(timeout=120) as client:
            normal = [
                asyncio.create_task(
                    complete(
                        client,
                        server,
                        BOB,
                        prompt=f"Note {i}:",
                        max_tokens=24,
                        ignore_eos=True,
                        temperature=0,
                    )
                )
                for i in range(8)
            ]
            fuzzed = await asyncio.gather(*(complete(client, server, ALICE, **b) for b in bodies))
            return fuzzed, await asyncio.gather(*normal)

    fuzzed, normal = asyncio.run(fuzz())
    unexpected = [r.text for r in fuzzed if r.status_code not in (200, 400)]
    assert not unexpected, unexpected[0]
    errors = [r.json()["error"] for r in fuzzed if r.status_code == 400]
    assert all(set(e) == {"message", "type", "param", "code"} for e in errors)
    assert 0 < len(errors) < len(fuzzed)
    assert [r.status_code for r in normal] == [200] * 8
