"""Decode steps replayed from CUDA graphs, one graph per padded batch size.

At batch 1 a decode step of a 32-layer model is ~350 kernel launches; launched one by one from
Python they take longer than the GPU needs to run them. Each graph captures embeddings → layers →
logits for a fixed batch size B reading fixed device buffers (token ids, positions, K/V rows); a step
of S <= B sequences fills those buffers with one host-to-device copy, plans the backend's CUDA-graph
decode wrapper for B outside the graph, and replays. Rows S..B-1 are padding: they write their K/V
into a scratch block that no sequence owns and attend to it alone.

Owns the static buffers and graphs; knows nothing about requests (it sees `HostStep`s).
"""

from __future__ import annotations

import logging
import time

import numpy as np
import torch

from engine.attention.base import AttentionMetadata
from engine.step_inputs import HostStep, PendingInputs, empty_step

log = logging.getLogger(__name__)

BATCH_SIZES = (1, 2, 4, 8, 16, 24, 32, 48, 64, 96, 128, 160, 192, 224, 256, 320, 384, 448, 512)


class DecodeGraphs:
    def __init__(self, model, backend, kv_cache: torch.Tensor, block_size: int, scratch_block: int,
                 max_batch: int, device: torch.device) -> None:
        self.model, self.backend, self.kv_cache = model, backend, kv_cache
        self.block_size, self.scratch_block = block_size, scratch_block
        self.sizes = [b for b in BATCH_SIZES if b <= max_batch]
        self.max_batch = self.sizes[-1]
        self.max_num_pages = kv_cache.shape[1] + self.max_batch
        # rows: token ids, positions, key rows, value rows; then pending ids' rows and sources
        self.host = torch.zeros(6, self.max_batch, dtype=torch.int64, pin_memory=True)
        self.host_np = self.host.numpy()
        self.static = torch.zeros(6, self.max_batch, dtype=torch.int64, device=device)
        # rows: kv_indptr, kv_indices, kv_last_page_len of the padded batch
        self.meta = torch.zeros(3, self.max_num_pages + 1, dtype=torch.int32, pin_memory=True)
        self.copied = torch.cuda.Event()            # the staging rows may be overwritten
        self.graphs: dict[int, torch.cuda.CUDAGraph] = {}
        self.logits: dict[int, torch.Tensor] = {}
        self.capture_s = 0.0
        self.first_capture_s = 0.0                  # the first (largest) graph: pays lazy inits and JIT

    def fits(self, num_seqs: int) -> bool:
        return num_seqs <= self.max_batch

    def release(self) -> None:
        """Destroy the captured graphs (none is replayed again). A graph that captured an NCCL
        collective holds a reference on its communicator, and NCCL's teardown (destroy or abort)
        waits until every such graph is gone: a tensor-parallel rank releases its graphs before it
        leaves the process group."""
        torch.cuda.synchronize()
        for g in self.graphs.values():
            g.reset()
        self.graphs.clear()
        self.logits.clear()

    def padded_size(self, num_seqs: int) -> int:
        return next(b for b in self.sizes if b >= num_seqs)

    @torch.inference_mode()
    def capture(self) -> None:
        t0 = time.perf_counter()
        pool = None
        empty = empty_step()
        for b in reversed(self.sizes):            # largest first: smaller graphs reuse its pool
            self._prepare(empty, b)
            self.static[:4].copy_(self.host[:4])
            self._forward(b)                      # warm-up: lazy inits stay out of the graph
            torch.cuda.synchronize()
            g = torch.cuda.CUDAGraph()
            with torch.cuda.graph(g, pool=pool):
                self.logits[b] = self._forward(b)
            pool = g.pool()
            self.graphs[b] = g
            if len(self.graphs) == 1:
                torch.cuda.synchronize()
                self.first_capture_s = time.perf_counter() - t0
        torch.cuda.synchronize()
        self.capture_s = time.perf_counter() - t0
        log.info("captured %d decode graphs (batch %s) in %.1f s", len(self.sizes), self.sizes, self.capture_s)

    def run(self, step: HostStep, pending: PendingInputs | None = None) -> torch.Tensor:
        """Replay the graph for `step` (a decode-only HostStep); returns logits (S, V) float32,
        a view of the graph's output that the next replay overwrites. `pending`: the step's input
        ids still on the device."""
        s = len(step.query_lens)
        b = self.padded_size(s)
        self.copied.synchronize()
        self._prepare(step, b)
        p = len(pending.rows) if pending else 0
        if p:                                      # rows 4, 5 of the staging buffer: where and what
            self.host_np[4, :p], self.host_np[5, :p] = pending.rows, pending.index
        rows = 6 if p else 4
        self.static[:rows].copy_(self.host[:rows], non_blocking=True)   # one H2D copy
        self.copied.record()
        if p:
            pending.gather_into(self.static[0], self.static[4, :p], self.static[5, :p])
        self.graphs[b].replay()
        return self.logits[b][:s]

    def _forward(self, b: int) -> torch.Tensor:
        st = self.static
        hidden = self.model(st[0, :b], st[1, :b], self.backend, self.kv_cache)
        return self.model.compute_logits(hidden)

    def _prepare(self, step: HostStep, b: int) -> None:
        """Fill the pinned staging rows and plan the backend for batch b (step padded with scratch rows)."""
        s, bs, h = len(step.query_lens), self.block_size, self.host_np
        scratch_row = self.scratch_block * 2 * bs
        h[0, :s], h[1, :s], h[2, :s], h[3, :s] = step.input_ids, step.positions, step.kv_rows[0], step.kv_rows[1]
        h[0, s:b], h[1, s:b], h[2, s:b], h[3, s:b] = 0, 0, scratch_row, scratch_row + bs
        # the page table in pinned memory: the planner's uploads from it must not wait for the GPU
        # (a pageable source would), and `copied` guards it like the rows above
        pad, n = b - s, len(step.kv_indices)
        indptr, indices, last = self.meta[0, :b + 1], self.meta[1, :n + pad], self.meta[2, :b]
        indptr_np, indices_np, last_np = indptr.numpy(), indices.numpy(), last.numpy()
        indptr_np[:s + 1] = step.kv_indptr
        indptr_np[s + 1:] = step.kv_indptr[-1] + np.arange(1, pad + 1, dtype=np.int32)
        indices_np[:n], indices_np[n:] = step.kv_indices, self.scratch_block
        last_np[:s], last_np[s:] = step.kv_last_page_len, 1
        md = AttentionMetadata(
            query_lens=[], context_lens=[], block_tables=[], slot_mapping=None, query_start_loc=None,
            block_size=bs, is_decode_only=True, kv_indptr_host=indptr, kv_indices_host=indices,
            kv_last_page_len_host=last)
        self.backend.plan_graph(b, md, self.static[2:4], self.max_num_pages)

