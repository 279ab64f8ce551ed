"""Structured outputs and tool calls over HTTP, through the official `openai` client, on a
real `kvfence serve` of the default model (whose chat template has no tool format: the
generic one applies)."""

import asyncio
import json

import httpx
import openai
import pytest
from pydantic import BaseModel, ConfigDict, Field

from helpers import TENANT_KEYS, start_tenant_server, stop_server

ALICE, BOB = list(TENANT_KEYS)
MODEL = "smollm2"
CAPITAL = [{"role": "user", "content": "What is the capital of France?"}]
WEATHER = {
    "type": "function",
    "function": {
        "name": "get_weather",
        "description": "The weather in a city",
        "parameters": {
            "type": "object",
            "properties": {
                "city": {"type": "string", "maxLength": 20},
                "unit": {"type": "string", "enum": ["celsius", "fahrenheit"]},
            },
            "required": ["city", "unit"],
            "additionalProperties": False,
        },
    },
}
TIME = {
    "type": "function",
    "function": {
        "name": "get_time",
        "parameters": {
            "type": "object",
            "properties": {"zone": {"type": "string", "maxLength": 12}},
            "required": ["zone"],
            "additionalProperties": False,
        },
    },
}
ASK_WEATHER = [{"role": "user", "content": "What is the weather in Paris?"}]


class Capital(BaseModel):
    model_config = ConfigDict(extra="forbid")
    country: str = Field(max_length=20)
    city: str = Field(max_length=20)


def test_parse_into_a_pydantic_model_at_any_temperature(client):
    for temperature in (0.0, 1.3):
        r = client.chat.completions.parse(
            model=MODEL,
            messages=CAPITAL,
            response_format=Capital,
            temperature=temperature,
            seed=3,
            max_tokens=64,
        )
        assert r.choices[0].finish_reason == "stop"
        assert isinstance(r.choices[0].message.parsed, Capital)


def test_json_object_and_a_streamed_schema(client):
    r = client.chat.completions.create(
        model=MODEL,
        messages=CAPITAL,
        response_format={"type": "json_object"},
        temperature=0,
        max_tokens=64,
    )
    assert isinstance(json.loads(r.choices[0].message.content), dict)
    stream = client.chat.completions.create(
        model=MODEL,
        messages=CAPITAL,
        response_format={
            "type": "json_schema",
            "json_schema": {"name": "capital", "schema": Capital.model_json_schema()},
        },
        temperature=1.0,
        seed=5,
        max_tokens=64,
        stream=True,
    )
    chunks = [c for c in stream if c.choices]
    text = "".join(c.choices[0].delta.content or "" for c in chunks)
    Capital.model_validate_json(text)
    assert chunks[-1].choices[0].finish_reason == "stop"


def test_structured_outputs_on_completions(client):
    """vLLM's and SGLang's form, on /v1/completions: regex, choice, EBNF grammar, JSON."""
    cases = [
        ({"regex": r"[0-9]{3}-[a-z]{2}"}, lambda t: len(t) == 6 and t[3] == "-"),
        ({"choice": ["red", "green", "blue"]}, lambda t: t in ("red", "green", "blue")),
        ({"grammar": 'root ::= "x" [0-9] "y"'}, lambda t: t[0] == "x" and t[2] == "y"),
        ({"json": {"type": "array", "items": {"type": "boolean"}, "maxItems": 3}}, json.loads),
    ]
    for structured, check in cases:
        r = client.completions.create(
            model=MODEL,
            prompt="My favourite thing:",
            temperature=1.0,
            max_tokens=32,
            n=3,
            seed=1,
            extra_body={"structured_outputs": structured},
        )
        for choice in r.choices:
            assert choice.finish_reason == "stop" and check(choice.text) is not False, choice


def test_required_and_named_tool_calls(client):
    r = client.chat.completions.create(
        model=MODEL,
        messages=ASK_WEATHER,
        tools=[WEATHER, TIME],
        tool_choice="required",
        temperature=0,
        max_tokens=96,
    )
    choice = r.choices[0]
    assert choice.finish_reason == "tool_calls" and choice.message.tool_calls
    for call in choice.message.tool_calls:
        assert call.type == "function" and call.id.startswith("call_")
        assert call.function.name in ("get_weather", "get_time")
        assert isinstance(json.loads(call.function.arguments), dict)
    for seed in range(3):  # one call at most, at a temperature that would chain several
        r = client.chat.completions.create(
            model=MODEL,
            messages=ASK_WEATHER,
            tools=[WEATHER, TIME],
            tool_choice="required",
            parallel_tool_calls=False,
            temperature=0.9,
            seed=seed,
            max_tokens=96,
        )
        (call,) = r.choices[0].message.tool_calls
        assert r.choices[0].finish_reason == "tool_calls"
    named = {"type": "function", "function": {"name": "get_time"}}
    for seed in range(3):
        r = client.chat.completions.create(
            model=MODEL,
            messages=ASK_WEATHER,
            tools=[WEATHER, TIME],
            tool_choice=named,
            parallel_tool_calls=False,
            temperature=1.2,
            seed=seed,
            max_tokens=96,
        )
        (call,) = r.choices[0].message.tool_calls
        assert call.function.name == "get_time"
        assert set(json.loads(call.function.arguments)) == {"zone"}


def test_auto_answers_in_text_or_calls_and_the_second_round_works(client):
    first = client.chat.completions.create(
        model=MODEL, messages=ASK_WEATHER, tools=[WEATHER], temperature=0, max_tokens=96
    )
    message = first.choices[0].message
    if message.tool_calls:
        assert first.choices[0].finish_reason == "tool_calls"
        call = message.tool_calls[0]
    else:  # answered in text: the second round still needs a call, so force one
        assert message.content and first.choices[0].finish_reason == "stop"
        forced = client.chat.completions.create(
            model=MODEL,
            messages=ASK_WEATHER,
            tools=[WEATHER],
            tool_choice="required",
            temperature=0,
            max_tokens=96,
        )
        message = forced.choices[0].message
        call = message.tool_calls[0]
    history = ASK_WEATHER + [
        message.model_dump(exclude_none=True),
        {"role": "tool", "tool_call_id": call.id, "content": '{"temperature": 21}'},
    ]
    second = client.chat.completions.create(
        model=MODEL,
        messages=history,
        tools=[WEATHER],
        tool_choice="none",
        temperature=0,
        max_tokens=32,
    )
    assert second.choices[0].message.content and not second.choices[0].message.tool_calls


def test_streamed_tool_calls_arrive_as_openai_streams_them(client):
    kwargs = dict(
        model=MODEL,
        messages=ASK_WEATHER,
        tools=[WEATHER, TIME],
        tool_choice="required",
        temperature=0.7,
        seed=11,
        max_tokens=96,
    )
    whole = client.chat.completions.create(**kwargs).choices[0].message.tool_calls
    pieces = [
        c.choices[0].delta.tool_calls
        for c in client.chat.completions.create(stream=True, **kwargs)
        if c.choices and c.choices[0].delta.tool_calls
    ]
    calls: dict[int, dict] = {}
    for (piece,) in pieces:
        if piece.index not in calls:  # a call's first piece names it
            assert piece.id and piece.function.name and piece.type == "function"
            calls[piece.index] = {"id": piece.id, "name": piece.function.name, "arguments": ""}
        else:
            assert piece.id is None and piece.function.name is None
        calls[piece.index]["arguments"] += piece.function.arguments or ""
    assert len(pieces) > len(calls)  # the arguments came in several pieces
    assert [(c["name"], c["arguments"]) for c in calls.values()] == [
        (w.function.name, w.function.arguments) for w in whole
    ]


SURROGATE_CALL = {
    "id": "call_1",
    "type": "function",
    "function": {"name": "get_time", "arguments": '{"zone": "\\ud800"}'},
}
HOSTILE = [
    ({"response_format": {"type": "xml"}}, "response_format"),
    ({"response_format": {"type": "json_schema"}}, "response_format"),
    (
        {"response_format": {"type": "json_schema", "json_schema": {"name": "x", "schema": 1}}},
        "response_format",
    ),
    (
        {
            "response_format": {
                "type": "json_schema",
                "json_schema": {"name": "x", "schema": {"type": "frobnicate"}},
            }
        },
        "response_format",
    ),
    (
        {
            "response_format": {
                "type": "json_schema",
                "json_schema": {"name": "x", "schema": {"$ref": "#/$defs/nowhere"}},
            }
        },
        "response_format",
    ),
    ({"structured_outputs": {"regex": "(a"}}, "structured_outputs"),
    ({"structured_outputs": {"regex": "a", "choice": ["a"]}}, "structured_outputs"),
    ({"structured_outputs": {"grammar": "root ::= missing"}}, "structured_outputs"),
    ({"tools": [{"type": "function", "function": {"parameters": {}}}]}, "tools"),
    (
        {"tools": [WEATHER], "tool_choice": {"type": "function", "function": {"name": "nope"}}},
        "tool",
    ),
    ({"tools": [WEATHER], "tool_choice": "sometimes"}, "tool_choice"),
    (  # arguments whose JSON spells a lone surrogate, sent back in a second round
        {
            "messages": CAPITAL
            + [
                {"role": "assistant", "content": None, "tool_calls": [SURROGATE_CALL]},
                {"role": "tool", "tool_call_id": "call_1", "content": "noon"},
            ]
        },
        "messages",
    ),
    (
        {
            "tools": [WEATHER],
            "response_format": {"type": "json_object"},
        },
        "tools",
    ),
]


@pytest.mark.parametrize("extra, param", HOSTILE)
def test_bad_constraints_and_tools_get_a_400_naming_the_field(server, extra, param):
    r = httpx.post(
        server + "/v1/chat/completions",
        json={"model": MODEL, "messages": CAPITAL, "max_tokens": 4} | extra,
        headers={"Authorization": f"Bearer {ALICE}"},
        timeout=60,
    )
    assert r.status_code == 400, r.text
    error = r.json()["error"]
    assert param in (error["param"] or "") and error["message"]
    ok = httpx.post(
        server + "/v1/chat/completions",
        json={"model": MODEL, "messages": CAPITAL, "max_tokens": 2},
        headers={"Authorization": f"Bearer {ALICE}"},
        timeout=60,
    )
    assert ok.status_code == 200


def test_a_heavy_schema_compiles_while_plain_requests_keep_their_outputs(aclient, client):
    """A schema that takes the compiler real work, sent beside six plain requests: every
    plain request gives the text it gives alone, and the schema's answer is valid."""
    heavy = {
        "type": "object",
        "properties": {
            f"field_{i}": {"type": "string", "pattern": f"^[a-z]{{{i % 5 + 1},12}}[0-9]{{2}}$"}
            for i in range(60)
        },
        "required": [f"field_{i}" for i in range(3)],
        "additionalProperties": False,
    }
    prompts = [f"Count from {i} to {i + 5}:" for i in range(6)]
    alone = [
        client.completions.create(model=MODEL, prompt=p, temperature=0, max_tokens=16)
        .choices[0]
        .text
        for p in prompts
    ]

    async def together():
        constrained = aclient.chat.completions.create(
            model=MODEL,
            messages=CAPITAL,
            response_format={"type": "json_schema", "json_schema": {"name": "h", "schema": heavy}},
            max_tokens=160,
            temperature=0,
        )
        plain = [
            aclient.completions.create(model=MODEL, prompt=p, temperature=0, max_tokens=16)
            for p in prompts
        ]
        return await asyncio.gather(constrained, *plain)

    constrained, *plain = asyncio.run(together())
    assert [r.choices[0].text for r in plain] == alone
    if constrained.choices[0].finish_reason == "stop":
        assert set(json.loads(constrained.choices[0].message.content)) <= set(heavy["properties"])


def test_a_schema_over_the_compile_budget_is_refused_and_the_server_serves_on(tmp_path):
    """--grammar-timeout 0.1 against a schema of 2,400 optional properties, just under the
    64 KiB cap (about 0.4 s to compile here): a 400 naming response_format; the compile ends
    in the background, and the same tenant's next schema and everyone's plain requests are
    served."""
    proc, base = start_tenant_server(tmp_path, "--grammar-timeout", "0.1")
    try:
        client = openai.OpenAI(base_url=base + "/v1", api_key=ALICE, max_retries=0, timeout=60)
        wide = {
            "type": "object",
            "properties": {f"p{i}": {"type": "integer"} for i in range(2400)},
        }
        with pytest.raises(openai.BadRequestError) as caught:
            client.chat.completions.create(
                model=MODEL,
                messages=CAPITAL,
                max_tokens=8,
                response_format={
                    "type": "json_schema",
                    "json_schema": {"name": "w", "schema": wide},
                },
            )
        error = caught.value.body
        assert error["param"] == "response_format" and error["code"] == "grammar_too_complex"
        r = client.chat.completions.create(
            model=MODEL, messages=CAPITAL, max_tokens=32, response_format={"type": "json_object"}
        )
        assert r.choices[0].message.content.startswith("{")
        bob = openai.OpenAI(base_url=base + "/v1", api_key=BOB, max_retries=0, timeout=60)
        r = bob.chat.completions.create(model=MODEL, messages=CAPITAL, max_tokens=8, temperature=0)
        assert r.choices[0].message.content
    finally:
        stop_server(proc)
