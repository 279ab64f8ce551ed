"""OpenAI request bodies, strictly typed, and their translation into SamplingParams."""

import types
from typing import Annotated, Literal, get_args

from pydantic import BaseModel, ConfigDict, Field, Strict, model_validator

from kvfence.engine.sampling_params import InvalidRequest, SamplingParams, StructuredOutputs


class _Body(BaseModel):
    # Unknown fields are ignored, as OpenAI-compatible servers do; known ones are strictly typed.
    model_config = ConfigDict(strict=True, extra="ignore")

    @model_validator(mode="before")
    @classmethod
    def _null_is_not_given(cls, data):
        """Clients send null for a field they leave unset; a field with no meaning for null
        (n, stream, ...) then takes its default. Where null means something (max_tokens: no
        limit but the context), it stays."""
        if not isinstance(data, dict):
            return data
        fields = cls.model_fields
        return {
            k: v
            for k, v in data.items()
            if v is not None or k not in fields or types.NoneType in get_args(fields[k].annotation)
        }


class StreamOptions(_Body):
    include_usage: bool = False


class StructuredOutputsBody(_Body):
    """vLLM's and SGLang's form of a constraint: exactly one field."""

    json_: dict | str | None = Field(None, alias="json")
    json_object: bool | None = None
    regex: str | None = None
    choice: list[str] | None = None
    grammar: str | None = None

    def spec(self) -> StructuredOutputs:
        return StructuredOutputs(
            self.json_,
            bool(self.json_object),
            self.regex,
            self.choice,
            self.grammar,
            param="structured_outputs",
        )


class _SamplingFields(_Body):
    model: str
    n: int = 1
    temperature: float | None = None
    top_p: float | None = None
    top_k: int | None = None
    seed: int | None = None
    stop: str | list[str] | None = None
    stop_token_ids: list[int] | None = None
    ignore_eos: bool = False
    presence_penalty: float | None = None
    frequency_penalty: float | None = None
    repetition_penalty: float | None = None
    min_p: float | None = None
    # JSON object keys are strings: token ids arrive as "123"
    logit_bias: dict[Annotated[int, Strict(False)], float] | None = None
    stream: bool = False
    stream_options: StreamOptions | None = None
    user: str | None = None
    structured_outputs: StructuredOutputsBody | None = None

    def _params(self, max_tokens: int | None, logprobs: int | None) -> SamplingParams:
        stop = [self.stop] if isinstance(self.stop, str) else list(self.stop or [])
        return SamplingParams(
            n=self.n,
            max_tokens=max_tokens,
            temperature=1.0 if self.temperature is None else self.temperature,
            top_p=1.0 if self.top_p is None else self.top_p,
            top_k=-1 if self.top_k is None else self.top_k,
            seed=self.seed,
            stop=stop,
            stop_token_ids=list(self.stop_token_ids or []),
            ignore_eos=self.ignore_eos,
            presence_penalty=self.presence_penalty or 0.0,
            frequency_penalty=self.frequency_penalty or 0.0,
            repetition_penalty=1.0 if self.repetition_penalty is None else self.repetition_penalty,
            min_p=self.min_p or 0.0,
            logit_bias=dict(self.logit_bias or {}),
            logprobs=logprobs,
            structured_outputs=self.constraint(),
        )

    def constraint(self) -> StructuredOutputs | None:
        return self.structured_outputs.spec() if self.structured_outputs else None

    def check_supported(self) -> None:
        """Fields this server knows but does not implement fail loudly instead of being ignored."""
        if self.stream_options is not None and not self.stream:
            raise InvalidRequest(
                "stream_options is only allowed with stream: true", "stream_options"
            )


class CompletionRequest(_SamplingFields):
    prompt: str | list[str] | list[int] | list[list[int]]
    max_tokens: int | None = 16
    logprobs: int | None = None
    echo: bool = False
    best_of: int | None = None
    suffix: str | None = None

    def check_supported(self) -> None:
        super().check_supported()
        if self.echo:
            raise InvalidRequest("echo is not supported", "echo")
        if self.suffix:
            raise InvalidRequest("suffix is not supported", "suffix")
        if self.best_of is not None and self.best_of != self.n:
            raise InvalidRequest(
                "best_of is not supported; ask for n completions instead", "best_of"
            )

    def sampling_params(self) -> SamplingParams:
        return self._params(self.max_tokens, self.logprobs)


class ContentPart(_Body):
    type: Literal["text"]
    text: str


class FunctionCall(_Body):
    name: str
    arguments: str  # JSON text, as the API returned it


class ToolCallBody(_Body):
    id: str
    type: Literal["function"] = "function"
    function: FunctionCall


class ChatMessage(_Body):
    role: Literal["system", "user", "assistant", "developer", "tool"]
    content: str | list[ContentPart] | None = None
    name: str | None = None
    tool_calls: list[ToolCallBody] | None = None  # an assistant's calls, sent back
    tool_call_id: str | None = None  # a tool's answer: to which call

    @model_validator(mode="after")
    def _content_or_calls(self):
        if self.content is None and not (self.role == "assistant" and self.tool_calls):
            raise ValueError("content is required, except in an assistant message with tool_calls")
        if self.role == "tool" and not self.tool_call_id:
            raise ValueError("a tool message needs the tool_call_id it answers")
        return self

    def text(self) -> str:
        if self.content is None or isinstance(self.content, str):
            return self.content or ""
        return "".join(part.text for part in self.content)

    def as_dict(self) -> dict:
        out = {"role": "system" if self.role == "developer" else self.role, "content": self.text()}
        if self.tool_calls:
            out["tool_calls"] = [c.model_dump() for c in self.tool_calls]
        if self.tool_call_id is not None:
            out["tool_call_id"] = self.tool_call_id
        return out


class JsonSchemaFormat(_Body):
    name: str
    schema_: dict | bool = Field(alias="schema")
    description: str | None = None
    strict: bool | None = None


class ResponseFormat(_Body):
    type: Literal["text", "json_object", "json_schema"]
    json_schema: JsonSchemaFormat | None = None

    def spec(self) -> StructuredOutputs | None:
        if self.type == "json_object":
            return StructuredOutputs(json_object=True, param="response_format")
        if self.type == "json_schema":
            if self.json_schema is None:
                raise InvalidRequest(
                    "response_format json_schema needs its json_schema field",
                    "response_format.json_schema",
                )
            return StructuredOutputs(self.json_schema.schema_, param="response_format")
        return None


class ChatCompletionRequest(_SamplingFields):
    messages: list[ChatMessage] = Field(min_length=1)
    max_tokens: int | None = None
    max_completion_tokens: int | None = None
    logprobs: bool = False
    top_logprobs: int | None = None
    tools: list[dict] | None = None
    tool_choice: str | dict | None = None
    parallel_tool_calls: bool | None = None
    functions: list[dict] | None = None
    response_format: ResponseFormat | None = None

    def check_supported(self) -> None:
        super().check_supported()
        if self.functions:
            raise InvalidRequest("functions is not supported; send tools instead", "functions")
        given = [
            name
            for name, on in (
                ("response_format", self.response_format and self.response_format.type != "text"),
                ("structured_outputs", self.structured_outputs is not None),
                ("tools", self.tool_mode() != "none"),
            )
            if on
        ]
        if len(given) > 1:
            raise InvalidRequest(f"send one of {' and '.join(given)}, not both", given[1])

    def tool_mode(self) -> str | dict:
        """none, auto, required or a named function: what the answer may call."""
        if not self.tools:
            return "none"
        return "auto" if self.tool_choice is None else self.tool_choice

    def constraint(self) -> StructuredOutputs | None:
        if self.response_format is not None:
            return self.response_format.spec()
        return super().constraint()

    def sampling_params(self) -> SamplingParams:
        max_tokens = (
            self.max_completion_tokens
            if self.max_completion_tokens is not None
            else self.max_tokens
        )
        logprobs = (self.top_logprobs or 0) if self.logprobs else None
        return self._params(max_tokens, logprobs)

    def conversation(self) -> list[dict]:
        return [m.as_dict() for m in self.messages]


class TokenizeRequest(_Body):
    model: str | None = None
    prompt: str | None = None
    messages: list[ChatMessage] | None = None


class DetokenizeRequest(_Body):
    model: str | None = None
    tokens: list[int]
