"""The OpenAI objects of a completion or chat request: the whole response, or its stream
chunks, with usage and logprobs."""

import time
import uuid
from collections.abc import Iterator

from kvfence.engine.output import RequestOutput
from kvfence.server.tools import ToolDelta, ToolFormat, ToolParser


class Responses:
    """Builds the objects of one request; a chat stream's builder remembers which choices
    have had their opening chunk, so each request takes a builder of its own."""

    def __init__(
        self,
        tokenizer,
        model: str,
        chat: bool,
        stream: bool,
        want_logprobs: bool,
        report_cached_tokens: bool,
        tools: ToolFormat | None = None,
    ):
        self.tokenizer, self.chat, self.want_logprobs = tokenizer, chat, want_logprobs
        self.tools = tools  # the format tool calls are parsed in, when tools may be called
        self._parsers: dict[int, ToolParser] = {}  # a stream's parser per choice
        self.report_cached_tokens = report_cached_tokens
        kind = "text_completion"
        if chat:
            kind = "chat.completion.chunk" if stream else "chat.completion"
        self.head = {
            "id": f"{'chatcmpl' if chat else 'cmpl'}-{uuid.uuid4().hex}",
            "object": kind,
            "created": int(time.time()),
            "model": model,
        }
        self._opened: set[int] = set()

    def usage(self, prompts: list[list[int]], completion_tokens: int, cached: int) -> dict:
        prompt_tokens = sum(len(p) for p in prompts)
        out = {
            "prompt_tokens": prompt_tokens,
            "completion_tokens": completion_tokens,
            "total_tokens": prompt_tokens + completion_tokens,
        }
        if self.report_cached_tokens:
            out["prompt_tokens_details"] = {"cached_tokens": cached}
        return out

    def response(self, prompts: list[list[int]], finals: dict[int, RequestOutput]) -> dict:
        """The whole response, from each choice's final output."""
        done = sorted(finals.items())
        if self.chat:
            choices = [
                {
                    "index": i,
                    **self.message(o),
                    "logprobs": self.chat_logprobs(o.logprobs) if self.want_logprobs else None,
                }
                for i, o in done
            ]
        else:
            choices = [
                {
                    "index": i,
                    "text": o.text,
                    "finish_reason": o.finish_reason,
                    "logprobs": self.completion_logprobs(o.logprobs, 0)
                    if self.want_logprobs
                    else None,
                }
                for i, o in done
            ]
        completion_tokens = sum(len(o.token_ids) for o in finals.values())
        cached = sum(o.num_cached_tokens for o in finals.values())
        usage = self.usage(prompts, completion_tokens, cached)
        return {**self.head, "choices": choices, "usage": usage}

    def message(self, out: RequestOutput) -> dict:
        """A chat choice's message and finish_reason; tool calls parsed out of its text."""
        if self.tools is None:
            return {
                "message": {"role": "assistant", "content": out.text},
                "finish_reason": out.finish_reason,
            }
        parser = self.tools.parser()
        parser.feed(out.text)
        parser.finish()
        message = {"role": "assistant", "content": parser.content or None}
        if parser.calls:
            message["tool_calls"] = [
                {
                    "id": c.id,
                    "type": "function",
                    "function": {"name": c.name, "arguments": c.arguments},
                }
                for c in parser.calls
            ]
        return {"message": message, "finish_reason": self.finish_reason(out, parser)}

    @staticmethod
    def finish_reason(out: RequestOutput, parser: ToolParser | None) -> str:
        if parser is not None and parser.calls and out.finish_reason == "stop":
            return "tool_calls"
        return out.finish_reason

    def chunks(self, index: int, out: RequestOutput) -> Iterator[dict]:
        """The stream chunks for one output of choice `index`."""
        for choice in (self._chat_choices if self.chat else self._completion_choices)(index, out):
            yield {**self.head, "choices": [choice]}

    def usage_chunk(self, prompts: list[list[int]], completion_tokens: int, cached: int) -> dict:
        return {
            **self.head,
            "choices": [],
            "usage": self.usage(prompts, completion_tokens, cached),
        }

    def _completion_choices(self, index: int, out: RequestOutput) -> Iterator[dict]:
        logprobs = self.completion_logprobs(out.delta_logprobs, 0) if out.delta_logprobs else None
        if out.delta_text or out.finished or logprobs:
            yield {
                "index": index,
                "text": out.delta_text,
                "logprobs": logprobs,
                "finish_reason": out.finish_reason if out.finished else None,
            }

    def _chat_choices(self, index: int, out: RequestOutput) -> Iterator[dict]:
        if index not in self._opened:
            self._opened.add(index)
            yield {
                "index": index,
                "delta": {"role": "assistant", "content": ""},
                "logprobs": None,
                "finish_reason": None,
            }
        wanted = self.want_logprobs and out.delta_logprobs
        logprobs = self.chat_logprobs(out.delta_logprobs) if wanted else None
        parser = None
        if self.tools is None:
            deltas = [{"content": out.delta_text}] if out.delta_text else []
        else:
            parser = self._parsers.setdefault(index, self.tools.parser())
            pieces = parser.feed(out.delta_text) + (parser.finish() if out.finished else [])
            deltas = [_delta(piece) for piece in pieces]
        if logprobs and not deltas:
            deltas = [{"content": ""}]
        for delta in deltas:
            yield {"index": index, "delta": delta, "logprobs": logprobs, "finish_reason": None}
            logprobs = None  # with the output's first chunk only
        if out.finished:
            yield {
                "index": index,
                "delta": {},
                "logprobs": None,
                "finish_reason": self.finish_reason(out, parser),
            }

    def token_text(self, token_id: int) -> str:
        return self.tokenizer.decode([token_id])

    def completion_logprobs(self, entries: list[dict], offset: int) -> dict:
        tokens = [self.token_text(e["token_id"]) for e in entries]
        offsets, pos = [], offset
        for t in tokens:
            offsets.append(pos)
            pos += len(t)
        return {
            "tokens": tokens,
            "token_logprobs": [e["logprob"] for e in entries],
            "top_logprobs": [{self.token_text(i): lp for i, lp in e["top"]} for e in entries],
            "text_offset": offsets,
        }

    def chat_logprobs(self, entries: list[dict]) -> dict:
        def item(token_id, logprob):
            text = self.token_text(token_id)
            return {
                "token": text,
                "logprob": logprob,
                "bytes": list(text.encode("utf-8")),
            }

        return {
            "content": [
                {
                    **item(e["token_id"], e["logprob"]),
                    "top_logprobs": [item(i, lp) for i, lp in e["top"]],
                }
                for e in entries
            ]
        }


def _delta(piece: ToolDelta) -> dict:
    """A stream chunk's delta: answer text, or a piece of a tool call as OpenAI streams it
    (index, id, type and name on the call's first piece, then its arguments in pieces)."""
    if piece.index is None:
        return {"content": piece.content}
    call = {"index": piece.index}
    if piece.id is not None:
        call |= {"id": piece.id, "type": "function"}
    function = {"arguments": piece.arguments}
    if piece.name is not None:
        function = {"name": piece.name} | function
    return {"tool_calls": [call | {"function": function}]}
