"""The options of `kvfence serve` beyond the engine's: listener (server/listener.py), keys,
limits, disaggregated roles.

Fields are declared as EngineConfig's are (kvfence.options.option): kvfence.cli makes the flags
and the README's flag table from them.
"""

from dataclasses import dataclass
from typing import Literal

from kvfence.config import ConfigError, check_choices
from kvfence.options import option
from kvfence.server.listener import Listener


@dataclass(kw_only=True)
class ServerConfig(Listener):
    api_keys: str | None = option(
        None,
        'JSON file {"KEY": "tenant"} or {"KEY": {"tenant": ..., limits}} (see Tenants in '
        "the README); every request then needs Authorization: Bearer KEY",
        metavar="FILE",
    )
    served_model_name: str | None = option(
        None, "model id clients send (default: the model file's name)", metavar="NAME"
    )
    max_pending: int = option(
        256,
        "sequences in flight (a request counts n per prompt) before 429 with Retry-After; "
        "a request of more sequences gets 400",
    )
    stream_stall_timeout: float = option(
        30.0,
        "seconds a streaming client may leave its output unread before its request is "
        "aborted and its pages freed",
        metavar="SECONDS",
    )
    grammar_timeout: float = option(
        5.0,
        "seconds a structured output's schema, grammar or tools may take to compile before "
        "the request is refused (400)",
        metavar="SECONDS",
    )
    metrics_host: str = option(
        "127.0.0.1", "address of the --metrics-port listener", metavar="HOST"
    )
    metrics_port: int | None = option(
        None,
        "serve /metrics on a listener of its own; the API port's /metrics then answers 404",
        metavar="PORT",
    )
    role: Literal["unified", "prefill", "decode"] = option(
        "unified",
        "unified serves the API; prefill and decode workers sit behind kvfence router",
    )
    kv_transfer_timeout: float = option(
        30.0, "decode role: seconds a KV pull may take", metavar="SECONDS"
    )
    park_timeout: float = option(
        60.0,
        "prefill role: seconds computed KV waits for a decode worker before it is freed",
        metavar="SECONDS",
    )
    internal_token_file: str | None = option(
        None,
        "file holding the cluster secret that router and workers share; every /internal/* "
        "call needs it (required for prefill and decode workers)",
        metavar="FILE",
    )

    def __post_init__(self) -> None:
        super().__post_init__()
        check_choices(self)
        if self.grammar_timeout <= 0:
            raise ConfigError(f"--grammar-timeout must be over 0, not {self.grammar_timeout}")
        if self.stream_stall_timeout <= 0:
            raise ConfigError(
                f"--stream-stall-timeout must be over 0, not {self.stream_stall_timeout}"
            )
        if self.role == "unified" and self.internal_token_file:
            raise ConfigError(
                "--internal-token-file is for prefill and decode workers (--role) and the router"
            )
