"""The model the engine's options name, found, loaded and built."""

from pathlib import Path

import torch

from kvfence.config import EngineConfig
from kvfence.model.config import ModelConfig
from kvfence.model.gguf import open_gguf
from kvfence.model.kernels import linear_kernel
from kvfence.model.llama import LlamaModel
from kvfence.model.loader import has_gguf_blocks, load_model, resolve_model_path
from kvfence.model.memory import return_freed_heap


def build_model(config: EngineConfig, progress: bool) -> tuple[Path, ModelConfig, LlamaModel]:
    """Finds the model, settles what `auto` stands for, loads the weights in the layout
    --dtype asks for and completes the configuration from the model's own."""
    path = resolve_model_path(config.model)
    reader = open_gguf(path) if path.is_file() else None  # parsed once, for both uses
    blocks_run = (
        config.device == "cpu"
        and reader is not None
        and has_gguf_blocks(reader)
        and linear_kernel("cpu") is not None
    )
    config.resolve_auto(gguf_blocks_run=blocks_run)
    model_config, weights = load_model(
        path,
        progress,
        keep_blocks=config.keeps_blocks,
        int8=config.dtype == "gguf-int8",
        reader=reader,
    )
    config.resolve(model_config)
    dtype = torch.bfloat16 if config.dtype == "bfloat16" else torch.float32
    model = LlamaModel(
        model_config, weights, config.device, dtype, int8_activations=config.dtype == "gguf-int8"
    )
    return_freed_heap()  # the last layer's parts
    return path, model_config, model
