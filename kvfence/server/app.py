"""`kvfence serve`: the server assembled from its options and run."""

import logging
import os
import sys
from collections.abc import Callable

from fastapi import FastAPI

from kvfence.config import ConfigError, EngineConfig
from kvfence.engine.llm_engine import EngineParts, LLMEngine
from kvfence.engine.sampling_params import InvalidRequest
from kvfence.model.config import ModelLoadError
from kvfence.model.loader import resolve_model_path
from kvfence.server.api import Server, create_app
from kvfence.server.auth import ApiKeys
from kvfence.server.listener import serve
from kvfence.server.options import ServerConfig

log = logging.getLogger("kvfence.server")


def injected_fault(config: EngineConfig):
    """The test-only fault the configuration names (kvfence.testing.faults), or None; refused
    unless KVFENCE_ALLOW_FAULTS=1, announced loudly."""
    if not config.inject_fault:
        return None
    from kvfence.testing.faults import inject

    return inject(config.inject_fault)


def run_server(
    options: ServerConfig,
    config: EngineConfig,
    parts: EngineParts | None = None,
    on_built: Callable[[FastAPI, Server], None] | None = None,
    extend: Callable[[FastAPI], None] | None = None,
    **uvicorn_options,
) -> int:
    """Checks what can be checked before the model loads, then serves until interrupted. The
    engine is built in the app's startup; a worker (disagg/worker.py) adds its routes
    (`extend`) and its transport once the engine is there (`on_built`)."""
    keys = ApiKeys.from_file(options.api_keys) if options.api_keys else ApiKeys()
    if options.public and not keys.enabled:
        log.warning(
            "WARNING: serving on %s without API keys: anyone who can reach this address "
            "can use the model. Pass --api-keys FILE.",
            options.host,
        )
    if parts is None:
        fault = injected_fault(config)
        parts = fault.parts if fault else EngineParts()
    resolve_model_path(config.model)  # a bad path fails here, before the server starts

    def build() -> Server:
        engine = LLMEngine(config, parts=parts)
        server = Server(
            engine,
            keys,
            options.served_model_name,
            options.max_pending,
            options,
            stream_stall_timeout=options.stream_stall_timeout,
            grammar_timeout=options.grammar_timeout,
            report_cached_tokens=keys.enabled or not options.public,
        )
        if options.metrics_port is not None:
            server.metrics.serve(options.metrics_host, options.metrics_port)
            log.info("metrics on http://%s:%d/metrics", options.metrics_host, options.metrics_port)
        if on_built:
            on_built(app, server)
        log.info(
            "%s on http://%s:%d: %s", options.role, options.host, options.port, engine.describe()
        )
        return server

    def build_or_exit() -> Server:
        """build() in the app's startup, where uvicorn would print a refusal as its own
        traceback: the line main prints instead, and the process ends before a port opens."""
        try:
            return build()
        except Exception as e:
            line = refusal_line(e)
            if line is None:
                raise
            print(line, file=sys.stderr, flush=True)
            os._exit(2)

    app = create_app(build_or_exit, role=options.role, serve_metrics=options.metrics_port is None)
    if extend:
        extend(app)
    serve(app, options, **uvicorn_options)
    return 0


def refusal_line(e: Exception) -> str | None:
    """A configuration or load error as the one line it is printed as, not a traceback; None
    for any other exception."""
    if isinstance(e, ConfigError):
        return f"kvfence: configuration error: {e}"
    if isinstance(e, (ModelLoadError, InvalidRequest, ValueError)):
        return f"kvfence: {e}"
    return None
