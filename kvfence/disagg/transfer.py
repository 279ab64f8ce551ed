"""KV transfer over NIXL (UCX backend): the decode side reads the pages the prefill side wrote.

Each side registers its whole K and V pool tensors once. A transfer moves, for every
layer, K and V of each page, only the slots that hold this request's tokens; stale slots
past the last token never leave the prefill node. The manifest travels separately (HTTP,
between token-holding workers only: it names the pool's addresses) and carries a CRC32 per
page, so the receiver can prove it holds exactly what was sent.
"""

import base64
import logging
import os
import threading
import time
import zlib

import torch
from pydantic import ConfigDict, ValidationError
from pydantic.dataclasses import dataclass

from kvfence.kv.pool import KVPool

POLL_S = 0.0005
log = logging.getLogger("kvfence.transfer")


class TransferError(RuntimeError):
    pass


@dataclass(config=ConfigDict(strict=True, extra="forbid"))
class Manifest:
    """What a decode worker needs to pull one parked prompt; validated field by field, since
    it arrives over the network."""

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
    lease_s: float = 0.0  # seconds the sender keeps the pages, from when it sent this

    def to_dict(self) -> dict:
        return dict(vars(self))


def page_spans(token_count: int, page_size: int) -> list[int]:
    """Written slots in each page of a request holding `token_count` tokens."""
    full, rest = divmod(token_count, page_size)
    return [page_size] * full + ([rest] if rest else [])


class KVTransfer:
    def __init__(self, pool: KVPool, name: str | None = None):
        if pool.k.device.type != "cpu":
            raise TransferError(
                "disaggregated workers keep their KV pool in host memory: "
                "run them with --device cpu"
            )
        from nixl._api import nixl_agent, nixl_agent_config, nixl_thread_sync_t

        self.pool = pool
        self.name = name or f"kvfence-{os.getpid()}-{id(self):x}"
        # No progress thread: it spins a core while idle; the puller drives progress by
        # polling. RW sync lets transfers from several threads (one per peer) run at once.
        config = nixl_agent_config(
            enable_prog_thread=False,
            backends=["UCX"],
            sync_mode=nixl_thread_sync_t.NIXL_THREAD_SYNC_RW,
        )
        self.agent = nixl_agent(self.name, config)
        self.agent.register_memory([pool.k, pool.v])
        self.slot_bytes = pool.k.shape[2] * pool.k.shape[3] * pool.k.element_size()
        self.layer_stride = pool.k.shape[1] * self.slot_bytes
        self.metadata = base64.b64encode(self.agent.get_agent_metadata()).decode()
        self._remotes: dict[
            str, str
        ] = {}  # metadata -> agent name, loaded once per peer incarnation
        self._lock = threading.Lock()  # guards the two dicts, never held during a transfer
        self._expected: dict[str, float] = {}  # transfer id -> deadline, on the sending side
        self._wake = threading.Event()
        self._pump = None
        self.on_pulled = None  # sending side: called with a transfer id once its reader is done

    def expect(self, transfer_id: str, deadline: float) -> None:
        """Sending side: a reader will pull `transfer_id` before `deadline` (monotonic). Without
        a progress thread the transport moves data only while this side polls, so poll until
        it is done."""
        with self._lock:
            self._expected[transfer_id] = deadline
            self._wake.set()
            if self._pump is None:
                self._pump = threading.Thread(
                    target=self._poll, name="kvfence-transfer", daemon=True
                )
                self._pump.start()

    def _poll(self) -> None:
        while True:
            self._wake.wait()
            try:
                self._take_notifications()
            except Exception:  # the thread outlives any one bad notification or callback
                log.exception("KV transfer notifications: polling failed")
                time.sleep(1)
            time.sleep(0.001)

    def _take_notifications(self) -> None:
        """Readers' notifications that they are done: only a transfer expected here counts,
        whatever else a peer sends."""
        notes = self.agent.get_new_notifs()
        sent = [msg.decode("ascii", "replace") for msgs in notes.values() for msg in msgs]
        now = time.monotonic()
        with self._lock:
            done = [tid for tid in sent if self._expected.pop(tid, None) is not None]
            for tid in [t for t, deadline in self._expected.items() if deadline < now]:
                del self._expected[tid]
            if not self._expected:
                self._wake.clear()
        for tid in done:
            if self.on_pulled:
                self.on_pulled(tid)

    def address(self, tensor: torch.Tensor, layer: int, slot: int) -> int:
        return tensor.data_ptr() + layer * self.layer_stride + slot * self.slot_bytes

    def descs(self, pages: list[int], token_count: int) -> list[list[int]]:
        """(address, bytes, device) of each page's written slots, for K then V, layer by layer."""
        spans = page_spans(token_count, self.pool.page_size)
        return [
            [
                self.address(tensor, layer, page * self.pool.page_size),
                slots * self.slot_bytes,
                0,
            ]
            for tensor in (self.pool.k, self.pool.v)
            for layer in range(tensor.shape[0])
            for page, slots in zip(pages, spans)
        ]

    def checksums(self, pages: list[int], token_count: int) -> list[int]:
        """CRC32 of each page's written slots, K then V, layer by layer (read in place)."""
        ps = self.pool.page_size
        k, v = (
            self.pool.k.view(torch.uint8).numpy(),
            self.pool.v.view(torch.uint8).numpy(),
        )  # numpy has no bf16
        sums = []
        for page, slots in zip(pages, page_spans(token_count, ps)):
            crc = 0
            for tensor in (k, v):
                for layer in tensor:
                    crc = zlib.crc32(layer[page * ps : page * ps + slots], crc)
            sums.append(crc)
        return sums

    def verify(
        self, manifest: Manifest, expected_tokens: int, sums: list[int] | None = None
    ) -> None:
        """`verify` against this worker's own pool."""
        verify(manifest, expected_tokens, self.pool, sums)

    def manifest(self, transfer_id: str, pages: list[int], token_count: int) -> Manifest:
        k = self.pool.k
        return Manifest(
            transfer_id,
            token_count,
            self.pool.page_size,
            len(page_spans(token_count, self.pool.page_size)),
            str(k.dtype).removeprefix("torch."),
            k.shape[0],
            k.shape[2],
            k.shape[3],
            self.checksums(pages, token_count),
            self.name,
            self.metadata,
            self.descs(pages, token_count),
        )

    def read(self, manifest: Manifest, pages: list[int], deadline: float) -> None:
        """Pulls the manifest's pages into `pages` of our pool, or raises TransferError by
        `deadline` (monotonic). It returns only once the transport has stopped writing into
        `pages`, so the caller may free them as soon as it returns."""
        if not manifest.descs:
            return
        if time.monotonic() >= deadline:  # the sender's lease may be over: never start a read
            raise TransferError("KV transfer did not start within its deadline")
        try:
            remote_name = self._remote(manifest)
            local, remote = coalesce(self.descs(pages, manifest.token_count), manifest.descs)
            local = self.agent.get_xfer_descs(local, "DRAM")
            remote = self.agent.get_xfer_descs(remote, "DRAM")
            handle = self.agent.initialize_xfer(
                "READ", local, remote, remote_name, manifest.transfer_id.encode()
            )
        except Exception as e:  # NIXL's errors share no base class
            raise TransferError(f"transport error: {type(e).__name__}: {e}") from None
        state = "ERR"
        try:
            state = self.agent.transfer(handle)
            while state == "PROC" and time.monotonic() < deadline:
                time.sleep(POLL_S)
                state = self.agent.check_xfer_state(handle)
        finally:
            self._release(handle)
        if state == "PROC":
            raise TransferError("KV transfer did not finish within its deadline")
        if state != "DONE":
            raise TransferError("KV transfer failed in the transport (peer gone?)")

    def _release(self, handle) -> None:
        """Releases a transfer, cancelling it if still active. NIXL refuses to release one it
        cannot cancel: then wait for it to end, since until then it may write our pages."""
        try:
            self.agent.release_xfer_handle(handle)
            return
        except Exception:  # still active and not cancellable
            pass
        while self.agent.check_xfer_state(handle) == "PROC":
            time.sleep(POLL_S)
        try:
            self.agent.release_xfer_handle(handle)
        except Exception:  # it has ended: nothing writes our pages any more
            pass

    def _remote(self, manifest: Manifest) -> str:
        with self._lock:
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
        if (
            out_local
            and out_local[-1][0] + out_local[-1][1] == la
            and out_remote[-1][0] + out_remote[-1][1] == ra
        ):
            out_local[-1][1] += ln
            out_remote[-1][1] += rn
        else:
            out_local.append([la, ln, ld])
            out_remote.append([ra, rn, rd])
    return [tuple(d) for d in out_local], [tuple(d) for d in out_remote]


def verify(manifest: Manifest, expected_tokens: int, pool: KVPool, received_checksums) -> None:
    """Checks a manifest against what the receiver reserved; raises TransferError naming the
    mismatch."""
    k = pool.k
    mine = {
        "page_size": pool.page_size,
        "dtype": str(k.dtype).removeprefix("torch."),
        "num_layers": k.shape[0],
        "kv_heads": k.shape[2],
        "head_dim": k.shape[3],
    }
    for key, value in mine.items():
        if getattr(manifest, key) != value:
            raise TransferError(
                f"manifest {key} is {getattr(manifest, key)}, this worker has {value}"
            )
    if manifest.token_count != expected_tokens:
        raise TransferError(
            f"manifest carries {manifest.token_count} tokens, {expected_tokens} were expected"
        )
    pages = len(page_spans(expected_tokens, pool.page_size))
    if (
        manifest.page_count != pages
        or len(manifest.checksums) != pages
        or len(manifest.descs) != 2 * k.shape[0] * pages
    ):
        raise TransferError(
            f"manifest describes {manifest.page_count} pages / {len(manifest.descs)} regions, "
            f"{pages} pages were expected"
        )
    if received_checksums is not None:
        bad = [i for i, (a, b) in enumerate(zip(manifest.checksums, received_checksums)) if a != b]
        if bad:
            raise TransferError(
                f"checksum mismatch on {len(bad)} of {pages} pages (first: page {bad[0]})"
            )


def manifest_from_dict(d) -> Manifest:
    """A manifest from a peer's JSON; anything malformed is refused without echoing it."""
    if not isinstance(d, dict):
        raise TransferError("malformed manifest: not an object")
    try:
        manifest = Manifest(**d)
    except (TypeError, ValidationError) as e:
        fields = (
            sorted({str(err["loc"][0]) for err in e.errors()})
            if isinstance(e, ValidationError)
            else []
        )
        raise TransferError(
            f"malformed manifest (fields: {', '.join(fields) or 'unknown'})"
        ) from None
    if any(len(desc) != 3 or min(desc) < 0 for desc in manifest.descs):
        raise TransferError("malformed manifest: a region is not (address, bytes, device)")
    return manifest
