"""OpenAI request bodies, strictly typed, and their translation into SamplingParams."""

import types
from typing import Annotated, Literal, get_args

from pydantic import BaseModel, ConfigDict, Field, Strict, model_validator

from kvfence.engine.sampling_params import InvalidRequest, SamplingParams


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
        )

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


class ChatMessage(_Body):
    role: Literal["system", "user", "assistant", "developer"]
    content: str | list[ContentPart]
    name: str | None = None

    def text(self) -> str:
        if isinstance(self.content, str):
            return self.content
        return "".join(part.text for part in self.content)


class ChatCompletionRequest(_SamplingFields):
    messages: list[ChatMessage] = Field(min_length=1)
    max_tokens: int | None = None
    max_completion_tokens: int | None = None
    logprobs: bool = False
    top_logprobs: int | None = None
    tools: list[dict] | None = None
    tool_choice: str | dict | None = None
    functions: list[dict] | None = None
    response_format: dict | None = None

    def check_supported(self) -> None:
        super().check_supported()
        if (self.tools or self.functions) and self.tool_choice != "none":
            raise InvalidRequest(
                'tool calling is not supported; send no tools, or tool_choice: "none"',
                "tools" if self.tools else "functions",
            )
        kind = (self.response_format or {}).get("type", "text")
        if kind != "text":
            raise InvalidRequest(
                f"response_format '{kind}' is not supported; only 'text' is",
                "response_format",
            )

    def sampling_params(self) -> SamplingParams:
        max_tokens = (
            self.max_completion_tokens
            if self.max_completion_tokens is not None
            else self.max_tokens
        )
        logprobs = (self.top_logprobs or 0) if self.logprobs else None
        return self._params(max_tokens, logprobs)

    def conversation(self) -> list[dict]:
        return [
            {"role": "system" if m.role == "developer" else m.role, "content": m.text()}
            for m in self.messages
        ]


class TokenizeRequest(_Body):
    model: str | None = None
    prompt: str | None = None
    messages: list[ChatMessage] | None = None


class DetokenizeRequest(_Body):
    model: str | None = None
    tokens: list[int]
