"""A step's inputs on the host, built from its plan with numpy (no per-token Python loop except
copying the rows' token ids): positions, KV slots, page tables, sample rows, and which input ids are
still on the device. Shared by the eager path (engine/model_runner.py) and the decode CUDA graphs
(engine/cuda_graphs.py); knows nothing about devices beyond the `PendingInputs` gather.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import NamedTuple

import numpy as np
import torch

from engine.plan import PENDING_TOKEN, PlanRow


@dataclass(slots=True)
class HostStep:
    """One step's inputs on the host (numpy; int64 unless noted). T tokens, S sequences."""
    input_ids: np.ndarray          # (T,)
    positions: np.ndarray          # (T,)
    slots: np.ndarray              # (T,) block * block_size + offset
    kv_rows: np.ndarray            # (2, T) rows of the new key / value in the (N*2*bs, Hkv, D) layer view
    sample_rows: np.ndarray        # (R,) rows whose logits are sampled
    qo_indptr: np.ndarray          # (S+1,) int32
    kv_indptr: np.ndarray          # (S+1,) int32
    kv_indices: np.ndarray         # (pages,) int32
    kv_last_page_len: np.ndarray   # (S,) int32
    query_lens: list[int]
    context_lens: list[int]
    block_tables: list[list[int]]
    samples: list[bool]            # per sequence: its chunk yields a token
    pending_rows: np.ndarray       # (P,) rows of input_ids that are PENDING_TOKEN (read from the device)
    pending_seqs: np.ndarray       # (P,) the sequence of each

    @property
    def is_decode_only(self) -> bool:
        return len(self.input_ids) == len(self.query_lens)


def build_host_step(rows: list[PlanRow], block_size: int) -> HostStep:
    bs, n = block_size, len(rows)
    starts = np.fromiter((r.start for r in rows), np.int64, n)
    lens = np.fromiter((r.num_tokens for r in rows), np.int64, n)
    ctx = starts + lens
    qo_indptr = np.zeros(n + 1, np.int64)
    np.cumsum(lens, out=qo_indptr[1:])
    num_tokens = int(qo_indptr[-1])
    if num_tokens == n:                                   # decode-only: one token each
        ids = [r.token_ids[0] for r in rows]
        seq = np.arange(n)
        positions = starts
    else:
        ids = []
        for r in rows:
            ids += r.token_ids
        seq = np.repeat(np.arange(n), lens)
        positions = np.arange(num_tokens) - qo_indptr[seq] + starts[seq]
    num_pages = (ctx + bs - 1) // bs
    kv_indptr = np.zeros(n + 1, np.int64)
    np.cumsum(num_pages, out=kv_indptr[1:])
    tables = [r.block_table for r in rows]       # exactly the pages of each row (the scheduler's slice)
    flat: list[int] = []
    for table in tables:
        flat += table
    kv_indices = np.array(flat, np.int64)
    offsets = positions % bs
    pages = kv_indices[kv_indptr[seq] + positions // bs]
    k_rows = pages * (2 * bs) + offsets
    samples = [r.samples for r in rows]
    input_ids = np.array(ids, np.int64)
    pending_rows = np.flatnonzero(input_ids == PENDING_TOKEN)
    return HostStep(
        input_ids=input_ids, positions=positions, slots=pages * bs + offsets,
        kv_rows=np.stack([k_rows, k_rows + bs]), sample_rows=(qo_indptr[1:] - 1)[np.array(samples, bool)],
        qo_indptr=qo_indptr.astype(np.int32), kv_indptr=kv_indptr.astype(np.int32),
        kv_indices=kv_indices.astype(np.int32), kv_last_page_len=(ctx - (num_pages - 1) * bs).astype(np.int32),
        query_lens=lens.tolist(), context_lens=ctx.tolist(), block_tables=tables, samples=samples,
        pending_rows=pending_rows, pending_seqs=seq[pending_rows])


class PendingInputs(NamedTuple):
    """Input rows whose token id is only on the device yet: ids[rows] = tokens[index]."""
    rows: np.ndarray          # (P,) rows of the step's input ids (int64)
    index: np.ndarray         # (P,) where each id is in `tokens` (int64)
    tokens: torch.Tensor      # the previous step's sampled ids, on the device

    def gather_into(self, ids: torch.Tensor, rows: torch.Tensor, index: torch.Tensor) -> None:
        """Write the ids into `ids` on the device; `rows`, `index`: this tuple's arrays, uploaded."""
        ids.index_copy_(0, rows, self.tokens.index_select(0, index))


def empty_step() -> HostStep:
    """A step of no rows (what graph capture plans with)."""
    z64, z32 = np.zeros(0, np.int64), np.zeros(0, np.int32)
    return HostStep(input_ids=z64, positions=z64, slots=z64, kv_rows=np.zeros((2, 0), np.int64),
                    sample_rows=z64, qo_indptr=np.zeros(1, np.int32), kv_indptr=np.zeros(1, np.int32),
                    kv_indices=z32, kv_last_page_len=z32, query_lens=[], context_lens=[],
                    block_tables=[], samples=[], pending_rows=z64, pending_seqs=z64)


def prompt_score_rows(rows: list[PlanRow], qo_indptr: np.ndarray) -> tuple[np.ndarray, np.ndarray, list]:
    """Where the step scores prompt tokens (prompt logprobs): the rows of its flat token dimension
    whose logits score them, the scored tokens, and per asking request (id, first of its rows in
    those arrays, how many, the top-k it asked for)."""
    idx: list[int] = []
    targets: list[int] = []
    spans = []
    for i, r in enumerate(rows):
        if r.prompt_targets:
            n, base = len(r.prompt_targets), int(qo_indptr[i])
            spans.append((r.request_id, len(targets), n, r.sampling.prompt_logprobs or 0))
            idx.extend(range(base, base + n))
            targets += r.prompt_targets
    return np.array(idx, np.int64), np.array(targets, np.int64), spans
