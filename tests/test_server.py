"""The OpenAI API of a real `kvfence serve` process, through the official `openai` client."""

import asyncio
import json

import httpx
import openai
import pytest

from helpers import ADMIN_KEY, TENANT_KEYS, metric, wait_for_idle_pool

ALICE, BOB = list(TENANT_KEYS)
MODEL = "smollm2"
CAPITAL = [{"role": "user", "content": "What is the capital of France?"}]


def tokenize(server, text):
    r = httpx.post(
        server + "/tokenize",
        json={"prompt": text},
        headers={"Authorization": f"Bearer {ALICE}"},
    )
    return r.json()["tokens"]


def test_models_lists_the_context_length(client):
    (model,) = client.models.list().data
    assert model.id == MODEL and model.model_extra["max_model_len"] == 1024


def test_chat_completion(client):
    r = client.chat.completions.create(model=MODEL, messages=CAPITAL, temperature=0, max_tokens=20)
    assert r.choices[0].message.content == "The capital of France is Paris."
    assert r.choices[0].finish_reason == "stop"
    assert r.usage.completion_tokens == 8 and r.usage.total_tokens == r.usage.prompt_tokens + 8


def test_chat_streaming_matches_non_streaming(client):
    stream = client.chat.completions.create(
        model=MODEL,
        messages=CAPITAL,
        temperature=0,
        max_tokens=20,
        stream=True,
        stream_options={"include_usage": True},
    )
    chunks = list(stream)
    text = "".join(c.choices[0].delta.content or "" for c in chunks if c.choices)
    assert text == "The capital of France is Paris."
    assert [
        c.choices[0].finish_reason for c in chunks if c.choices and c.choices[0].finish_reason
    ] == ["stop"]
    assert chunks[-1].usage.completion_tokens == 8


def test_completion_usage_is_exact(client, server):
    prompt = "The three primary colours are"
    r = client.completions.create(
        model=MODEL, prompt=prompt, max_tokens=12, temperature=0, logprobs=2
    )
    assert r.usage.prompt_tokens == len(tokenize(server, prompt))
    assert r.usage.completion_tokens == len(r.choices[0].logprobs.tokens) == 12
    assert "".join(r.choices[0].logprobs.tokens) == r.choices[0].text
    assert all(len(top) == 2 for top in r.choices[0].logprobs.top_logprobs)


def test_completion_streaming_with_token_ids_prompt(client, server):
    ids = tokenize(server, "Once upon a time")
    full = client.completions.create(model=MODEL, prompt=ids, max_tokens=16, temperature=0)
    stream = client.completions.create(
        model=MODEL, prompt=ids, max_tokens=16, temperature=0, stream=True
    )
    assert "".join(c.choices[0].text for c in stream) == full.choices[0].text
    assert full.usage.prompt_tokens == len(ids)


def test_chat_logprobs(client):
    r = client.chat.completions.create(
        model=MODEL,
        messages=CAPITAL,
        temperature=0,
        max_tokens=5,
        logprobs=True,
        top_logprobs=3,
    )
    content = r.choices[0].logprobs.content
    assert len(content) == 5 and all(len(c.top_logprobs) == 3 for c in content)
    assert content[0].token == content[0].top_logprobs[0].token
    assert "".join(c.token for c in content) == r.choices[0].message.content


def test_stop_n_and_seed(client):
    r = client.completions.create(
        model=MODEL,
        prompt="Count: 1, 2, 3,",
        max_tokens=20,
        temperature=0,
        stop=[" 5,"],
    )
    assert (
        " 4," in r.choices[0].text
        and " 5," not in r.choices[0].text
        and r.choices[0].finish_reason == "stop"
    )
    a = client.completions.create(
        model=MODEL, prompt="A poem:", max_tokens=16, temperature=1.0, seed=11, n=3
    )
    b = client.completions.create(
        model=MODEL, prompt="A poem:", max_tokens=16, temperature=1.0, seed=11, n=3
    )
    assert [c.index for c in a.choices] == [0, 1, 2]
    assert [c.text for c in a.choices] == [c.text for c in b.choices]
    assert len({c.text for c in a.choices}) == 3
    assert a.usage.completion_tokens == 48


def test_logit_bias_through_the_openai_client(client, server):
    plain = client.completions.create(
        model=MODEL,
        prompt="The capital of France is",
        max_tokens=4,
        temperature=0,
        logprobs=1,
    )
    first = tokenize(server, plain.choices[0].logprobs.tokens[0])[0]
    banned = client.completions.create(
        model=MODEL,
        prompt="The capital of France is",
        max_tokens=4,
        temperature=0,
        logit_bias={str(first): -100},
    )
    assert banned.choices[0].text != plain.choices[0].text
    assert tokenize(server, banned.choices[0].text)[0] != first


def test_null_fields_take_their_defaults(server):
    """Clients that serialize unset fields send null: n, stream, echo and logprobs then keep
    their defaults (temperature: null samples at 1), and max_tokens: null means up to the
    context (here cut by a stop token)."""
    h = {"Authorization": f"Bearer {ALICE}"}
    nulls = {
        "n": None,
        "stream": None,
        "echo": None,
        "logprobs": None,
        "stop": None,
        "temperature": None,
        "ignore_eos": None,
        "logit_bias": None,
        "user": None,
        "stream_options": None,
    }
    r = httpx.post(
        server + "/v1/completions",
        headers=h,
        timeout=60,
        json={"model": MODEL, "prompt": "Count: 1, 2, 3,", "max_tokens": 3, **nulls},
    )
    assert r.status_code == 200, r.text
    assert len(r.json()["choices"]) == 1 and r.json()["usage"]["completion_tokens"] == 3
    r = httpx.post(
        server + "/v1/chat/completions",
        headers=h,
        timeout=60,
        json={
            "model": MODEL,
            "messages": CAPITAL,
            "max_tokens": None,
            "stop_token_ids": [2],
            **nulls,
            # greedy, so that the answer ends at the stop token on every CPU's rounding
            "temperature": 0,
        },
    )
    assert r.status_code == 200, r.text
    (choice,) = r.json()["choices"]
    assert choice["message"]["content"] == "The capital of France is Paris."
    assert choice["finish_reason"] == "stop" and choice["logprobs"] is None


def test_tokenize_detokenize_round_trip(server):
    h = {"Authorization": f"Bearer {ALICE}"}
    tokens = httpx.post(server + "/tokenize", json={"prompt": "héllo wörld"}, headers=h).json()[
        "tokens"
    ]
    assert (
        httpx.post(server + "/detokenize", json={"tokens": tokens}, headers=h).json()["prompt"]
        == "héllo wörld"
    )


def test_metrics_exposes_engine_and_latency_series(server, client):
    client.completions.create(model=MODEL, prompt="hi", max_tokens=2)
    public = httpx.get(server + "/metrics").text
    private = httpx.get(server + "/metrics", headers={"Authorization": f"Bearer {ADMIN_KEY}"}).text
    for name in (
        "kvfence_requests_running",
        "kvfence_requests_waiting",
        "kvfence_requests_rejected_total",
    ):
        assert name in public and name in private, name
    for name in (
        "kvfence_kv_usage_ratio",
        "kvfence_prompt_tokens_total",
        "kvfence_time_to_first_token_seconds_bucket",
        "kvfence_inter_token_latency_seconds_bucket",
        "kvfence_prefix_cache_hit_tokens_total",
    ):
        assert name in private and name not in public, name


# --- bad input -------------------------------------------------------------------------

LONG = "hello " * 1100
BAD_REQUESTS = [
    # (path, body or raw bytes, headers, status, code or param)
    ("/v1/completions", b'{"model": "smollm2", "prompt": ', None, 400, "invalid_json"),
    ("/v1/completions", b"\xff\xfe not utf-8", None, 400, "invalid_json"),
    (
        "/v1/completions",
        b'{"model": "smollm2", "prompt": "hi"}',
        {"Content-Type": "text/plain"},
        415,
        "unsupported_media_type",
    ),
    ("/v1/completions", b'["a list"]', None, 400, "invalid_json"),
    ("/v1/completions", {"prompt": "hi"}, None, 400, "model"),
    ("/v1/completions", {"model": "smollm2"}, None, 400, "prompt"),
    ("/v1/completions", {"model": "smollm2", "prompt": 12}, None, 400, "prompt"),
    (
        "/v1/completions",
        {"model": "smollm2", "prompt": "hi", "max_tokens": "ten"},
        None,
        400,
        "max_tokens",
    ),
    (
        "/v1/completions",
        {"model": "gpt-9", "prompt": "hi"},
        None,
        404,
        "model_not_found",
    ),
    ("/v1/completions", {"model": "smollm2", "prompt": ""}, None, 400, "prompt"),
    ("/v1/completions", {"model": "smollm2", "prompt": []}, None, 400, "prompt"),
    (
        "/v1/chat/completions",
        {"model": "smollm2", "messages": []},
        None,
        400,
        "messages",
    ),
    (
        "/v1/chat/completions",
        {"model": "smollm2", "messages": [{"role": "wizard", "content": "hi"}]},
        None,
        400,
        "messages.0.role",
    ),
    (
        "/v1/chat/completions",
        {"model": "smollm2", "messages": [{"content": "hi"}]},
        None,
        400,
        "messages.0.role",
    ),
    (
        "/v1/completions",
        {"model": "smollm2", "prompt": LONG},
        None,
        400,
        "context_length_exceeded",
    ),
    (
        "/v1/completions",
        {"model": "smollm2", "prompt": "hi " * 500, "max_tokens": 600},
        None,
        400,
        "context_length_exceeded",
    ),
    (
        "/v1/completions",
        {"model": "smollm2", "prompt": "hi", "max_tokens": 0},
        None,
        400,
        "max_tokens",
    ),
    (
        "/v1/completions",
        {"model": "smollm2", "prompt": "hi", "max_tokens": -1},
        None,
        400,
        "max_tokens",
    ),
    (
        "/v1/completions",
        {"model": "smollm2", "prompt": "hi", "max_tokens": 10**12},
        None,
        400,
        "context_length_exceeded",
    ),
    (
        "/v1/completions",
        {"model": "smollm2", "prompt": "hi", "temperature": 3},
        None,
        400,
        "temperature",
    ),
    (
        "/v1/completions",
        {"model": "smollm2", "prompt": "hi", "temperature": "hot"},
        None,
        400,
        "temperature",
    ),
    (
        "/v1/completions",
        {"model": "smollm2", "prompt": "hi", "top_p": 0},
        None,
        400,
        "top_p",
    ),
    (
        "/v1/completions",
        {"model": "smollm2", "prompt": "hi", "top_k": -7},
        None,
        400,
        "top_k",
    ),
    (
        "/v1/completions",
        {"model": "smollm2", "prompt": "hi", "presence_penalty": 9},
        None,
        400,
        "presence_penalty",
    ),
    (
        "/v1/completions",
        {"model": "smollm2", "prompt": "hi", "frequency_penalty": -9},
        None,
        400,
        "frequency_penalty",
    ),
    ("/v1/completions", {"model": "smollm2", "prompt": "hi", "n": 0}, None, 400, "n"),
    (
        "/v1/completions",
        {"model": "smollm2", "prompt": "hi", "n": 1000},
        None,
        400,
        "n",
    ),
    (
        "/v1/completions",
        {"model": "smollm2", "prompt": "hi", "logprobs": 99},
        None,
        400,
        "logprobs",
    ),
    (
        "/v1/chat/completions",
        {
            "model": "smollm2",
            "messages": [{"role": "user", "content": "hi"}],
            "logprobs": True,
            "top_logprobs": 50,
        },
        None,
        400,
        "logprobs",
    ),
    (
        "/v1/completions",
        {"model": "smollm2", "prompt": "hi", "stop": ["x"] * 40},
        None,
        400,
        "stop",
    ),
    (
        "/v1/completions",
        {"model": "smollm2", "prompt": "hi", "logit_bias": {"x": 1}},
        None,
        400,
        "logit_bias.x",
    ),
    (
        "/v1/completions",
        {"model": "smollm2", "prompt": "hi", "logit_bias": {"99999": 1}},
        None,
        400,
        "logit_bias",
    ),
    (
        "/v1/completions",
        {"model": "smollm2", "prompt": "hi", "logit_bias": {"5": 101}},
        None,
        400,
        "logit_bias",
    ),
    (
        "/v1/completions",
        {"model": "smollm2", "prompt": "hi", "repetition_penalty": 1e-45},
        None,
        400,
        "repetition_penalty",
    ),
    (
        "/v1/completions",
        {"model": "smollm2", "prompt": "hi", "min_p": 1.5},
        None,
        400,
        "min_p",
    ),
    (
        "/v1/completions",
        {"model": "smollm2", "prompt": "hi", "best_of": 3},
        None,
        400,
        "best_of",
    ),
    (
        "/v1/completions",
        {"model": "smollm2", "prompt": "hi", "suffix": "end"},
        None,
        400,
        "suffix",
    ),
    (
        "/v1/completions",
        {"model": "smollm2", "prompt": "hi", "echo": True},
        None,
        400,
        "echo",
    ),
    (
        "/v1/completions",
        {"model": "smollm2", "prompt": "hi", "stream_options": {"include_usage": True}},
        None,
        400,
        "stream_options",
    ),
    (
        "/v1/chat/completions",
        {
            "model": "smollm2",
            "messages": [{"role": "user", "content": "hi"}],
            "response_format": {"type": "xml"},
        },
        None,
        400,
        "response_format.type",
    ),
    (
        "/v1/chat/completions",
        {
            "model": "smollm2",
            "messages": [{"role": "user", "content": "hi"}],
            "functions": [{"name": "f"}],
        },
        None,
        400,
        "functions",
    ),
    (
        "/v1/completions",
        {"model": "smollm2", "prompt": [1, 2, 999999]},
        None,
        400,
        "prompt",
    ),
    ("/v1/completions", {"model": "smollm2", "prompt": [1, -2]}, None, 400, "prompt"),
    (
        "/v1/completions",
        {"model": "smollm2", "prompt": "bad \ud800 surrogate"},
        None,
        400,
        "invalid_encoding",
    ),
    (
        "/v1/completions",
        {"model": "smollm2", "prompt": "x" * (5 * 1024 * 1024)},
        None,
        413,
        "body_too_large",
    ),
    ("/v1/nothing-here", {"model": "smollm2"}, None, 404, "not_found"),
]


@pytest.mark.parametrize(
    "path, body, headers, status, expected",
    BAD_REQUESTS,
    ids=[f"{i}-{c[4]}" for i, c in enumerate(BAD_REQUESTS)],
)
def test_bad_input_gets_an_openai_error_and_the_server_keeps_serving(
    server, client, path, body, headers, status, expected
):
    h = {
        "Authorization": f"Bearer {ALICE}",
        "Content-Type": "application/json",
        **(headers or {}),
    }
    raw = body if isinstance(body, bytes) else json.dumps(body).encode()
    r = httpx.post(server + path, content=raw, headers=h, timeout=60)
    assert r.status_code == status, r.text
    err = r.json()["error"]
    assert set(err) == {"message", "type", "param", "code"} and err["message"]
    assert expected in (err["code"], err["param"]), err
    ok = client.completions.create(
        model=MODEL,
        prompt="Still there?",
        max_tokens=3,
        temperature=0,
        extra_body={"ignore_eos": True},
    )
    assert ok.choices[0].text and ok.usage.completion_tokens == 3
    wait_for_idle_pool(server)


def test_auth_missing_and_wrong_key(server):
    for headers in ({}, {"Authorization": "Bearer sk-nope"}, {"Authorization": ALICE}):
        r = httpx.post(
            server + "/v1/completions",
            json={"model": MODEL, "prompt": "hi"},
            headers=headers,
        )
        assert r.status_code == 401 and r.json()["error"]["code"] == "invalid_api_key"
    with pytest.raises(openai.AuthenticationError):
        openai.OpenAI(base_url=server + "/v1", api_key="sk-wrong", max_retries=0).models.list()


def test_tenants_do_not_share_prefix_cache(server):
    shared = (
        "You are a meticulous assistant for the accounting team. " * 12 + "Question: what is VAT?"
    )
    alice = openai.OpenAI(base_url=server + "/v1", api_key=ALICE, max_retries=0)
    bob = openai.OpenAI(base_url=server + "/v1", api_key=BOB, max_retries=0)
    first = alice.completions.create(model=MODEL, prompt=shared, max_tokens=4, temperature=0)
    again = alice.completions.create(model=MODEL, prompt=shared, max_tokens=4, temperature=0)
    other = bob.completions.create(model=MODEL, prompt=shared, max_tokens=4, temperature=0)

    def cached(r):
        return r.usage.prompt_tokens_details.cached_tokens

    assert cached(first) == 0 and cached(again) > 100
    assert cached(other) == 0, "tenant bob hit tenant alice's cached prefix"
    assert first.choices[0].text == again.choices[0].text == other.choices[0].text


def test_client_disconnect_mid_stream_frees_pages(server):
    body = {
        "model": MODEL,
        "prompt": "Tell me a very long story.",
        "max_tokens": 500,
        "stream": True,
        "ignore_eos": True,
    }
    with httpx.stream(
        "POST",
        server + "/v1/completions",
        json=body,
        headers={"Authorization": f"Bearer {ALICE}"},
    ) as r:
        lines = r.iter_lines()
        got = [next(lines) for _ in range(6)]
        assert any(line.startswith("data: ") for line in got)
        assert metric(server, "kvfence_kv_pages_in_use_by_requests") > 0
    wait_for_idle_pool(server, timeout=10)


def test_too_many_requests_get_429_with_retry_after(server):
    async def burst():
        async with httpx.AsyncClient(timeout=300) as c:
            body = {
                "model": MODEL,
                "prompt": "Count to fifty:",
                "max_tokens": 24,
                "ignore_eos": True,
            }
            rs = await asyncio.gather(
                *[
                    c.post(
                        server + "/v1/completions",
                        json=body,
                        headers={"Authorization": f"Bearer {ALICE}"},
                    )
                    for _ in range(90)
                ]
            )
            return rs

    responses = asyncio.run(burst())
    limited = [r for r in responses if r.status_code == 429]
    assert limited and all(r.headers.get("retry-after") for r in limited)
    assert limited[0].json()["error"]["code"] == "too_many_requests"
    assert all(r.status_code in (200, 429) for r in responses)
    wait_for_idle_pool(server)


def test_64_concurrent_streams_match_sequential_greedy(server, aclient):
    prompts = [f"Fact number {i}: the" + " very" * (i % 9) for i in range(64)]

    async def one(prompt):
        stream = await aclient.completions.create(
            model=MODEL,
            prompt=prompt,
            max_tokens=8,
            temperature=0,
            stream=True,
            extra_body={"ignore_eos": True},
        )
        return "".join([c.choices[0].text async for c in stream])

    async def concurrent():
        return await asyncio.gather(*[one(p) for p in prompts])

    together = asyncio.run(concurrent())
    sync = openai.OpenAI(base_url=server + "/v1", api_key=ALICE, max_retries=0)
    alone = [
        sync.completions.create(
            model=MODEL,
            prompt=p,
            max_tokens=8,
            temperature=0,
            extra_body={"ignore_eos": True},
        )
        .choices[0]
        .text
        for p in prompts
    ]
    assert all(together) and together == alone
    wait_for_idle_pool(server)
