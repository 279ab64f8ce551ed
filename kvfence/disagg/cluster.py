"""`kvfence cluster`: N prefill and M decode workers plus a router on this machine, each a
`kvfence` process of its own, until interrupted."""

import logging
import os
import secrets
import subprocess
import sys
import tempfile
import time
from dataclasses import dataclass, fields

import httpx

from kvfence.options import option
from kvfence.server.listener import Listener

log = logging.getLogger("kvfence")
KVFENCE = [sys.executable, "-m", "kvfence.cli"]


@dataclass
class ClusterOptions:
    host: str = option("127.0.0.1", "address the router listens on", metavar="HOST")
    port: int = option(8000, "router port; workers take the next ports", metavar="PORT")
    prefill: int = option(1, "prefill workers")
    decode: int = option(1, "decode workers")
    threads_per_worker: int = option(1, "CPU threads of each worker (its --threads)")
    worker_args: list[str] = option(
        [], "kvfence serve flags of every worker, after --", positional=True
    )


def run_cluster(options: ClusterOptions) -> int:
    worker_args = options.worker_args
    if worker_args[:1] == ["--"]:
        worker_args = worker_args[1:]
    # The cluster's internal token, readable by this user only, removed when the cluster stops.
    fd, token_file = tempfile.mkstemp(prefix="kvfence-internal-token-")
    with os.fdopen(fd, "w") as f:
        f.write(secrets.token_urlsafe(32))
    procs, urls = [], {"prefill": [], "decode": []}
    port = options.port + 1
    for role, count in (("prefill", options.prefill), ("decode", options.decode)):
        for _ in range(count):
            urls[role].append(f"http://127.0.0.1:{port}")
            serve = ["serve", "--role", role, "--port", str(port)]
            serve += ["--internal-token-file", token_file]
            serve += ["--threads", str(options.threads_per_worker), *worker_args]
            procs.append(subprocess.Popen([*KVFENCE, *serve]))
            port += 1
    try:
        for url in urls["prefill"] + urls["decode"]:
            if not wait_healthy(url, procs):
                print("kvfence cluster: a worker exited during start-up", file=sys.stderr)
                return 1
        router = ["router", "--host", options.host, "--port", str(options.port)]
        router += ["--internal-token-file", token_file]
        router += [a for u in urls["prefill"] for a in ("--prefill", u)]
        router += [a for u in urls["decode"] for a in ("--decode", u)]
        router += shared_flags(worker_args)
        procs.append(subprocess.Popen([*KVFENCE, *router]))
        log.info(
            "cluster up: router on %s:%d, prefill %s, decode %s",
            options.host,
            options.port,
            urls["prefill"],
            urls["decode"],
        )
        procs[-1].wait()
    except KeyboardInterrupt:
        pass
    finally:
        for p in procs:
            p.terminate()
        for p in procs:
            p.wait(15)
        os.unlink(token_file)
    return 0


def shared_flags(worker_args: list[str]) -> list[str]:
    """The workers' flags the router takes too: the clients' keys, so that it refuses a bad
    key before reading a body, and the limits of its listener."""
    limits = {f.name for f in fields(Listener)} - {"host", "port"}
    shared = {"--api-keys"} | {"--" + name.replace("_", "-") for name in limits}
    taken = []
    for i, arg in enumerate(worker_args):
        if arg.split("=", 1)[0] in shared:
            taken += [arg] if "=" in arg else worker_args[i : i + 2]
    return taken


def wait_healthy(url: str, procs: list[subprocess.Popen]) -> bool:
    """Waits until `url` answers /health; False as soon as any process has exited."""
    while True:
        if any(p.poll() is not None for p in procs):
            return False
        try:
            if httpx.get(url + "/health", timeout=1).status_code == 200:
                return True
        except httpx.HTTPError:
            time.sleep(0.5)
