"""The engine thread's bookkeeping of sequences in flight (--max-pending)."""

import asyncio

import pytest

from kvfence.config import EngineConfig
from kvfence.engine.llm_engine import LLMEngine
from kvfence.server.async_engine import AsyncEngine, Overloaded


def test_an_invalid_n_cannot_lift_max_pending(tiny_llama_dir):
    """A request's n is admission's to refuse; counted before that, a negative one must not
    take the count of sequences in flight below zero for the requests beside it."""
    engine = LLMEngine(
        EngineConfig(model=str(tiny_llama_dir), num_kv_pages=64, max_model_len=128),
        progress=False,
    )
    pending = AsyncEngine(engine, max_pending=4)

    async def run():
        poisoned = pending.open(1, -(10**9))
        pending.open(1, 3)
        with pytest.raises(Overloaded):
            pending.open(1, 1)
        poisoned.close()

    asyncio.run(run())
