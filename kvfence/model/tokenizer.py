"""Tokenizer, chat template and incremental detokenization.

Tokenizers come from Hugging Face `transformers`: built from the GGUF metadata for a GGUF
file (then cached on disk, since that conversion takes seconds) or read from a model
directory.
"""

import hashlib
import os
from pathlib import Path

from tokenizers.decoders import DecodeStream
from transformers import AutoTokenizer, PreTrainedTokenizerBase

from kvfence.model.memory import return_freed_heap


def _cache_dir(path: Path) -> Path:
    stat = path.stat()
    key = hashlib.sha256(
        f"{path.resolve()}:{stat.st_size}:{stat.st_mtime_ns}".encode()
    ).hexdigest()[:16]
    root = Path(os.environ.get("KVFENCE_CACHE", Path.home() / ".cache" / "kvfence"))
    return root / "tokenizers" / key


def load_tokenizer(path: Path) -> PreTrainedTokenizerBase:
    tokenizer = _read_tokenizer(path)
    # reading a large vocabulary leaves its temporaries as freed heap in the process
    return_freed_heap()
    return tokenizer


def _read_tokenizer(path: Path) -> PreTrainedTokenizerBase:
    if path.is_dir():
        return AutoTokenizer.from_pretrained(str(path))
    cached = _cache_dir(path)
    if (cached / "tokenizer.json").is_file():
        return AutoTokenizer.from_pretrained(str(cached))
    tokenizer = AutoTokenizer.from_pretrained(str(path.parent), gguf_file=path.name)
    try:
        tokenizer.save_pretrained(str(cached))
    except OSError:
        pass  # a read-only home only costs the conversion next time
    return tokenizer


def encode(tokenizer: PreTrainedTokenizerBase, text: str, templated: bool = False) -> list[int]:
    """A raw prompt gets the special tokens the tokenizer adds (Llama's and Mistral's BOS), as
    transformers, vLLM and llama.cpp give it; text the chat template made (templated) already
    holds its own."""
    return tokenizer.encode(text, add_special_tokens=not templated)


def apply_chat_template(
    tokenizer: PreTrainedTokenizerBase, messages: list[dict], tools: list[dict] | None = None
) -> str:
    if not tokenizer.chat_template:
        raise ValueError("this model has no chat template; use the completions API")
    return tokenizer.apply_chat_template(
        messages, tools=tools, tokenize=False, add_generation_prompt=True
    )


class IncrementalDetokenizer:
    """Turns a growing list of token ids into text, never emitting half a UTF-8 character:
    `tokenizers`' DecodeStream, one native call a token. A few prompt tokens seed it so that
    tokenizers which drop a leading space decode the first token right."""

    def __init__(
        self,
        tokenizer: PreTrainedTokenizerBase,
        prompt_ids: list[int],
        skip_special_tokens: bool = True,
    ):
        self.backend = tokenizer.backend_tokenizer
        self.stream = DecodeStream(
            ids=list(prompt_ids[-5:]), skip_special_tokens=skip_special_tokens
        )

    def add(self, token_id: int) -> str:
        return self.stream.step(self.backend, token_id) or ""
