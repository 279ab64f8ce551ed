"""`kvfence serve --role prefill|decode`: the server of server/app.py, plus the worker's
internal routes behind the cluster's token and its KV transport."""

from fastapi import FastAPI

from kvfence.config import EngineConfig
from kvfence.disagg import (
    WORKER_KEEPALIVE_S,
    decode,
    prefill,
    read_internal_token,
    require_internal_token,
    worker_client,
)
from kvfence.disagg.transfer import KVTransfer
from kvfence.engine.llm_engine import EngineParts
from kvfence.server.api import Server
from kvfence.server.app import injected_fault, run_server
from kvfence.server.options import ServerConfig


def run_serve(options: ServerConfig, config: EngineConfig) -> int:
    """`kvfence serve`: a worker under --role prefill or decode, else the unified server."""
    if options.role == "unified":
        return run_server(options, config)
    token = read_internal_token(options.internal_token_file, f"kvfence serve --role {options.role}")
    fault = injected_fault(config)
    parts = fault.parts if fault else EngineParts()
    transfer = fault.transfer_class(KVTransfer) if fault else KVTransfer

    def on_built(app: FastAPI, server: Server) -> None:
        app.state.transfer = transfer(server.engine.pool, f"kvfence-{options.role}-{options.port}")
        app.state.http = worker_client(token)

    def extend(app: FastAPI) -> None:
        require_internal_token(app, token)
        if options.role == "prefill":
            prefill.add_routes(app, options.park_timeout)
        else:
            decode.add_routes(app, options.kv_transfer_timeout)

    return run_server(
        options,
        config,
        parts,
        on_built,
        extend,
        timeout_keep_alive=WORKER_KEEPALIVE_S,
    )
