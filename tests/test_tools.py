"""Tool calls: each family's prompt rendering through its real chat template, its grammar under
llguidance, and the parser, whole and streamed."""

import copy
import json
import random
import re
from dataclasses import replace
from pathlib import Path

import llguidance.hf
import pytest
from llguidance import LLMatcher
from tokenizers import AddedToken

from helpers import save_tiny_model
from kvfence.engine.sampling_params import InvalidRequest
from kvfence.server.tools import check_tools, detect_format

TEMPLATES = Path(__file__).parent / "data" / "templates"
# family -> (chat template from llama.cpp's models/templates, None: the default model's own;
#            the family's tags that its vocabulary holds as one added token, and whether special)
FAMILIES = {
    "qwen": ("Qwen-Qwen3-0.6B.jinja", [("<tool_call>", False), ("</tool_call>", False)]),
    "llama3": ("meta-llama-Llama-3.3-70B-Instruct.jinja", [("<|python_tag|>", True)]),
    "mistral": ("mistralai-Mistral-Nemo-Instruct-2407.jinja", [("[TOOL_CALLS]", True)]),
    "generic": (None, []),
}
WEATHER = {
    "type": "function",
    "function": {
        "name": "get_weather",
        "description": "The weather forecast of a city",
        "parameters": {
            "type": "object",
            "properties": {"city": {"type": "string"}, "days": {"type": "integer"}},
            "required": ["city"],
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
            "properties": {"zone": {"type": "string"}},
            "required": ["zone"],
        },
    },
}
TOOLS = [WEATHER, TIME]
NAMED_TIME = {"type": "function", "function": {"name": "get_time"}}


def template(family: str) -> str | None:
    name = FAMILIES[family][0]
    return name and (TEMPLATES / name).read_text()


def calls_text(family: str, *calls: tuple[str, str]) -> str:
    """(name, arguments JSON) calls, written as `family`'s models write them."""
    if family == "qwen":
        return "\n".join(
            f'<tool_call>\n{{"name": "{n}", "arguments": {a}}}\n</tool_call>' for n, a in calls
        )
    if family == "llama3":
        ((n, a),) = calls
        return f'{{"name": "{n}", "parameters": {a}}}'
    listed = ", ".join(f'{{"name": "{n}", "arguments": {a}}}' for n, a in calls)
    return f"[TOOL_CALLS][{listed}]" if family == "mistral" else f'{{"tool_calls": [{listed}]}}'


PARIS = ("get_weather", '{"city": "Paris", "days": 3}')
UTC = ("get_time", '{"zone": "UTC"}')


@pytest.fixture(scope="module")
def family_tokenizer(tokenizer):
    """family -> (HF tokenizer, llguidance tokenizer): the default model's vocabulary, with the
    family's tags added as the tokens its own vocabulary has, and the family's chat template."""
    built = {}

    def get(family):
        if family not in built:
            tok = copy.deepcopy(tokenizer)
            for tag, special in FAMILIES[family][1]:
                tok.add_tokens([AddedToken(tag, special=special)], special_tokens=special)
            if FAMILIES[family][0]:
                tok.chat_template = template(family)
            built[family] = tok, llguidance.hf.from_tokenizer(tok)
        return built[family]

    return get


def accepts(tok, lltok, grammar: str, text: str) -> bool:
    matcher = LLMatcher(lltok, LLMatcher.grammar_from_lark(grammar), log_level=0)
    tokens = tok.encode(text, add_special_tokens=False)
    return all(matcher.consume_token(t) for t in tokens) and matcher.is_accepting()


@pytest.mark.parametrize("family", FAMILIES)
def test_detect_format_picks_the_family(family, family_tokenizer):
    tok, _ = family_tokenizer(family)
    fmt = detect_format(tok.chat_template, tok)
    assert fmt.name == family
    for tag, _special in FAMILIES[family][1]:
        assert fmt.tokens[tag] == tok.convert_tokens_to_ids(tag)


def test_detect_format_without_a_template(tokenizer):
    assert detect_format(None, tokenizer).name == "generic"


CONVERSATION = [
    {"role": "system", "content": "Answer briefly."},
    {"role": "user", "content": "What is the weather in Paris?"},
    {
        "role": "assistant",
        "content": "",
        "tool_calls": [
            {
                "id": "call_0123456789abcdef01234567",
                "type": "function",
                "function": {"name": "get_weather", "arguments": '{"city": "Paris"}'},
            }
        ],
    },
    {"role": "tool", "tool_call_id": "call_0123456789abcdef01234567", "content": "18 C, sunny"},
    {"role": "assistant", "content": "18 C and sunny."},
    {"role": "user", "content": "And tomorrow?"},
]
# the user asks again right after the tool's result: Mistral's template refuses this turn order
STRAIGHT_ON = CONVERSATION[:4] + CONVERSATION[5:]


@pytest.mark.parametrize(
    ("family", "conversation"),
    [(f, CONVERSATION) for f in FAMILIES] + [(f, STRAIGHT_ON) for f in FAMILIES if f != "mistral"],
)
def test_render_goes_through_the_real_template(family, conversation, family_tokenizer):
    tok, _ = family_tokenizer(family)
    fmt = detect_format(tok.chat_template, tok)
    messages, tools = fmt.render(conversation, TOOLS)
    prompt = tok.apply_chat_template(
        messages, tools=tools, tokenize=False, add_generation_prompt=True
    )
    for shown in ("get_weather", "get_time", "The weather forecast of a city", "18 C, sunny"):
        assert shown in prompt
    earlier_call = ("get_weather", '{"city": "Paris"}')
    if family == "mistral":  # its template adds the call's id inside the call
        assert re.search(
            r'\[TOOL_CALLS\]\[\{"name": "get_weather", "arguments": \{"city": "Paris"\}, '
            r'"id": "[a-zA-Z0-9]{9}"\}\]',
            prompt,
        )
    else:  # the earlier call reads as the family generates calls
        assert calls_text(family, earlier_call) in prompt
    assert (tools is None) == (family == "generic")


def test_generic_render_merges_the_system_message_and_tool_results(family_tokenizer):
    tok, _ = family_tokenizer("generic")
    messages, _ = detect_format(tok.chat_template, tok).render(STRAIGHT_ON, TOOLS)
    assert [m["role"] for m in messages] == ["system", "user", "assistant", "user"]
    assert messages[0]["content"].startswith("Answer briefly.\n\n")
    assert json.loads(messages[3]["content"].split("\n\n")[0]) == {
        "tool_response": {"name": "get_weather", "content": "18 C, sunny"}
    }


ARGUMENTS = "messages[2].tool_calls[0].function.arguments"


@pytest.mark.parametrize(
    ("change", "param"),
    [
        (lambda m: m[2]["tool_calls"][0]["function"].update(arguments="[1]"), ARGUMENTS),
        (lambda m: m[2]["tool_calls"][0]["function"].update(arguments="{"), ARGUMENTS),
        (lambda m: m[3].pop("tool_call_id"), "messages[3].tool_call_id"),
        (lambda m: m[3].update(tool_call_id="call_other"), "messages[3].tool_call_id"),
    ],
)
def test_render_rejects_broken_history(change, param):
    messages = copy.deepcopy(CONVERSATION)
    change(messages)
    with pytest.raises(InvalidRequest) as error:
        detect_format("<tool_call>", None).render(messages, TOOLS)
    assert error.value.param == param


def grammar_cases(family):
    """(choice, parallel, text, accepted) for `family`."""
    wrong_type = ("get_weather", '{"city": 3}')
    loose = ("get_weather", '{"city":"Paris"}')  # JSON whitespace is fixed
    spaces = ("get_weather", '{"city": "Paris",   "days": 3}')
    text = '{"response": "Sunny."}' if family == "generic" else "It is sunny."
    cases = [
        ("required", False, calls_text(family, PARIS), True),
        ("required", False, calls_text(family, UTC), True),
        ("required", False, calls_text(family, wrong_type), False),
        ("required", False, calls_text(family, loose), False),
        ("required", False, calls_text(family, spaces), False),
        ("required", False, text, False),
        (NAMED_TIME, False, calls_text(family, UTC), True),
        (NAMED_TIME, False, calls_text(family, PARIS), False),
        ("auto", False, text, True),
        ("auto", False, calls_text(family, PARIS), True),
        ("auto", False, calls_text(family, wrong_type), False),
    ]
    if family in ("qwen", "mistral"):  # calls may follow text
        cases.append(("auto", False, "Let me look.\n" + calls_text(family, PARIS), True))
    if family != "llama3":  # Llama's template takes one call a message
        cases += [
            ("required", True, calls_text(family, PARIS, UTC), True),
            ("auto", True, calls_text(family, UTC, PARIS), True),
            ("required", False, calls_text(family, PARIS, UTC), False),
        ]
    return cases


@pytest.mark.parametrize("family", FAMILIES)
def test_grammar_constrains_calls(family, family_tokenizer):
    tok, lltok = family_tokenizer(family)
    fmt = detect_format(tok.chat_template, tok)
    assert fmt.grammar(TOOLS, "none", True) is None
    for choice, parallel, text, accepted in grammar_cases(family):
        grammar = fmt.grammar(TOOLS, choice, parallel)
        assert LLMatcher.validate_grammar(LLMatcher.grammar_from_lark(grammar), lltok) == ""
        assert accepts(tok, lltok, grammar, text) == accepted, (choice, parallel, text)


def test_grammar_with_a_tag_written_out(tokenizer):
    """Where the tag is not one token, the text up to it is free and the tag starts a call."""
    lltok = llguidance.hf.from_tokenizer(tokenizer)
    fmt = detect_format(template("qwen"), tokenizer)
    assert fmt.tokens == {}
    grammar = fmt.grammar(TOOLS, "auto", False)
    assert accepts(tokenizer, lltok, grammar, "Let me look.\n" + calls_text("qwen", PARIS))
    assert accepts(tokenizer, lltok, grammar, "It is sunny.")
    assert not accepts(tokenizer, lltok, grammar, "Let me look.\n<tool_call> sunny")


def test_grammar_of_a_tool_without_parameters(tokenizer):
    lltok = llguidance.hf.from_tokenizer(tokenizer)
    grammar = detect_format(None, tokenizer).grammar([tool("ping")], "required", False)
    assert accepts(tokenizer, lltok, grammar, calls_text("generic", ("ping", "{}")))
    assert not accepts(tokenizer, lltok, grammar, calls_text("generic", ("ping", '{"x": 1}')))


def stream(parser, text: str, sizes) -> list:
    deltas, start = [], 0
    while start < len(text):
        size = next(sizes)
        deltas += parser.feed(text[start : start + size])
        start += size
    return deltas + parser.finish()


def parse_all_ways(fmt, text: str):
    """The parser's (content, calls) for `text` whole, a character at a time and in random
    chunks, which must agree; checks each stream's pieces against them."""
    whole = fmt.parser()
    whole.feed(text)
    whole.finish()
    rng = random.Random(text)
    for sizes in (iter(lambda: 1, 0), iter(lambda: rng.randint(1, 7), 0)):
        parser = fmt.parser()
        deltas = stream(parser, text, sizes)
        assert parser.content == whole.content
        assert [(c.name, c.arguments) for c in parser.calls] == [
            (c.name, c.arguments) for c in whole.calls
        ]
        assert "".join(d.content for d in deltas) == parser.content
        seen = []
        for d in deltas:
            if d.index is None:
                continue
            if d.index == len(seen):  # a call's first piece: id and name, no arguments yet
                assert (d.id, d.name, d.arguments) == (
                    parser.calls[d.index].id,
                    parser.calls[d.index].name,
                    "",
                )
                seen.append("")
            else:
                assert d.index == len(seen) - 1 and d.id is None and d.name is None
                seen[d.index] += d.arguments
        assert seen == [c.arguments for c in parser.calls]
    return whole.content, [(c.name, c.arguments) for c in whole.calls]


@pytest.mark.parametrize("family", FAMILIES)
def test_parser_reads_calls(family):
    fmt = replace(detect_format(template(family), None), eos=("</s>",))
    assert parse_all_ways(fmt, calls_text(family, PARIS)) == ("", [PARIS])
    assert parse_all_ways(fmt, calls_text(family, PARIS) + "</s>") == ("", [PARIS])
    quoted = ("get_weather", '{"city": "a \\"}]\\\\", "days": [1, {"x": "}"}]}')
    assert parse_all_ways(fmt, calls_text(family, quoted)) == ("", [quoted])
    if family != "llama3":
        assert parse_all_ways(fmt, calls_text(family, PARIS, UTC)) == ("", [PARIS, UTC])


@pytest.mark.parametrize("family", ["qwen", "mistral"])
def test_parser_reads_text_then_calls(family):
    fmt = detect_format(template(family), None)
    text = "Let me look <tool or [TOOL at that.\n"
    assert parse_all_ways(fmt, text + calls_text(family, PARIS)) == (text, [PARIS])


@pytest.mark.parametrize(
    ("family", "text"),
    [
        ("qwen", 'Sure.\n<tool_call>\n{"name": get_weather}\n</tool_call>'),
        ("qwen", "<tool_call>\n"),
        ("mistral", '[TOOL_CALLS] {"name": "get_weather"}'),
        ("llama3", "{not a call}"),
        ("llama3", '{"name": "get weather", "parameters": {}}'),
        ("generic", "It is sunny."),
        ("generic", '{"tool_calls": {"name": "get_weather"}}'),
    ],
)
def test_a_broken_call_is_content(family, text):
    fmt = detect_format(template(family), None)
    assert parse_all_ways(fmt, text) == (text, [])


def test_parser_decodes_the_generic_response():
    fmt = detect_format(None, None)
    text = '{"response": "caf\\u00e9 \\ud83d\\ude00 \\"quoted\\"\\nline \\\\ end"}'
    assert parse_all_ways(fmt, text) == ('café 😀 "quoted"\nline \\ end', [])


def test_parser_never_takes_back_text():
    """The end of the text that may start a tag or the end of sequence waits for what follows."""
    parser = replace(detect_format("<tool_call>", None), eos=("<|im_end|>",)).parser()
    assert "".join(d.content for d in parser.feed("Sure <tool")) == "Sure "
    assert "".join(d.content for d in parser.feed("s> and <|im")) == "<tools> and "
    assert "".join(d.content for d in parser.feed("_end|>")) == ""
    assert "".join(d.content for d in parser.finish()) == ""
    assert parser.content == "Sure <tools> and "


def test_call_ids():
    assert re.fullmatch(r"[a-zA-Z0-9]{9}", detect_format("[TOOL_CALLS]", None).new_call_id())
    for template in ("<tool_call>", None):
        assert re.fullmatch(r"call_[0-9a-f]{24}", detect_format(template, None).new_call_id())


def tool(name="f", parameters=None, kind="function"):
    function = {"name": name} if name is not None else {}
    if parameters is not None:
        function["parameters"] = parameters
    return {"type": kind, "function": function}


@pytest.mark.parametrize(
    ("tools", "choice", "param"),
    [
        ([tool(kind="retrieval")], "auto", "tools[0].type"),
        ([tool(name=None)], "auto", "tools[0].function.name"),
        ([tool(name="get weather")], "auto", "tools[0].function.name"),
        ([tool(name="x" * 65)], "auto", "tools[0].function.name"),
        ([tool(parameters="object")], "auto", "tools[0].function.parameters"),
        ([tool(parameters={"type": "array"})], "auto", "tools[0].function.parameters"),
        ([tool(), tool("g"), tool()], "auto", "tools[2].function.name"),
        ([tool()], "sometimes", "tool_choice"),
        ([tool()], {"type": "function", "function": {"name": "g"}}, "tool_choice"),
        ([tool()], {"type": "function"}, "tool_choice"),
        ([], "required", "tool_choice"),
        ([], {"type": "function", "function": {"name": "f"}}, "tool_choice"),
    ],
)
def test_check_tools_rejects(tools, choice, param):
    with pytest.raises(InvalidRequest) as error:
        check_tools(tools, choice, None)
    assert error.value.param == param


def test_check_tools_accepts():
    for choice in ("none", "auto", "required", NAMED_TIME, None):
        check_tools(TOOLS, choice, True)
    check_tools([tool()], "required", False)


SHORT_WEATHER = {
    "type": "function",
    "function": {
        "name": "get_weather",
        "parameters": {
            "type": "object",
            "properties": {
                "city": {"type": "string", "maxLength": 8},
                "days": {"type": "integer", "minimum": 1, "maximum": 9},
            },
            "required": ["city", "days"],
            "additionalProperties": False,
        },
    },
}
SHORT_TIME = {
    "type": "function",
    "function": {
        "name": "get_time",
        "parameters": {
            "type": "object",
            "properties": {"zone": {"type": "string", "maxLength": 6}},
            "required": ["zone"],
            "additionalProperties": False,
        },
    },
}


@pytest.mark.parametrize(
    "family, arch", [("qwen", "qwen2"), ("llama3", "llama3"), ("mistral", "mistral")]
)
def test_a_tiny_model_of_each_family_calls_tools_in_its_format(
    family, arch, family_tokenizer, tmp_path_factory
):
    """A random-weight model of the family, its real chat template and its tags as tokens:
    the engine generates under the family's grammar, and the parser reads the calls back."""
    import kvfence
    from kvfence import SamplingParams, StructuredOutputs
    from kvfence.model.tokenizer import apply_chat_template

    tok, _ = family_tokenizer(family)
    long_context = dict(max_position_embeddings=2048)
    if arch == "mistral":  # its 32-token window would cap the context below the prompt
        long_context["sliding_window"] = 2048
    path = save_tiny_model(tmp_path_factory, tok, arch, **long_context)
    llm = kvfence.LLM(model=str(path), num_threads=2, max_model_len=2048, num_kv_pages=256)
    engine = llm.engine
    fmt = detect_format(engine.tokenizer.chat_template, engine.tokenizer, engine.eos_token_ids)
    assert fmt.name == family
    tools = [SHORT_WEATHER, SHORT_TIME]
    messages, template_tools = fmt.render([{"role": "user", "content": "Weather?"}], tools)
    prompt = engine.tokenize(apply_chat_template(engine.tokenizer, messages, template_tools), True)
    for choice, names in (("required", {"get_weather", "get_time"}), (NAMED_TIME, {"get_time"})):
        for seed in range(3):
            params = SamplingParams(
                temperature=1.0,
                seed=seed,
                max_tokens=200,
                skip_special_tokens=False,
                structured_outputs=StructuredOutputs(grammar=fmt.grammar(tools, choice, False)),
            )
            out = llm.generate([prompt], params)[0].outputs[0]
            parser = fmt.parser()
            parser.feed(out.text)
            parser.finish()
            assert out.finish_reason == "stop", out.text
            (call,) = parser.calls
            assert call.name in names and not parser.content.strip(), out.text
            arguments = json.loads(call.arguments)
            if call.name == "get_time":
                assert set(arguments) == {"zone"} and len(arguments["zone"]) <= 6
            else:
                assert set(arguments) == {"city", "days"} and 1 <= arguments["days"] <= 9


def test_a_lone_surrogate_escape_becomes_a_replacement_character():
    """JSON lets a model spell an unpaired surrogate (\\udc00); no text holds one, so the
    answer shows U+FFFD there instead of failing to encode."""
    for pieces in (['{"response": "\\udc00 ok"}'], list('{"response": "\\ud800\\u0041"}')):
        parser = detect_format(None, None).parser()
        for piece in pieces:
            parser.feed(piece)
        parser.finish()
        assert "\ufffd" in parser.content
        parser.content.encode("utf-8")


def test_arguments_that_spell_a_lone_surrogate_are_refused():
    fmt = detect_format(None, None)
    call = {
        "id": "call_1",
        "type": "function",
        "function": {"name": "f", "arguments": '{"q": "\\ud800"}'},
    }
    messages = [
        {"role": "user", "content": "hi"},
        {"role": "assistant", "content": "", "tool_calls": [call]},
        {"role": "tool", "tool_call_id": "call_1", "content": "r"},
    ]
    with pytest.raises(InvalidRequest) as caught:
        fmt.render(messages, None)
    assert caught.value.param == "messages[1].tool_calls[0].function.arguments"
