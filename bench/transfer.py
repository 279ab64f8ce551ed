"""KV transfer throughput: kvfence's paged path against NIXL's raw two-process READ.

    python bench/transfer.py --tokens 512,2048 --repeats 7

Both sides are real processes on this machine with NIXL's UCX backend over CPU memory.
"raw" moves the same number of bytes as one contiguous region; "kvfence" moves the pages
of a request (one region per page, layer, K/V, as the decode worker does) and is also
timed with the receiver's per-page checksum verification.
"""

import argparse
import multiprocessing as mp
import queue
import statistics
import time

import torch

from common import machine_line
from kvfence.audit.capacity import kv_bytes_per_token
from kvfence.disagg.transfer import KVTransfer, verify
from kvfence.kv.pool import KVPool
from kvfence.model.config import ModelConfig

SMOLLM2 = ModelConfig("llama", 49152, 576, 1536, 30, 9, 3, 64, 1e5, 1e-5, 8192, True)


def pages_for(tokens: int, page_size: int, seed: int, scattered: bool) -> list[int]:
    """Pages as a fresh pool hands them out (one run), or scattered at random (a busy pool)."""
    count = -(-tokens // page_size)
    if not scattered:
        return list(range(seed * 1024, seed * 1024 + count))
    g = torch.Generator().manual_seed(seed)
    return torch.randperm(4096, generator=g)[:count].tolist()


def sender(conn, tokens_list: list[int], page_size: int) -> None:
    torch.set_num_threads(1)
    from nixl._api import nixl_agent, nixl_agent_config

    pool = KVPool(SMOLLM2, 4096, page_size)
    pool.k.normal_()
    pool.v.normal_()
    ours = KVTransfer(pool, "bench-sender")
    raw_agent = nixl_agent(
        "bench-raw-sender",
        nixl_agent_config(enable_prog_thread=False, backends=["UCX"]),
    )
    buffers = {
        tokens: torch.randn(tokens * kv_bytes_per_token(SMOLLM2, 4) // 4) for tokens in tokens_list
    }
    for buf in buffers.values():
        raw_agent.register_memory(buf)
    for tokens, buf in buffers.items():
        manifests = [
            ours.manifest(f"t{tokens}-{s}", pages_for(tokens, page_size, 1, s), tokens)
            for s in (False, True)
        ]
        conn.send(
            (
                tokens,
                manifests,
                raw_agent.get_agent_metadata(),
                raw_agent.get_serialized_descs(raw_agent.get_xfer_descs(buf)),
            )
        )
    # The transport moves data only while this side polls (no progress thread), as a
    # prefill worker does while KV is parked for pulling.
    while not conn.poll():
        raw_agent.get_new_notifs()
        ours.agent.get_new_notifs()
        time.sleep(0.001)


def receiver(conn, tokens_list: list[int], page_size: int, repeats: int, out) -> None:
    torch.set_num_threads(1)
    from nixl._api import nixl_agent, nixl_agent_config

    pool = KVPool(SMOLLM2, 4096, page_size)
    ours = KVTransfer(pool, "bench-receiver")
    raw_agent = nixl_agent(
        "bench-raw-receiver",
        nixl_agent_config(enable_prog_thread=False, backends=["UCX"]),
    )
    for _ in tokens_list:
        tokens, manifests, raw_meta, raw_descs = conn.recv()
        nbytes = tokens * kv_bytes_per_token(SMOLLM2, 4)
        local = torch.empty(nbytes // 4)
        raw_agent.register_memory(local)
        remote_name = raw_agent.add_remote_agent(raw_meta)
        remote = raw_agent.deserialize_descs(raw_descs)
        times = {
            "raw": [],
            "run": [],
            "run+verify": [],
            "scattered": [],
            "scattered+verify": [],
        }
        stalls = 0
        for _ in range(repeats):
            while True:  # a raw READ was seen to stall now and then; count it and post it again
                t = time.perf_counter()
                h = raw_agent.initialize_xfer(
                    "READ", raw_agent.get_xfer_descs(local), remote, remote_name
                )
                state = raw_agent.transfer(h)
                while state == "PROC" and time.perf_counter() - t < 5:
                    state = raw_agent.check_xfer_state(h)
                if state == "DONE":
                    times["raw"].append(time.perf_counter() - t)
                    raw_agent.release_xfer_handle(h)
                    break
                stalls += 1
                if stalls > 5:
                    raise RuntimeError(f"raw NIXL READ of {tokens} tokens stalled {stalls} times")
            for name, manifest, scattered in (
                ("run", manifests[0], False),
                ("scattered", manifests[1], True),
            ):
                pages = pages_for(tokens, page_size, 2, scattered)
                t = time.perf_counter()
                ours.read(manifest, pages, time.monotonic() + 60)
                times[name].append(time.perf_counter() - t)
                t = time.perf_counter()
                ours.read(manifest, pages, time.monotonic() + 60)
                verify(manifest, tokens, pool, ours.checksums(pages, tokens))
                times[name + "+verify"].append(time.perf_counter() - t)
        out.put(
            {
                "tokens": tokens,
                "bytes": nbytes,
                "raw_stalls": stalls,
                **{k: nbytes / statistics.median(v) / 1e9 for k, v in times.items()},
            }
        )
    conn.send("done")


def next_result(out, procs, timeout: float = 600) -> dict:
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        try:
            return out.get(timeout=1)
        except queue.Empty:
            dead = [p for p in procs if p.exitcode not in (None, 0)]
            if dead:
                raise SystemExit(f"{dead[0].name} died with exit code {dead[0].exitcode}") from None
    raise SystemExit(f"no result within {timeout} s")


def main() -> None:
    ap = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    ap.add_argument("--tokens", default="512,2048")
    ap.add_argument("--page-size", type=int, default=16)
    ap.add_argument("--repeats", type=int, default=7)
    args = ap.parse_args()
    tokens = [int(t) for t in args.tokens.split(",")]
    print(
        f"machine: {machine_line()}; SmolLM2 KV, page size {args.page_size}, "
        f"median of {args.repeats}"
    )
    names = ["raw", "run", "run+verify", "scattered", "scattered+verify"]
    print(
        "GB/s; 'run': pages in one run as a fresh pool gives them; 'scattered': random pages; "
        "'+verify': with the receiver's checksums"
    )
    print(
        f"{'tokens':>7} {'MB':>7} "
        + " ".join(f"{n:>17}" for n in names)
        + "   run/raw  scattered/raw",
        flush=True,
    )
    ctx = mp.get_context("spawn")
    # A fresh pair of processes per size: with two buffers registered in one raw agent,
    # its READs were seen to stall (NIXL 1.5.1, UCX, CPU memory).
    for size in tokens:
        a, b = ctx.Pipe()
        out = ctx.Queue()
        procs = [
            ctx.Process(target=sender, args=(a, [size], args.page_size), name="sender"),
            ctx.Process(
                target=receiver,
                args=(b, [size], args.page_size, args.repeats, out),
                name="receiver",
            ),
        ]
        for p in procs:
            p.start()
        try:
            r = next_result(out, procs)
            print(
                f"{r['tokens']:>7} {r['bytes'] / 1e6:>7.1f} "
                + " ".join(f"{r[n]:>17.2f}" for n in names)
                + f"   {r['run'] / r['raw']:7.2f}  {r['scattered'] / r['raw']:13.2f}"
                + (
                    f"  ({r['raw_stalls']} raw READs stalled over 5 s and were posted again)"
                    if r["raw_stalls"]
                    else ""
                ),
                flush=True,
            )
        finally:
            for p in procs:
                p.join(60)
                if p.is_alive():
                    p.kill()


if __name__ == "__main__":
    main()
