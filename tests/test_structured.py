"""Structured outputs in the engine: every kind of constraint holds at any temperature, the
mask is right for the tokenizer, JSON whitespace is bounded, constrained rows change nothing
for their neighbours, and each tenant compiles into its own cache."""

import json
import re
from pathlib import Path
from typing import Annotated

import pytest
from pydantic import BaseModel, ConfigDict, Field

import kvfence
from helpers import save_tiny_model
from kvfence import SamplingParams, StructuredOutputs
from kvfence.engine.sampling_params import InvalidRequest
from kvfence.engine.structured import Grammars

QUESTION = [{"role": "user", "content": "Describe a city in France."}]


class City(BaseModel):
    model_config = ConfigDict(extra="forbid")  # no keys beyond these, as strict schemas say
    name: str = Field(max_length=24)
    population: int = Field(ge=0)
    rivers: list[Annotated[str, Field(max_length=16)]] = Field(max_length=3)
    capital: bool


def answers(llm, spec, n=4, temperature=1.5, max_tokens=96, **kw):
    params = SamplingParams(
        n=n,
        temperature=temperature,
        seed=7,
        max_tokens=max_tokens,
        structured_outputs=spec,
        **kw,
    )
    return llm.chat(QUESTION, params)[0].outputs


def test_every_kind_of_constraint_holds_at_a_high_temperature(real_llm):
    for out in answers(real_llm, StructuredOutputs(json=City.model_json_schema())):
        assert out.finish_reason == "stop", out.text
        City.model_validate_json(out.text)
    for out in answers(real_llm, StructuredOutputs(json_object=True), max_tokens=256):
        if out.finish_reason == "stop":  # a random object may run past max_tokens
            assert isinstance(json.loads(out.text), dict)
        else:
            assert out.text.startswith("{")
    for out in answers(real_llm, StructuredOutputs(regex=r"[A-Z][a-z]{2,8}-\d{2,4}")):
        assert re.fullmatch(r"[A-Z][a-z]{2,8}-\d{2,4}", out.text) and out.finish_reason == "stop"
    choices = ["Paris", "Lyon", "Marseille"]
    texts = {o.text for o in answers(real_llm, StructuredOutputs(choice=choices), n=8)}
    assert texts <= set(choices) and texts
    ebnf = 'root ::= "The answer is " answer "."\nanswer ::= "yes" | "no" | [0-9]+'
    for out in answers(real_llm, StructuredOutputs(grammar=ebnf)):
        assert re.fullmatch(r"The answer is (yes|no|[0-9]+)\.", out.text), out.text
    lark = 'start: "city=" NAME\nNAME: /[a-z]{3,10}/'
    for out in answers(real_llm, StructuredOutputs(grammar=lark)):
        assert re.fullmatch(r"city=[a-z]{3,10}", out.text), out.text


def test_json_whitespace_is_bounded_even_when_the_model_wants_spaces(real_llm, tokenizer):
    """With every whitespace token pushed to the top, an unconstrained-whitespace grammar
    fills max_tokens with spaces; ours allows none outside strings."""
    space_tokens = [
        t for t in range(len(tokenizer)) if tokenizer.decode([t]).isspace() and t < 49152
    ][:300]
    schema = {
        "type": "object",
        "properties": {
            "a": {"type": "integer", "minimum": 0, "maximum": 999},
            "b": {
                "type": "array",
                "items": {"type": "integer", "minimum": 0, "maximum": 999},
                "maxItems": 4,
            },
        },
        "required": ["a", "b"],
        "additionalProperties": False,
    }
    bias = dict.fromkeys(space_tokens, 100.0)
    for out in answers(real_llm, StructuredOutputs(json=schema), logit_bias=bias, max_tokens=64):
        assert out.finish_reason == "stop", out.text
        assert not re.search(r"\s\s|\n|\t", out.text), out.text
        assert out.text == json.dumps(json.loads(out.text)), out.text


def test_constrained_rows_change_nothing_for_their_neighbours(real_llm):
    plain = SamplingParams(temperature=0, max_tokens=24)
    prompt = "The capital of France is"
    alone = real_llm.generate([prompt], plain)[0].outputs[0].text
    constrained = SamplingParams(
        temperature=0.8, max_tokens=24, structured_outputs=StructuredOutputs(json_object=True)
    )
    batch = real_llm.generate([prompt, prompt, "Once upon a time"], [plain, constrained, plain])
    assert batch[0].outputs[0].text == alone
    assert batch[1].outputs[0].text.startswith("{")


@pytest.fixture(scope="module")
def padded_llm(tmp_path_factory, tokenizer):
    """A tiny safetensors model whose vocabulary is 64 rows wider than its tokenizer's, as
    models padded for their kernels are."""
    path = save_tiny_model(tmp_path_factory, tokenizer, "llama", vocab_size=len(tokenizer) + 64)
    return kvfence.LLM(model=str(path), num_threads=2, max_model_len=256, num_kv_pages=64)


@pytest.mark.parametrize("source", ["gguf", "safetensors, padded vocabulary"])
def test_the_mask_allows_exactly_what_keeps_the_answer_valid(request, source):
    """Steps a valid answer through the grammar and checks every allowed token at three
    points: after `{"n": ` only digits or a minus may come, never a special token; in the
    middle of a string no token may hold an unescaped quote followed by more; at the end only
    the end of sequence. Tokens of the model's padded vocabulary past the tokenizer's never."""
    llm = request.getfixturevalue("real_llm" if source == "gguf" else "padded_llm")
    engine, tokenizer = llm.engine, llm.engine.tokenizer
    grammars = engine.grammars
    schema = {
        "type": "object",
        "properties": {"n": {"type": "integer"}, "s": {"type": "string"}},
        "required": ["n", "s"],
        "additionalProperties": False,
    }
    matcher = grammars.compile(StructuredOutputs(json=schema), "t").start().matcher
    vocab = engine.model_config.vocab_size
    special = set(tokenizer.all_special_ids)

    def allowed() -> list[int]:
        bits = matcher.compute_bitmask()
        return [t for t in range(vocab) if bits[t // 8] >> (t % 8) & 1]

    def walk(text: str) -> None:
        for t in tokenizer.encode(text, add_special_tokens=False):
            assert matcher.consume_token(t), (text, t)

    walk('{"n": ')
    after_key = allowed()
    assert after_key
    for t in after_key:
        assert t not in special and t < len(tokenizer)
        assert re.fullmatch(r"-?\d+", tokenizer.decode([t])) or tokenizer.decode([t]) == "-"
    walk('12, "s": "ab')
    for t in allowed():
        piece = tokenizer.decode([t])
        assert t not in special
        if '"' in piece:  # the string may close, then only the object's end may follow
            assert piece.split('"', 1)[1] in ("", "}"), repr(piece)
    walk('c"}')
    assert set(allowed()) <= engine.eos_token_ids
    assert matcher.is_accepting()


def test_each_tenant_compiles_into_its_own_cache(tokenizer):
    grammars = Grammars(tokenizer, len(tokenizer), {tokenizer.eos_token_id})
    spec = StructuredOutputs(json=City.model_json_schema())
    first = grammars.compile(spec, "alice")
    assert grammars.compile(spec, "alice") is first and grammars.compiles == 1
    assert grammars.compile(spec, "bob") is not first and grammars.compiles == 2


@pytest.mark.parametrize(
    "spec, message",
    [
        (StructuredOutputs(), "exactly one of"),
        (StructuredOutputs(regex="a", choice=["b"]), "exactly one of"),
        (StructuredOutputs(regex="(unclosed"), "structured_outputs"),
        (StructuredOutputs(choice=[]), "choice must be"),
        (StructuredOutputs(json={"type": "no-such-type"}), "structured_outputs"),
        (StructuredOutputs(json={"$ref": "#/$defs/missing"}), "structured_outputs"),
        (StructuredOutputs(json="{not json"), "structured_outputs"),
        (StructuredOutputs(grammar="root ::= undefined_rule"), "structured_outputs"),
        (StructuredOutputs(json={"type": "array", "uniqueItems": True}), "uniqueItems"),
    ],
)
def test_a_bad_constraint_is_refused_with_the_field_named(tokenizer, spec, message):
    grammars = Grammars(tokenizer, len(tokenizer), {tokenizer.eos_token_id})
    with pytest.raises(InvalidRequest, match=message) as caught:
        grammars.compile(spec, "t")
    assert caught.value.param == "structured_outputs"


def expand(case: dict):
    """A case of tests/data/hostile_schemas.json as the text (or list) a client would send:
    literal, or built by its recipe ("nest": `outer` wrapped `depth` times around `inner`;
    "repeat": `item` for i in range(count), joined by `sep`)."""
    recipe = case.get("generate")
    if recipe is None:
        return case["value"]
    if "nest" in recipe:
        g = recipe["nest"]
        text = g["inner"]
        for _ in range(g["depth"]):
            text = g["outer"].replace("@", text)
        text = g.get("prefix", "") + text
    else:
        g = recipe["repeat"]
        items = (
            g["item"].replace("{i}", str(i)).replace("{next}", str(i + 1))
            for i in range(g["count"])
        )
        text = g.get("prefix", "") + g.get("sep", "").join(items) + g.get("suffix", "")
    return json.loads(text) if case["kind"] == "choice" else text


HOSTILE = json.loads((Path(__file__).parent / "data" / "hostile_schemas.json").read_text())
FIELD = {"json_schema": "json", "regex": "regex", "grammar": "grammar", "choice": "choice"}


@pytest.fixture(scope="module")
def grammars(tokenizer):
    return Grammars(tokenizer, len(tokenizer), {tokenizer.eos_token_id})


@pytest.mark.parametrize("case", HOSTILE, ids=[c["name"] for c in HOSTILE])
def test_hostile_schemas_and_grammars_are_refused_or_compile_never_crash(grammars, case):
    """Schemas, regexes and grammars that crashed, hung or exhausted other servers' grammar
    backends (each case names its report): refused with a 400's InvalidRequest, or compiled.
    Four of them ended this process with a stack overflow before compiles had a stack of
    their own."""
    spec = StructuredOutputs(**{FIELD[case["kind"]]: expand(case)})
    if case["expect"] == "refused":
        with pytest.raises(InvalidRequest) as caught:
            grammars.compile(spec, "t")
        assert caught.value.param == "structured_outputs"
    else:
        grammars.compile(spec, "t").start()


def test_a_grammar_whose_masks_grow_fails_alone(real_llm):
    """An ambiguous grammar (`s: s s | ...`) compiles and masks fast at first, then each mask
    costs more as the answer grows (it took 260 ms by the 375th token). Its request fails
    once its masks pass their budget; the request batched beside it is not touched."""
    plain = SamplingParams(temperature=0, max_tokens=24)
    prompt = "The capital of France is"
    alone = real_llm.generate([prompt], plain)[0].outputs[0].text
    ambiguous = SamplingParams(
        temperature=1.5,
        seed=0,
        max_tokens=400,
        ignore_eos=True,
        structured_outputs=StructuredOutputs(grammar='start: s\ns: s s | "a" | "b" | "ab" | "ba"'),
    )
    bad, good = real_llm.generate([prompt, prompt], [ambiguous, plain])
    assert bad.outputs[0].finish_reason == "error"
    assert "grammar" in bad.outputs[0].error and len(bad.outputs[0].token_ids) < 400
    assert good.outputs[0].text == alone
