"""Paged attention on the GPU with FlashInfer over a bf16/fp16 or fp8 (e4m3) KV cache: prefill and
mixed steps through BatchPrefillWithPagedKVCacheWrapper (causal, each sequence's queries aligned to the
end of its context; fa2 kernels whenever decode rows ride along), decode-only steps through
BatchDecodeWithPagedKVCacheWrapper, and one CUDA-graph decode wrapper per captured batch size.

Decode runs on tensor cores (FlashInfer's prefill kernel, a GQA group's query heads together), on
the CUDA-core decode kernel, or (decode_kernel="xqa") on TensorRT-LLM's XQA kernel as FlashInfer ships
it: no plan at all, a padded page table and the sequence lengths in device buffers (`_XqaDecode`);
on Hopper with an fp8 cache it is a wgmma kernel that also rounds q and the softmax to e4m3.
`plan()` runs once per step on host-side CSR arrays in pinned memory and never waits for the device
(async scheduling plans step N+1 while step N runs); `forward()` per layer writes
the step's K/V with two index_copy_ kernels and runs the planned wrapper (`attend()`: the wrapper
alone, for a model that wrote K/V at `step_kv_rows()` itself). For a CUDA graph,
`plan_graph(batch_size, metadata)` plans that size's wrapper into its fixed buffers and makes the
backend read K/V rows from a static device tensor, so `forward()` can be captured and replayed.
Knows nothing about requests or scheduling. FlashInfer is imported here only (lazily, by
model_runner.make_backend), so the CPU install never needs it.
"""

from __future__ import annotations

import os

os.environ.setdefault("FLASHINFER_USE_CUDA_NORM", "1")   # CUDA norm kernels; no CuTe DSL needed

import flashinfer  # noqa: E402
import numpy as np  # noqa: E402
import torch  # noqa: E402

from engine.attention.base import (AttentionBackend, AttentionMetadata, fill_page_table,  # noqa: E402
                                   write_kv_rows)

_WORKSPACE_BYTES = 256 << 20


class FlashInferAttention(AttentionBackend):
    name = "flashinfer"

    def __init__(self, num_heads: int, num_kv_heads: int, head_dim: int, device: torch.device,
                 dtype: torch.dtype = torch.bfloat16, decode_tensor_cores: bool = False,
                 kv_dtype: torch.dtype | None = None, decode_kernel: str = "flashinfer",
                 max_batch: int = 256, max_pages_per_seq: int = 256) -> None:
        self.num_heads, self.num_kv_heads, self.head_dim = num_heads, num_kv_heads, head_dim
        # an fp8 KV cache with bf16/fp16 queries runs FlashInfer's fa2 kernels (its fa3 ones want fp8 q)
        self.device, self.dtype, self.kv_dtype = device, dtype, kv_dtype or dtype
        self.workspace = torch.zeros(_WORKSPACE_BYTES, dtype=torch.uint8, device=device)
        self.prefill = flashinfer.BatchPrefillWithPagedKVCacheWrapper(self.workspace, "NHD")
        # Steps that mix decode rows into prefill chunks take fa2, whose query tile follows the rows'
        # length; fa3 (chosen for pure prefill on Hopper) gives every 1-token decode row a 128-query
        # tile over its whole context, ~3 GFLOP per row and layer at a 1.4k context: ~20 ms of wasted
        # tensor-core work per mixed step at batch 128 for the 8B. The two share the workspace: one
        # is planned per step.
        self.prefill_mixed = flashinfer.BatchPrefillWithPagedKVCacheWrapper(self.workspace, "NHD", backend="fa2")
        # Decode kernel: CUDA cores (backend="fa2", which also skips plan()'s per-call backend
        # probing) or, with decode_tensor_cores, FlashInfer's prefill kernel on tensor cores, which
        # computes a GQA group's query heads together.
        self.decode_tensor_cores = decode_tensor_cores
        self.decode_kwargs = dict(use_tensor_cores=True) if decode_tensor_cores else dict(backend="fa2")
        self.decode = flashinfer.BatchDecodeWithPagedKVCacheWrapper(self.workspace, "NHD", **self.decode_kwargs)
        self._graph_wrappers: dict[int, _GraphDecode] = {}
        self._active = self.decode
        self._kv_rows: torch.Tensor | None = None
        self._indices_stage: torch.Tensor | None = None   # device copy of a graph plan's page ids
        # see plan_graph; off: plan() on every step. The tensor-core kernel's plan splits the KV by
        # tokens, not pages, so it is never reused.
        self.reuse_decode_plans = not decode_tensor_cores
        if decode_kernel not in ("flashinfer", "xqa"):
            raise ValueError(f"decode_kernel must be flashinfer or xqa, got {decode_kernel!r}")
        self.decode_kernel = decode_kernel
        self.xqa = _XqaDecode(max_batch, max_pages_per_seq, head_dim, device) if decode_kernel == "xqa" else None

    # ---- planning (host side, outside any graph) ----------------------------------------------
    def plan(self, md: AttentionMetadata) -> None:
        self._kv_rows = md.kv_rows
        if md.is_decode_only:
            if self.xqa is not None:
                self.xqa.load(md)
                self._active = self.xqa
            else:
                self._plan_decode(self.decode, md)
                self._active = self.decode
        else:
            w = self.prefill_mixed if 1 in md.query_lens else self.prefill
            w.plan(md.qo_indptr_host, md.kv_indptr_host, md.kv_indices_host, md.kv_last_page_len_host,
                   self.num_heads, self.num_kv_heads, self.head_dim, md.block_size, causal=True,
                   q_data_type=self.dtype, kv_data_type=self.kv_dtype)
            self._active = w

    def plan_graph(self, batch_size: int, md: AttentionMetadata, kv_rows_static: torch.Tensor,
                   max_num_pages: int) -> None:
        """Plan the CUDA-graph decode wrapper of `batch_size` (md padded to it); forward() then
        reads K/V rows from `kv_rows_static` (2, >= batch_size), whose address the graph keeps.

        FlashInfer's decode plan depends on the pages per sequence (kv_indptr) only; the kernels read
        page ids and last-page lengths from device buffers that we own. So while kv_indptr is
        unchanged (15 of 16 decode steps at block size 16), only those two buffers are refreshed
        and plan() — ~0.2 ms of Python and a host-side split computation — is skipped."""
        self._kv_rows = kv_rows_static[:, :batch_size]
        if self.xqa is not None:                   # its buffers are the graph's for every size
            self.xqa.load(md)
            self._active = self.xqa
            return
        g = self._graph_wrappers.get(batch_size)
        if g is None:
            g = _GraphDecode(self.workspace, batch_size, max_num_pages, self.device, self.decode_kwargs)
            self._graph_wrappers[batch_size] = g
        indptr = md.kv_indptr_host.numpy()
        if self.reuse_decode_plans and g.planned_indptr is not None and np.array_equal(g.planned_indptr, indptr):
            n = len(md.kv_indices_host)
            g.indices[:n].copy_(md.kv_indices_host, non_blocking=True)
            g.last_page_len.copy_(md.kv_last_page_len_host, non_blocking=True)
        else:
            # FlashInfer uploads host page ids with a blocking copy (it waits for the GPU, which
            # async scheduling keeps busy); handed a device tensor it copies on the device instead
            n = len(md.kv_indices_host)
            if self._indices_stage is None or len(self._indices_stage) < n:
                self._indices_stage = torch.empty(max_num_pages, dtype=torch.int32, device=self.device)
            stage = self._indices_stage[:n]
            stage.copy_(md.kv_indices_host, non_blocking=True)
            self._plan_decode(g.wrapper, md, stage)
            g.planned_indptr = indptr.copy()
        self._active = g.wrapper

    def _plan_decode(self, w, md: AttentionMetadata, indices: torch.Tensor | None = None) -> None:
        w.plan(md.kv_indptr_host, md.kv_indices_host if indices is None else indices, md.kv_last_page_len_host,
               self.num_heads, self.num_kv_heads, self.head_dim, md.block_size, pos_encoding_mode="NONE",
               q_data_type=self.dtype, kv_data_type=self.kv_dtype)

    # ---- per layer (capturable) -----------------------------------------------------------
    def forward(self, layer: int, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor,
                kv_layer: torch.Tensor) -> torch.Tensor:
        write_kv_rows(kv_layer, k, v, self._kv_rows)
        return self.attend(layer, q, kv_layer)

    def step_kv_rows(self) -> torch.Tensor | None:
        return self._kv_rows

    def attend(self, layer: int, q: torch.Tensor, kv_layer: torch.Tensor) -> torch.Tensor:
        return self._active.run(q, kv_layer)


class _XqaDecode:
    """Decode attention with XQA (flashinfer.decode.xqa_batch_decode_with_kv_cache). The kernel reads
    each sequence's pages from a (batch, max_pages_per_seq) table and its length from a vector;
    both live in fixed device buffers sized for the largest batch, so one set serves eager steps and
    every CUDA graph (a graph replays with the rows its `load` wrote). `load` builds the rows on
    the host from the step's CSR page list and uploads them with one copy from pinned memory; the
    table's width is fixed (the kernel's max_seq_len is width * block size, baked into a graph)."""

    _SEMAPHORE_BYTES = 8 << 20                 # the kernel's layout: semaphores, then scratch

    def __init__(self, max_batch: int, max_pages_per_seq: int, head_dim: int, device) -> None:
        self.width = max_pages_per_seq
        self.scale = head_dim ** -0.5
        self.table = torch.zeros(max_batch, self.width, dtype=torch.int32, device=device)
        self.seq_lens = torch.zeros(max_batch, dtype=torch.int32, device=device)
        # multi-block partial results: per (sequence, KV head, split) a head's output and its
        # softmax max/sum; splits are used at small batches only. Zeroed: the semaphores must be.
        self.workspace = torch.zeros(self._SEMAPHORE_BYTES + (64 << 20), dtype=torch.uint8, device=device)
        # staging: lengths, then the used columns of the table as a dense (b, w) block
        self._host = torch.zeros(max_batch * (self.width + 1), dtype=torch.int32, pin_memory=True)
        self._dev = torch.zeros_like(self._host, device=device)
        self._uploaded = torch.cuda.Event()

    def load(self, md: AttentionMetadata) -> None:
        indptr = md.kv_indptr_host.numpy()
        indices = md.kv_indices_host.numpy()
        b = len(indptr) - 1
        counts = np.diff(indptr)
        w = int(counts.max()) if b else 0
        if b > len(self.seq_lens) or w > self.width:
            raise ValueError(f"XQA decode buffers hold {len(self.seq_lens)} sequences of {self.width} "
                             f"pages; this step has {b} of up to {w}")
        self._uploaded.synchronize()           # the previous upload has left the staging buffer
        h = self._host.numpy()
        fill_page_table(indptr, indices, md.kv_last_page_len_host.numpy(), md.block_size, h[:b],
                        h[b:b + b * w].reshape(b, w))
        self._dev[:b + b * w].copy_(self._host[:b + b * w], non_blocking=True)
        self._uploaded.record()
        self.seq_lens[:b].copy_(self._dev[:b])
        self.table[:b, :w].copy_(self._dev[b:b + b * w].view(b, w))

    def run(self, q: torch.Tensor, kv_layer: torch.Tensor) -> torch.Tensor:
        b = q.shape[0]
        return flashinfer.decode.xqa_batch_decode_with_kv_cache(   # it reads q as dense rows
            q.contiguous(), kv_layer, self.workspace, self.table[:b], self.seq_lens[:b].view(torch.uint32),
            self.width * kv_layer.shape[2], bmm1_scale=self.scale, bmm2_scale=1.0)


class _GraphDecode:
    """One CUDA-graph decode wrapper with the fixed device buffers it reads at replay."""

    def __init__(self, workspace: torch.Tensor, batch_size: int, max_num_pages: int, device,
                 decode_kwargs: dict) -> None:
        self.indptr = torch.zeros(batch_size + 1, dtype=torch.int32, device=device)
        self.indices = torch.zeros(max_num_pages, dtype=torch.int32, device=device)
        self.last_page_len = torch.zeros(batch_size, dtype=torch.int32, device=device)
        self.wrapper = flashinfer.BatchDecodeWithPagedKVCacheWrapper(
            workspace, "NHD", use_cuda_graph=True, paged_kv_indptr_buffer=self.indptr,
            paged_kv_indices_buffer=self.indices, paged_kv_last_page_len_buffer=self.last_page_len,
            **decode_kwargs)
        self.planned_indptr: np.ndarray | None = None
