"""Offline API in the style of vLLM: LLM(model=...).generate(prompts, SamplingParams(...))."""

from dataclasses import dataclass, fields

from tqdm import tqdm

from kvfence.config import EngineConfig
from kvfence.engine.llm_engine import LLMEngine
from kvfence.engine.sampling_params import SamplingParams
from kvfence.model.tokenizer import apply_chat_template


@dataclass
class CompletionOutput:
    index: int
    text: str
    token_ids: list[int]
    finish_reason: str | None
    logprobs: list[dict]
    error: str | None = None


@dataclass
class GenerationOutput:
    request_id: str
    prompt: str | None
    prompt_token_ids: list[int]
    outputs: list[CompletionOutput]


class LLM:
    def __init__(self, model: str | None = None, **engine_args):
        known = {f.name for f in fields(EngineConfig)}
        unknown = set(engine_args) - known
        if unknown:
            raise TypeError(f"unknown engine arguments {sorted(unknown)}; known: {sorted(known)}")
        config, parts = EngineConfig(model=model, **engine_args), None
        if config.inject_fault:  # test-only; refused without KVFENCE_ALLOW_FAULTS=1
            from kvfence.testing.faults import inject

            parts = inject(config.inject_fault).parts
        self.engine = LLMEngine(config, parts=parts)
        self.tokenizer = self.engine.tokenizer

    def generate(
        self,
        prompts: str | list[str] | list[list[int]],
        sampling_params: SamplingParams | list | None = None,
        use_tqdm: bool = False,
    ) -> list[GenerationOutput]:
        if isinstance(prompts, str) or (prompts and isinstance(prompts[0], int)):
            prompts = [prompts]
        params = (
            sampling_params
            if isinstance(sampling_params, list)
            else [sampling_params or SamplingParams()] * len(prompts)
        )
        results: dict[str, GenerationOutput] = {}
        for i, (prompt, p) in enumerate(zip(prompts, params)):
            children = self.engine.add_request(prompt, p, request_id=f"offline-{i}-{id(results)}")
            rid = children[0].parent_id
            results[rid] = GenerationOutput(
                rid,
                prompt if isinstance(prompt, str) else None,
                children[0].prompt_token_ids,
                [None] * p.n,
            )
        bar = tqdm(
            total=sum(len(r.outputs) for r in results.values()),
            desc="generating",
            disable=not use_tqdm,
        )
        while self.engine.has_unfinished():
            for out in self.engine.step():
                if out.finished:
                    results[out.request_id].outputs[out.index] = CompletionOutput(
                        out.index,
                        out.text,
                        out.token_ids,
                        out.finish_reason,
                        out.logprobs,
                        out.error,
                    )
                    bar.update(1)
        bar.close()
        return list(results.values())

    def chat(
        self,
        messages: list[dict] | list[list[dict]],
        sampling_params: SamplingParams | None = None,
        use_tqdm: bool = False,
    ) -> list[GenerationOutput]:
        conversations = [messages] if messages and isinstance(messages[0], dict) else messages
        prompts = [
            self.engine.tokenize(apply_chat_template(self.tokenizer, c), templated=True)
            for c in conversations
        ]
        return self.generate(prompts, sampling_params, use_tqdm)
