"""`kvfence generate`: one prompt's completion, printed."""

import sys
from dataclasses import MISSING, dataclass

from kvfence.config import EngineConfig
from kvfence.engine.sampling_params import SamplingParams
from kvfence.llm import LLM
from kvfence.options import option

# A completion asked for from a shell: greedy, with room for an answer (an API request's
# defaults are OpenAI's, 16 tokens at temperature 1).
SAMPLING_DEFAULTS = {"max_tokens": 128, "temperature": 0.0}


@dataclass
class GenerateOptions:
    prompt: str = option(MISSING, "the prompt", positional=True)
    chat: bool = option(False, "apply the model's chat template")


def run_generate(options: GenerateOptions, params: SamplingParams, config: EngineConfig) -> int:
    llm = LLM(**vars(config))
    if options.chat:
        result = llm.chat([{"role": "user", "content": options.prompt}], params)[0]
    else:
        result = llm.generate(options.prompt, params)[0]
    out = result.outputs[0]
    if out.error:
        print(f"error: {out.error}", file=sys.stderr)
        return 1
    print(out.text)
    return 0
