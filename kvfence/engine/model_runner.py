"""Turns a scheduled batch into tensors, checks ownership, and runs the model once."""

import logging
from typing import Callable

import torch

from kvfence.config import EngineConfig
from kvfence.engine.decode_graphs import DecodeGraphs
from kvfence.engine.request import Request
from kvfence.kv.allocator import PageAllocator
from kvfence.kv.pool import KVPool
from kvfence.kv.sentinel import TableCheck, check_batch
from kvfence.model.attention import AttentionMetadata, PrefillChunk
from kvfence.model.kernels import decode_kernel
from kvfence.model.llama import LlamaModel

log = logging.getLogger("kvfence.sentinel")


class ModelRunner:
    def __init__(
        self,
        model: LlamaModel,
        pool: KVPool,
        allocator: PageAllocator,
        sentinel: str,
        decode_kernel: Callable | None = None,
        graphs: DecodeGraphs | None = None,
    ):
        self.model = model
        self.decode_kernel = decode_kernel
        # With fp32 layers, prefill rows attend through the decode kernel too: each row to the
        # positions up to its own, read from the request's pages in place, with no gather, no
        # copy to fp32 and no mask (bf16 layers keep PyTorch's bf16 attention for prefill).
        self.kernel_prefill = decode_kernel is not None and model.dtype == torch.float32
        self.graphs = graphs
        self.pool = pool
        self.allocator = allocator
        self.sentinel = sentinel
        self.min_rows = model.min_batch_rows
        self.device = model.device
        self.sentinel_violations = 0

    @classmethod
    def for_config(
        cls, model: LlamaModel, pool: KVPool, allocator: PageAllocator, config: EngineConfig
    ) -> "ModelRunner":
        """The runner with the attention kernel and (on a GPU) decode graphs the config asks for."""
        graphs = None
        if config.device != "cpu" and not config.enforce_eager:
            max_pages = -(-config.max_model_len // config.page_size)
            graphs = DecodeGraphs(model, pool, config.max_num_seqs, max_pages)
        kernel = decode_kernel(config.attention, config.device)
        return cls(model, pool, allocator, config.kv_sentinel, kernel, graphs)

    def check(
        self, batch: list[tuple[Request, int]]
    ) -> tuple[list[tuple[Request, int]], list[tuple[Request, str]]]:
        """Splits the batch into requests allowed to run and (request, violation) pairs."""
        if self.sentinel == "off":
            return batch, []
        allowed, failed = [], []
        tenant = self.allocator.tenant_number
        problems = check_batch(
            self.allocator,
            [
                TableCheck(
                    req.owner,
                    tenant(req.tenant),
                    req.block_table,
                    req.page_generations,
                    req.num_shared_pages,
                    req.num_computed_tokens,
                    req.num_computed_tokens + n,
                )
                for req, n in batch
            ],
        )
        for (req, n), problem in zip(batch, problems):
            if problem is None:
                allowed.append((req, n))
                continue
            self.sentinel_violations += 1
            req.sentinel_violation = req.sentinel_violation or problem
            log.error(
                "KV SENTINEL: request %s (tenant %s): %s",
                req.request_id,
                req.tenant,
                problem,
            )
            if self.sentinel == "enforce":
                failed.append((req, problem))
            else:
                allowed.append((req, n))
        return allowed, failed

    def mark_written(self, req: Request, start: int, end: int) -> None:
        ps = self.pool.page_size
        for page_index in range(start // ps, -(-end // ps)):
            page = req.block_table[page_index]
            if page_index >= req.num_shared_pages:
                self.allocator.mark_written(req.owner, page, min(end - page_index * ps, ps))

    @staticmethod
    def row_tables(tables: torch.Tensor, rows: list[tuple[Request, int]]) -> torch.Tensor:
        """One block table a row: each request's, repeated for each of its rows."""
        if all(n == 1 for _, n in rows):
            return tables
        return tables.repeat_interleave(
            torch.tensor([n for _, n in rows], device=tables.device), dim=0
        )

    def run(self, batch: list[tuple[Request, int]]) -> tuple[torch.Tensor, list[Request]]:
        """Computes every scheduled token. Returns logits for the requests whose chunk ends at
        their last token, which are the ones to sample, and those requests in logits order."""
        ps = self.pool.page_size
        scratch_page = self.pool.num_pages
        decodes = [(r, n) for r, n in batch if n == 1]
        prefills = [(r, n) for r, n in batch if n > 1]
        ids, positions, slots = [], [], []
        for req, n in decodes + prefills:
            start = req.num_computed_tokens
            tokens = req.all_token_ids
            for pos in range(start, start + n):
                ids.append(tokens[pos])
                positions.append(pos)
                slots.append(req.block_table[pos // ps] * ps + pos % ps)
            self.mark_written(req, start, start + n)
        block_table = lengths = None
        kernel_rows = decodes + prefills if self.kernel_prefill else decodes
        if kernel_rows:
            # Row i of a prefill chunk attends to the positions up to its own: a length of
            # start + i + 1.
            lengths = [
                pos + 1
                for r, n in kernel_rows
                for pos in range(r.num_computed_tokens, r.num_computed_tokens + n)
            ]
            width = -(-max(lengths) // ps)
            block_table = [(r.block_table + [scratch_page] * width)[:width] for r, _ in kernel_rows]
        # A decode-only step where every row is sampled is what the graphs replay.
        if (
            self.graphs is not None
            and not prefills
            and all(
                r.num_computed_tokens + 1 == r.num_tokens and not r.prefill_only for r, _ in decodes
            )
        ):
            logits = self.graphs.run(ids, positions, slots, block_table, lengths)
            return logits.float().cpu(), [r for r, _ in decodes]
        num_real = len(ids)
        pad = max(0, self.min_rows - num_real)
        ids += [0] * pad
        positions += [0] * pad
        slots += [self.pool.scratch_slot] * pad
        chunks = []
        row = len(decodes)
        # The chunks PyTorch's attention takes.
        torch_prefills = [] if self.kernel_prefill else prefills
        for req, n in torch_prefills:
            start = req.num_computed_tokens
            length = start + n
            pos = torch.arange(length)
            table = torch.tensor(req.block_table[: -(-length // ps)])
            context = table[pos // ps] * ps + pos % ps
            # A chunk from position 0 is plainly causal, which lets attention skip the masked half.
            mask = (
                None
                if start == 0
                else (pos[None, :] <= torch.arange(start, length)[:, None]).to(self.device)
            )
            chunks.append(PrefillChunk(row, row + n, context.to(self.device), mask))
            row += n

        sample_rows, sampled, row = [], [], 0
        for req, n in decodes + prefills:
            row += n
            if req.num_computed_tokens + n == req.num_tokens and not req.prefill_only:
                sample_rows.append(row - 1)
                sampled.append(req)
        num_sampled = len(sample_rows)
        sample_rows += [0] * max(0, self.min_rows - num_sampled)

        def to(x):
            return torch.tensor(x, dtype=torch.long, device=self.device)

        meta = AttentionMetadata(
            slot_mapping=to(slots),
            page_size=ps,
            num_decode=len(lengths or ()),
            decode_block_table=None
            if block_table is None
            else self.row_tables(to(block_table), kernel_rows),
            decode_lens=None if lengths is None else to(lengths),
            prefills=chunks,
            decode_kernel=self.decode_kernel,
        )
        logits = self.model.forward(to(ids), to(positions), meta, self.pool.layers, to(sample_rows))
        return logits[:num_sampled].float().cpu(), sampled
