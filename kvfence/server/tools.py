"""Tool calls: how a model family puts tools in the prompt, the grammar that constrains its calls
and the parser that turns its output back into OpenAI tool calls, whole or streamed.

Every family's call is fixed text around a function name and a JSON arguments object; the
grammar fixes all whitespace, so the parser reads exactly the text the grammar lets through.
"""

import hashlib
import json
import re
import secrets
import string
from dataclasses import dataclass, field, replace

from kvfence.engine.sampling_params import InvalidRequest

NAME = re.compile(r"[a-zA-Z0-9_-]{1,64}")
# JSON with fixed separators and no free whitespace: a model cannot fill max_tokens with spaces
JSON_STYLE = {"whitespace_flexible": False, "item_separator": ", ", "key_separator": ": "}
NO_PARAMETERS = {"type": "object", "properties": {}, "additionalProperties": False}
# Tags that some vocabularies hold as one added token, which llguidance only matches as a token
MARKERS = ("<tool_call>", "</tool_call>", "[TOOL_CALLS]", "<|python_tag|>")
RESPONSE_OPEN = '{"response": "'
JSON_STRING = r'/"(\\([\"\\\/bfnrt]|u[a-fA-F0-9]{4})|[^\"\\\x00-\x1F\x7F])*"/'
# a run of plain characters, or one complete escape (a surrogate pair counts as one)
STRING_PIECE = re.compile(
    r'[^"\\\x00-\x1f]+|\\u[dD][89abAB][0-9a-fA-F]{2}\\u[0-9a-fA-F]{4}'
    r'|\\u(?![dD][89abAB])[0-9a-fA-F]{4}|\\["\\/bfnrt]'
)
GENERIC_PROMPT = (
    "You can call these functions:\n{tools}\n\n"
    'Answer with one JSON object: {{"tool_calls": [{{"name": <function name>, "arguments": '
    '<arguments object>}}]}} to call functions, or {{"response": <your answer as a JSON string>}}.'
)
WAIT = "wait"  # not decided until more text arrives


@dataclass
class ToolCall:
    id: str
    name: str
    arguments: str  # the JSON text of the arguments object, exactly as generated


@dataclass
class ToolDelta:
    content: str = ""
    index: int | None = None
    id: str | None = None
    name: str | None = None
    arguments: str = ""


@dataclass(frozen=True)
class ToolFormat:
    """A family's calls read `before call_open NAME", "KEY": ARGS close (sep call_open ...)*
    after`, where ARGS is the arguments object."""

    name: str
    before: str = ""  # before the first call
    call_open: str = '{"name": "'  # before each call's name
    key: str = "arguments"
    close: str = "}"  # after the arguments object
    sep: str | None = ", "  # between calls; None where the family takes one call an answer
    after: str = ""  # after the last call
    trigger: str | None = None  # calls may follow text, from this tag on (it starts `first`)
    tag: str | None = None  # an optional tag before calls at the answer's start
    tokens: dict = field(default_factory=dict)  # marker -> its token id, where it is one token
    eos: tuple = ()  # end-of-sequence texts, ignored where they end the output

    @property
    def first(self) -> str:
        return self.before + self.call_open

    def new_call_id(self) -> str:
        if self.name == "mistral":  # its templates demand 9 alphanumerics
            return "".join(secrets.choice(string.ascii_letters + string.digits) for _ in range(9))
        return "call_" + secrets.token_hex(12)

    def parser(self) -> "ToolParser":
        return ToolParser(self)

    def render(self, messages: list[dict], tools: list[dict] | None):
        calls = {}  # call id -> function name, for the tool messages that answer them
        out = []
        for i, message in enumerate(messages):
            message = dict(message)
            if message.get("tool_calls"):
                message["tool_calls"] = [
                    _parsed_call(c, f"messages[{i}].tool_calls[{j}]", calls)
                    for j, c in enumerate(message["tool_calls"])
                ]
            if message["role"] == "tool" and message.get("tool_call_id") not in calls:
                raise InvalidRequest(
                    "a tool message must answer a tool call of an earlier assistant message",
                    f"messages[{i}].tool_call_id",
                )
            out.extend(self._message(message, calls))
        if self.name != "generic":
            return out, tools
        out = _join_user_turns(out)  # a tool result is a user turn now: keep turns alternating
        if tools:
            listed = "\n".join(json.dumps(t["function"], ensure_ascii=False) for t in tools)
            prompt = GENERIC_PROMPT.format(tools=listed)
            if out and out[0]["role"] == "system":
                out[0] = {**out[0], "content": out[0]["content"] + "\n\n" + prompt}
            else:
                out.insert(0, {"role": "system", "content": prompt})
        return out, None

    def _message(self, message: dict, calls: dict) -> list[dict]:
        """`message` as this family's template takes it: one message or several."""
        tool_calls = message.get("tool_calls")
        if self.name == "llama3" and tool_calls:  # its template takes one call a message
            return [{**message, "content": "", "tool_calls": [c]} for c in tool_calls]
        if self.name == "mistral":
            if tool_calls:
                message["tool_calls"] = [{**c, "id": _mistral_id(c["id"])} for c in tool_calls]
            if message["role"] == "tool":
                message["tool_call_id"] = _mistral_id(message["tool_call_id"])
        if self.name != "generic":
            return [message]
        if tool_calls:
            listed = [
                {"name": c["function"]["name"], "arguments": c["function"]["arguments"]}
                for c in tool_calls
            ]
            message = {
                "role": "assistant",
                "content": json.dumps({"tool_calls": listed}, ensure_ascii=False),
            }
        elif message["role"] == "tool":
            response = {"name": calls[message["tool_call_id"]], "content": message["content"]}
            message = {
                "role": "user",
                "content": json.dumps({"tool_response": response}, ensure_ascii=False),
            }
        return [message]

    def grammar(self, tools: list[dict], choice: str | dict, parallel: bool) -> str | None:
        if choice == "none":
            return None
        if isinstance(choice, dict):
            tools = [t for t in tools if t["function"]["name"] == choice["function"]["name"]]
        auto = choice == "auto"
        first = self.first[len(self.trigger) :] if auto and self.trigger else self.first
        call = f"fn {self._lit(self.close)}"
        more = f" ({self._lit(self.sep + self.call_open)} {call})*" if parallel and self.sep else ""
        rules = [
            f"start: {self._start(auto)}",
            f"calls: {self._lit(first)} {call}{more} {self._lit(self.after)}",
            "fn: " + " | ".join(f"fn_{i}" for i in range(len(tools))),
        ]
        for i, tool in enumerate(tools):
            function = tool["function"]
            parameters = function.get("parameters")
            schema = NO_PARAMETERS if parameters is None else {"type": "object", **parameters}
            schema = {**schema, "x-guidance": JSON_STYLE}
            head = f'{function["name"]}", "{self.key}": '
            rules.append(f"fn_{i}: {self._lit(head)} %json {json.dumps(schema)}")
        return "\n".join(rules)

    def _start(self, auto: bool) -> str:
        if not auto:
            return "calls"
        text = "\nTEXT: /(.|\\n)*/"
        if self.trigger in self.tokens:  # a token that free text cannot contain
            return f"TEXT | TEXT {self._lit(self.trigger)} calls{text}"
        if self.trigger:  # text until the tag, which then must start a call
            return f"TEXT | head calls\nhead[lazy]: TEXT {self._lit(self.trigger)}{text}"
        if self.tag:  # a call is the whole answer: free text must not start like one
            tagged = f" | {self._lit(self.tag)} calls" if self.tag in self.tokens else ""
            return f"PLAIN | calls{tagged}\nPLAIN: /([^{{](.|\\n)*)?/"
        return f'calls | "{{\\"response\\": " STRING "}}"\nSTRING: {JSON_STRING}'

    def _lit(self, text: str) -> str:
        """`text` as Lark: quoted strings, and token references for markers that are tokens."""
        parts = re.split("(" + "|".join(map(re.escape, self.tokens)) + ")", text)
        return " ".join(
            f"<[{self.tokens[p]}]>" if p in self.tokens else json.dumps(p)
            for p in (parts if self.tokens else [text])
            if p
        )


FAMILIES = {
    "qwen": ToolFormat(
        "qwen",
        call_open='<tool_call>\n{"name": "',
        close="}\n</tool_call>",
        sep="\n",
        trigger="<tool_call>",
    ),
    "mistral": ToolFormat("mistral", before="[TOOL_CALLS][", after="]", trigger="[TOOL_CALLS]"),
    # its template takes one call a message
    "llama3": ToolFormat("llama3", key="parameters", sep=None, tag="<|python_tag|>"),
    "generic": ToolFormat("generic", before='{"tool_calls": [', after="]}"),
}


def detect_format(chat_template: str | None, tokenizer, eos_token_ids=()) -> ToolFormat:
    """The tool format of the family whose chat template this is; the tokenizer tells which
    tags are one token, and the texts of the tokens generation stops on (`eos_token_ids`, or
    the tokenizer's end of sequence)."""
    template = chat_template or ""
    if "[TOOL_CALLS]" in template and "[ARGS]" not in template:  # [ARGS]: a later format
        family = "mistral"
    elif "<tool_call>" in template:
        family = "qwen"
    elif "<|start_header_id|>" in template and '"parameters"' in template:
        family = "llama3"
    else:
        family = "generic"
    added = tokenizer.get_added_vocab() if tokenizer is not None else {}
    eos = [tokenizer.decode([t]) for t in sorted(eos_token_ids)]
    if not eos and getattr(tokenizer, "eos_token", None):
        eos = [tokenizer.eos_token]
    return replace(
        FAMILIES[family], tokens={m: added[m] for m in MARKERS if m in added}, eos=tuple(eos)
    )


def check_tools(tools: list[dict], tool_choice, parallel_tool_calls: bool | None) -> None:
    names = set()
    for i, tool in enumerate(tools or []):
        where = f"tools[{i}]"
        if not isinstance(tool, dict) or tool.get("type") != "function":
            raise InvalidRequest("only tools of type 'function' are supported", f"{where}.type")
        function = tool.get("function")
        if not isinstance(function, dict):
            raise InvalidRequest("a tool needs its function object", f"{where}.function")
        name = function.get("name")
        if not isinstance(name, str) or not NAME.fullmatch(name):
            raise InvalidRequest(
                "a function name must be 1 to 64 of a-z, A-Z, 0-9, _ and -",
                f"{where}.function.name",
            )
        if name in names:
            raise InvalidRequest(f"two tools are named '{name}'", f"{where}.function.name")
        names.add(name)
        parameters = function.get("parameters")
        if parameters is None:
            continue
        if not isinstance(parameters, dict) or parameters.get("type", "object") != "object":
            raise InvalidRequest(
                "parameters must be a JSON schema of an object", f"{where}.function.parameters"
            )
        # the schema itself is checked where the grammar compiles, within its budgets
    if tool_choice in (None, "none", "auto"):
        pass
    elif tool_choice == "required" or _named(tool_choice):
        if not names:
            raise InvalidRequest("tool_choice needs tools to call", "tool_choice")
        if tool_choice != "required" and tool_choice["function"]["name"] not in names:
            raise InvalidRequest("tool_choice names a function not among the tools", "tool_choice")
    else:
        raise InvalidRequest(
            'tool_choice must be "none", "auto", "required" or '
            '{"type": "function", "function": {"name": ...}}',
            "tool_choice",
        )
    if parallel_tool_calls is not None and not isinstance(parallel_tool_calls, bool):
        raise InvalidRequest("parallel_tool_calls must be a boolean", "parallel_tool_calls")


class ToolParser:
    """Generated text -> content and tool calls. Streaming and whole answers take the same
    path; a decision waits until the text settles it, so the chunking never changes a result.
    A call counts once its text reaches the arguments: text that breaks off before stays
    content; where it breaks off later, the call keeps what came and the rest is content."""

    def __init__(self, fmt: ToolFormat):
        self.fmt = fmt
        self.content = ""
        self.calls: list[ToolCall] = []
        self._text = ""  # received, not decided yet
        self._state = "content" if fmt.trigger else "open"
        self._depth, self._in_string, self._escaped = 0, False, False
        self._out: list[ToolDelta] = []

    def feed(self, text: str) -> list[ToolDelta]:
        self._text += text
        return self._run(len(self._text) - _partial(self._text, self.fmt.eos), final=False)

    def finish(self) -> list[ToolDelta]:
        for eos in self.fmt.eos:
            if self._text.endswith(eos):
                self._text = self._text[: -len(eos)]
                break
        return self._run(len(self._text), final=True)

    def _run(self, end: int, final: bool) -> list[ToolDelta]:
        self._out = []
        while (n := getattr(self, "_" + self._state)(self._text[:end], final)) is not None:
            self._text, end = self._text[n:], end - n
        return self._out

    # Each state's step takes the visible text, returns how much it used (None: wait for more).
    def _content(self, buf: str, final: bool) -> int | None:
        i = buf.find(self.fmt.trigger)
        if i >= 0:
            self._say(buf[:i])
            self._state = "open"
            return i
        n = len(buf) - (0 if final else _partial(buf, (self.fmt.trigger,)))
        self._say(buf[:n])
        return n or None

    def _open(self, buf: str, final: bool) -> int | None:
        tagged = [self.fmt.tag + self.fmt.first] if self.fmt.tag else []
        found = self._header(buf, [self.fmt.first, *tagged], final)
        response = self.fmt.name == "generic" and _match(buf, RESPONSE_OPEN, final)
        if found not in (None, WAIT):
            return self._begin(*found)
        if response is True:
            self._state = "response"
            return len(RESPONSE_OPEN)
        return None if WAIT in (found, response) else self._broken()

    def _args(self, buf: str, final: bool) -> int | None:
        for j, ch in enumerate(buf):
            if self._escaped:
                self._escaped = False
            elif self._in_string:
                self._escaped, self._in_string = ch == "\\", ch != '"'
            elif ch == '"':
                self._in_string = True
            elif ch in "{[":
                self._depth += 1
            elif ch in "}]":
                self._depth -= 1
                if self._depth == 0:
                    self._say_arguments(buf[: j + 1])
                    self._state = "close"
                    return j + 1
        self._say_arguments(buf)
        return len(buf) or None

    def _close(self, buf: str, final: bool) -> int | None:
        return self._literal(buf, final, self.fmt.close, "next")

    def _next(self, buf: str, final: bool) -> int | None:
        openers = [self.fmt.sep + self.fmt.call_open] if self.fmt.sep else []
        found = self._header(buf, openers, final)
        if found not in (None, WAIT):
            return self._begin(*found)
        matched = WAIT if found is WAIT else _match(buf, self.fmt.after, final)
        if matched is WAIT:
            return None
        self._state = "trailing"
        return len(self.fmt.after) if matched else 0

    def _response(self, buf: str, final: bool) -> int | None:
        j = 0
        while j < len(buf) and self._state == "response":
            piece = STRING_PIECE.match(buf, j)
            if buf[j] == '"':
                self._state, j = "response_end", j + 1
            elif piece:
                self._say(_unescaped(piece.group()) if buf[j] == "\\" else piece.group())
                j = piece.end()
            elif buf[j] == "\\" and len(buf) - j < 12 and not final:
                break  # an escape still arriving
            else:
                self._state = "trailing"  # not JSON: the rest is plain text
        return j if j or self._state != "response" else None

    def _response_end(self, buf: str, final: bool) -> int | None:
        return self._literal(buf, final, "}", "trailing")

    def _trailing(self, buf: str, final: bool) -> int | None:
        self._say(buf)
        return len(buf) or None

    def _header(self, buf: str, openers: list[str], final: bool):
        """(name, length) of a call's text up to its arguments object, WAIT, or None."""
        result = None
        tail = f'", "{self.fmt.key}": {{'
        for opener in openers:
            if not buf.startswith(opener):
                result = WAIT if opener.startswith(buf) and not final else result
                continue
            name = re.match(r"[a-zA-Z0-9_-]*", buf[len(opener) :]).group()
            rest = buf[len(opener) + len(name) :]
            if NAME.fullmatch(name) and rest.startswith(tail):
                return name, len(opener) + len(name) + len(tail) - 1  # "{" opens the arguments
            if not final and len(name) <= 64 and (not rest or name and tail.startswith(rest)):
                result = WAIT
        return result

    def _begin(self, name: str, length: int) -> int:
        self.calls.append(ToolCall(self.fmt.new_call_id(), name, ""))
        self._out.append(ToolDelta(index=len(self.calls) - 1, id=self.calls[-1].id, name=name))
        self._state, self._depth, self._in_string, self._escaped = "args", 0, False, False
        return length

    def _literal(self, buf: str, final: bool, text: str, then: str) -> int | None:
        matched = _match(buf, text, final)
        if matched is WAIT:
            return None
        self._state = then
        return len(text) if matched else self._broken()

    def _broken(self) -> int:
        """Text that claims to be a call but is not one stays text, as does all that follows."""
        self._state = "trailing"
        return 0

    def _say(self, text: str) -> None:
        if not text:
            return
        self.content += text
        if self._out and self._out[-1].index is None:
            self._out[-1].content += text
        else:
            self._out.append(ToolDelta(content=text))

    def _say_arguments(self, text: str) -> None:
        if not text:
            return
        index = len(self.calls) - 1
        self.calls[index].arguments += text
        last = self._out[-1] if self._out else None
        if last and last.index == index and last.id is None:
            last.arguments += text
        else:
            self._out.append(ToolDelta(index=index, arguments=text))


def _parsed_call(call: dict, where: str, calls: dict) -> dict:
    """An OpenAI tool call of an assistant message, its arguments parsed into a dict."""
    function = call.get("function") if isinstance(call, dict) else None
    if not isinstance(function, dict) or not isinstance(function.get("name"), str):
        raise InvalidRequest("a tool call needs a function with a name", f"{where}.function")
    if not isinstance(call.get("id"), str):
        raise InvalidRequest("a tool call needs its id", f"{where}.id")
    try:
        arguments = json.loads(function.get("arguments"))
    except (TypeError, ValueError):
        arguments = None
    if not isinstance(arguments, dict):
        raise InvalidRequest("arguments must be a JSON object", f"{where}.function.arguments")
    try:  # JSON escapes may spell a lone surrogate, which no tokenizer takes
        json.dumps(arguments, ensure_ascii=False).encode("utf-8")
    except UnicodeEncodeError:
        raise InvalidRequest(
            "arguments are not valid Unicode (lone surrogate)", f"{where}.function.arguments"
        ) from None
    calls[call.get("id")] = function["name"]
    return {**call, "function": {"name": function["name"], "arguments": arguments}}


def _unescaped(escape: str) -> str:
    """A JSON escape's text; a surrogate escape with no pair (valid JSON, but no character)
    becomes U+FFFD, as a decoder does with bytes that are not UTF-8."""
    text = json.loads(f'"{escape}"')
    return text.encode("utf-16", "surrogatepass").decode("utf-16", "replace")


def _join_user_turns(messages: list[dict]) -> list[dict]:
    out = []
    for message in messages:
        if out and message["role"] == "user" == out[-1]["role"]:
            out[-1] = {**out[-1], "content": out[-1]["content"] + "\n\n" + message["content"]}
        else:
            out.append(message)
    return out


def _named(choice) -> bool:
    return (
        isinstance(choice, dict)
        and choice.get("type") == "function"
        and isinstance(choice.get("function"), dict)
        and isinstance(choice["function"].get("name"), str)
    )


def _mistral_id(call_id: str) -> str:
    """Mistral's templates take 9 alphanumerics; other ids map to such ones, the same each time."""
    if re.fullmatch(r"[a-zA-Z0-9]{9}", call_id):
        return call_id
    return hashlib.sha256(call_id.encode()).hexdigest()[:9]


def _match(buf: str, text: str, final: bool):
    if buf.startswith(text):
        return True
    return WAIT if text.startswith(buf) and not final else False


def _partial(text: str, markers) -> int:
    """The length of the longest end of `text` that may be the start of one of `markers`."""
    return max(
        (
            k
            for m in markers
            for k in range(1, min(len(m), len(text)) + 1)
            if m.startswith(text[-k:])
        ),
        default=0,
    )
