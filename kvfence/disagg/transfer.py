"""KV transfer over NIXL (UCX backend): the decode side reads the pages the prefill side wrote.

Each side registers its whole K and V pool tensors once. A transfer moves, for every
layer, K and V of each page, only the slots that hold this request's tokens; stale slots
past the last token never leave the prefill node. The manifest travels separately (HTTP)
and carries a CRC32 per page, so the receiver can prove it holds exactly what was sent.
"""
import base64
import os
import threading
import time
import zlib
from dataclasses import dataclass

import torch

from kvfence.kv.pool import KVPool


class TransferError(RuntimeError):
    pass


@dataclass
class Manifest:
    transfer_id: str
    token_count: int
    page_size: int
    page_count: int
    dtype: str
    num_layers: int
    kv_heads: int
    head_dim: int
    checksums: list[int]
    agent_name: str
    agent_metadata: str  # base64
    descs: list[list[int]]  # (address, bytes, device) per (K/V, layer, page), in that order

    def to_dict(self) -> dict:
        return dict(vars(self))


def page_spans(token_count: int, page_size: int) -> list[int]:
    """Written slots in each page of a request holding `token_count` tokens."""
    full, rest = divmod(token_count, page_size)
    return [page_size] * full + ([rest] if rest else [])


class KVTransfer:
    def __init__(self, pool: KVPool, name: str | None = None):
        if pool.k.device.type != "cpu":
            raise TransferError("disaggregated workers keep their KV pool in host memory: run them with --device cpu")
        from nixl._api import nixl_agent, nixl_agent_config

        self.pool = pool
        self.name = name or f"kvfence-{os.getpid()}-{id(self):x}"
        # No progress thread: it spins a core while idle; the puller drives progress by polling.
        self.agent = nixl_agent(self.name, nixl_agent_config(enable_prog_thread=False, backends=["UCX"]))
        self.agent.register_memory([pool.k, pool.v])
        self.slot_bytes = pool.k.shape[2] * pool.k.shape[3] * pool.k.element_size()
        self.layer_stride = pool.k.shape[1] * self.slot_bytes
        self.metadata = base64.b64encode(self.agent.get_agent_metadata()).decode()
        self._remotes: dict[str, str] = {}  # metadata -> agent name, loaded once per peer incarnation
        self._lock = threading.Lock()  # the agent runs without its own thread synchronisation
        self._expected: dict[str, float] = {}  # transfer id -> deadline, on the sending side
        self._wake = threading.Event()
        self.on_pulled = None  # sending side: called with a transfer id once its reader is done

    def expect(self, transfer_id: str, timeout: float) -> None:
        """Sending side: a reader will pull `transfer_id`. Without a progress thread the
        transport moves data only while this side polls, so poll until it is done."""
        with self._lock:
            self._expected[transfer_id] = time.monotonic() + timeout
            self._wake.set()
            if not getattr(self, "_pump", None):
                self._pump = threading.Thread(target=self._poll, name="kvfence-transfer", daemon=True)
                self._pump.start()

    def _poll(self) -> None:
        while True:
            self._wake.wait()
            with self._lock:
                notes = self.agent.get_new_notifs()
                now = time.monotonic()
                done = [msg.decode() for msgs in notes.values() for msg in msgs]
                for tid in done + [t for t, deadline in self._expected.items() if deadline < now]:
                    self._expected.pop(tid, None)
                if not self._expected:
                    self._wake.clear()
            for tid in done:
                if self.on_pulled:
                    self.on_pulled(tid)
            time.sleep(0.001)

    def address(self, tensor: torch.Tensor, layer: int, slot: int) -> int:
        return tensor.data_ptr() + layer * self.layer_stride + slot * self.slot_bytes

    def descs(self, pages: list[int], token_count: int) -> list[list[int]]:
        """(address, bytes, device) of each page's written slots, for K then V, layer by layer."""
        spans = page_spans(token_count, self.pool.page_size)
        return [[self.address(tensor, layer, page * self.pool.page_size), slots * self.slot_bytes, 0]
                for tensor in (self.pool.k, self.pool.v) for layer in range(tensor.shape[0])
                for page, slots in zip(pages, spans)]

    def checksums(self, pages: list[int], token_count: int) -> list[int]:
        """CRC32 of each page's written slots, K then V, layer by layer (read in place)."""
        ps = self.pool.page_size
        k, v = self.pool.k.view(torch.uint8).numpy(), self.pool.v.view(torch.uint8).numpy()  # numpy has no bf16
        sums = []
        for page, slots in zip(pages, page_spans(token_count, ps)):
            crc = 0
            for tensor in (k, v):
                for layer in tensor:
                    crc = zlib.crc32(layer[page * ps:page * ps + slots], crc)
            sums.append(crc)
        return sums

    def manifest(self, transfer_id: str, pages: list[int], token_count: int) -> Manifest:
        k = self.pool.k
        return Manifest(transfer_id, token_count, self.pool.page_size, len(page_spans(token_count, self.pool.page_size)),
                        str(k.dtype).removeprefix("torch."), k.shape[0], k.shape[2], k.shape[3],
                        self.checksums(pages, token_count), self.name, self.metadata, self.descs(pages, token_count))

    def read(self, manifest: Manifest, pages: list[int], timeout: float) -> float:
        """Pulls the manifest's pages into `pages` of our pool; returns seconds spent."""
        if not manifest.descs:
            return 0.0
        with self._lock:
            try:
                remote_name = self._remote(manifest)
                local, remote = coalesce(self.descs(pages, manifest.token_count), manifest.descs)
                local = self.agent.get_xfer_descs(local, "DRAM")
                remote = self.agent.get_xfer_descs(remote, "DRAM")
                start = time.monotonic()
                handle = self.agent.initialize_xfer("READ", local, remote, remote_name,
                                                    manifest.transfer_id.encode())
                try:
                    state = self.agent.transfer(handle)
                    while state == "PROC":
                        if time.monotonic() - start > timeout:
                            raise TransferError(f"KV transfer did not finish within {timeout} s")
                        time.sleep(0.0005)
                        state = self.agent.check_xfer_state(handle)
                finally:
                    self.agent.release_xfer_handle(handle)
            except TransferError:
                raise
            except Exception as e:  # noqa: BLE001 - NIXL's errors share no base class
                raise TransferError(f"transport error: {type(e).__name__}: {e}") from None
        if state != "DONE":
            raise TransferError("KV transfer failed in the transport (peer gone?)")
        elapsed = time.monotonic() - start
        if elapsed > timeout:
            raise TransferError(f"KV transfer took {elapsed:.3f} s, over the {timeout} s limit")
        return elapsed

    def _remote(self, manifest: Manifest) -> str:
        name = self._remotes.get(manifest.agent_metadata)
        if name is None:
            stale = [m for m, n in self._remotes.items() if n == manifest.agent_name]
            for m in stale:  # the peer restarted under the same name
                self.agent.remove_remote_agent(self._remotes.pop(m))
            name = self.agent.add_remote_agent(base64.b64decode(manifest.agent_metadata))
            self._remotes[manifest.agent_metadata] = name
        return name


def coalesce(local: list[list[int]], remote: list[list[int]]) -> tuple[list[tuple], list[tuple]]:
    """Merges neighbouring regions that are contiguous on both sides (runs of adjacent
    pages), so a transfer posts a few large regions instead of one per page and layer."""
    if len(local) != len(remote):
        raise TransferError(f"{len(remote)} remote regions for {len(local)} local ones")
    out_local, out_remote = [], []
    for (la, ln, ld), (ra, rn, rd) in zip(local, remote):
        if ln != rn:
            raise TransferError(f"a remote region of {rn} bytes for a local one of {ln}")
        if out_local and out_local[-1][0] + out_local[-1][1] == la and out_remote[-1][0] + out_remote[-1][1] == ra:
            out_local[-1][1] += ln
            out_remote[-1][1] += rn
        else:
            out_local.append([la, ln, ld])
            out_remote.append([ra, rn, rd])
    return [tuple(d) for d in out_local], [tuple(d) for d in out_remote]


def verify(manifest: Manifest, expected_tokens: int, pool: KVPool, received_checksums) -> None:
    """Checks a manifest against what the receiver reserved; raises TransferError naming the mismatch."""
    k = pool.k
    mine = {"page_size": pool.page_size, "dtype": str(k.dtype).removeprefix("torch."), "num_layers": k.shape[0],
            "kv_heads": k.shape[2], "head_dim": k.shape[3]}
    for key, value in mine.items():
        if getattr(manifest, key) != value:
            raise TransferError(f"manifest {key} is {getattr(manifest, key)}, this worker has {value}")
    if manifest.token_count != expected_tokens:
        raise TransferError(f"manifest carries {manifest.token_count} tokens, {expected_tokens} were expected")
    pages = len(page_spans(expected_tokens, pool.page_size))
    if manifest.page_count != pages or len(manifest.checksums) != pages or len(manifest.descs) != 2 * k.shape[0] * pages:
        raise TransferError(f"manifest describes {manifest.page_count} pages / {len(manifest.descs)} regions, "
                            f"{pages} pages were expected")
    if received_checksums is not None:
        bad = [i for i, (a, b) in enumerate(zip(manifest.checksums, received_checksums)) if a != b]
        if bad:
            raise TransferError(f"checksum mismatch on {len(bad)} of {pages} pages (first: page {bad[0]})")


def manifest_from_dict(d: dict) -> Manifest:
    try:
        return Manifest(**d)
    except TypeError as e:
        raise TransferError(f"malformed manifest: {e}") from None

