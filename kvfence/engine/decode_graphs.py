"""CUDA graphs of the decode-only forward pass.

On a GPU, a decode step of a small model is about 1,500 tiny kernels, and launching them
one by one from Python costs far more than running them. A graph launches them all at
once. A graph replays fixed shapes on fixed tensors, so each (rows, block-table columns)
bucket gets its own graph, captured on first use. A batch is copied into its bucket's
input tensors, padded like any batch: extra rows write the scratch slot and read the
scratch page, and extra block-table columns hold the scratch page, which the length mask
hides. The ownership checks run before, on the real batch, exactly as without graphs.
"""

from dataclasses import dataclass
from typing import Callable

import torch

from kvfence.kv.pool import KVPool
from kvfence.model.attention import AttentionMetadata
from kvfence.model.llama import LlamaModel


def buckets(limit: int, steps: list[int]) -> list[int]:
    """`steps` up to `limit`, then `limit` itself."""
    return [s for s in steps if s < limit] + [limit]


@dataclass
class Graph:
    # [rows * (4 + pages)]: ids, positions, slots, lengths, then the block table
    inputs: torch.Tensor
    # The eager pass. Its closure also keeps alive every tensor the captured graph reads:
    # the graph holds bare addresses, and a freed tensor's memory soon holds something else.
    forward: Callable[[], torch.Tensor]
    cuda_graph: torch.cuda.CUDAGraph | None = None
    logits: torch.Tensor | None = None

    def replay(self) -> None:
        if self.cuda_graph is None:
            self.logits = self.forward()
        else:
            self.cuda_graph.replay()


class DecodeGraphs:
    def __init__(
        self,
        model: LlamaModel,
        pool: KVPool,
        max_rows: int,
        max_pages: int,
        decode_kernel: Callable | None = None,
        capture: bool = True,
    ):
        """capture=False runs the same padded buckets eagerly (a CPU stand-in for the tests)."""
        self.model = model
        self.pool = pool
        self.decode_kernel = decode_kernel
        self.capture = capture
        self.row_buckets = buckets(max_rows, [1, 2, 4, 8] + list(range(16, max_rows, 16)))
        self.page_buckets = buckets(max_pages, [2**i for i in range(max_pages.bit_length())])
        self.graphs: dict[tuple[int, int], Graph] = {}
        # Shared: one graph runs at a time.
        self.memory = torch.cuda.graph_pool_handle() if capture else None

    def run(
        self,
        ids: list[int],
        positions: list[int],
        slots: list[int],
        block_tables: list[list[int]],
        lengths: list[int],
    ) -> torch.Tensor:
        """Logits [len(ids), vocab] of a decode-only batch: one row per request, block tables
        of equal width."""
        n = len(ids)
        rows = next(b for b in self.row_buckets if b >= n)
        pages = next(b for b in self.page_buckets if b >= len(block_tables[0]))
        graph = self.graphs.get((rows, pages)) or self._capture(rows, pages)
        scratch, pad = self.pool.num_pages, rows - n
        table = [page for t in block_tables for page in t + [scratch] * (pages - len(t))]
        flat = (
            ids
            + [0] * pad
            + positions
            + [0] * pad
            + slots
            + [self.pool.scratch_slot] * pad
            + lengths
            + [1] * pad
            + table
            + [scratch] * (pages * pad)
        )
        graph.inputs.copy_(torch.tensor(flat, dtype=torch.long))
        graph.replay()
        return graph.logits[:n]

    def _capture(self, rows: int, pages: int) -> Graph:
        device = self.model.device
        inputs = torch.empty(rows * (4 + pages), dtype=torch.long, device=device)
        ids, positions, slots, lengths = inputs[: 4 * rows].view(4, rows)
        table = inputs[4 * rows :].view(rows, pages)
        # Until a batch fills them, the inputs describe padding only: capture touches no
        # request's pages.
        (
            ids.zero_(),
            positions.zero_(),
            slots.fill_(self.pool.scratch_slot),
            lengths.fill_(1),
        )
        table.fill_(self.pool.num_pages)
        sample_rows = torch.arange(rows, device=device)

        def forward() -> torch.Tensor:
            # A new metadata object each call: its cached mask must be computed inside the graph.
            meta = AttentionMetadata(
                slot_mapping=slots,
                page_size=self.pool.page_size,
                num_decode=rows,
                decode_block_table=table,
                decode_lens=lengths,
                prefills=[],
                decode_kernel=self.decode_kernel,
            )
            return self.model.forward(ids, positions, meta, self.pool.layers, sample_rows)

        graph = Graph(inputs, forward)
        if self.capture:
            side = torch.cuda.Stream()
            side.wait_stream(torch.cuda.current_stream())
            # Warm-up: lazy initialisation must not happen during capture.
            with torch.cuda.stream(side):
                forward()
            torch.cuda.current_stream().wait_stream(side)
            graph.cuda_graph = torch.cuda.CUDAGraph()
            with torch.cuda.graph(graph.cuda_graph, pool=self.memory):
                graph.logits = forward()
        self.graphs[(rows, pages)] = graph
        return graph
