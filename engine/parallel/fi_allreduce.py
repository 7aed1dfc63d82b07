"""FlashInfer's custom all-reduce between the GPUs of one worker (`--tp-all-reduce flashinfer`).

TensorRT-LLM's one-shot/two-shot all-reduce as FlashInfer ships it (`flashinfer.comm`): every rank
writes its partial sum into IPC-shared buffers of all ranks and reads the others' back, in one
kernel, with no NCCL launch; the same kernel can add the residual and apply RMSNorm, which is how
the model uses it (engine/model.py `fuse_reduce_into_norms`: a sublayer's partial output is summed
in the norm after it). It is captured in the decode CUDA graphs like any kernel. Sizes beyond the
workspace (`max_tokens` rows of `hidden` features) go to NCCL.

Off by default: whether it beats NCCL at each size is for a 2-GPU run to measure
(bench/device/multi_gpu.sh, stage `tp`, both settings). Creating the workspace is collective; the
ranks agree on the outcome (all use it, or none does), so a rank that cannot build it never leaves
another waiting in a kernel its peers never launch.
"""

from __future__ import annotations

import logging

import torch
import torch.distributed as dist

log = logging.getLogger(__name__)

MAX_TOKENS = 2048                     # workspace rows: a prefill chunk at the default step budget
PATTERN_ALL_REDUCE = 0                # flashinfer.comm.AllReduceFusionPattern.kAllReduce
PATTERN_RESIDUAL_RMSNORM = 1          # ... .kARResidualRMSNorm


class FlashInferAllReduce:
    def __init__(self, rank: int, size: int, max_tokens: int, hidden: int, dtype: torch.dtype) -> None:
        import flashinfer.comm as comm
        self.comm, self.rank, self.size = comm, rank, size
        self.max_tokens, self.hidden, self.dtype = max_tokens, hidden, dtype
        made = comm.trtllm_create_ipc_workspace_for_all_reduce_fusion(rank, size, max_tokens, hidden,
                                                                      group=dist.group.WORLD)
        self.ipc_handles, self.workspace = made[0], made[1]

    def fits(self, x: torch.Tensor) -> bool:
        return (x.is_cuda and x.dim() == 2 and x.shape[0] <= self.max_tokens and x.shape[1] == self.hidden
                and x.dtype == self.dtype and x.is_contiguous())

    def __call__(self, x: torch.Tensor) -> torch.Tensor:
        out = torch.empty_like(x)
        self._run(x, PATTERN_ALL_REDUCE, allreduce_out=out)
        return out

    def add_rmsnorm(self, x: torch.Tensor, residual: torch.Tensor, weight: torch.Tensor, eps: float):
        """(rmsnorm(sum x + residual) * weight, sum x + residual)."""
        norm_out, residual_out = torch.empty_like(x), torch.empty_like(residual)
        self._run(x, PATTERN_RESIDUAL_RMSNORM, residual_in=residual, residual_out=residual_out, norm_out=norm_out,
                  rms_gamma=weight, rms_eps=eps)
        return norm_out, residual_out

    def _run(self, x: torch.Tensor, pattern: int, **outs) -> None:
        args = dict(allreduce_out=None, residual_in=None, residual_out=None, norm_out=None, rms_gamma=None,
                    rms_eps=None)
        args.update(outs)
        self.comm.trtllm_allreduce_fusion(
            allreduce_in=x, world_size=self.size, world_rank=self.rank, token_num=x.shape[0],
            hidden_dim=self.hidden, workspace_ptrs=self.workspace, launch_with_pdl=False, use_oneshot=None,
            trigger_completion_at_end=True, fp32_acc=True, pattern_code=pattern, quant_out=None, scale_out=None,
            scale_factor=None, layout_code=None, **args)

    def close(self) -> None:
        try:
            self.comm.trtllm_destroy_ipc_workspace_for_all_reduce_fusion(self.ipc_handles, group=dist.group.WORLD)
        except Exception as e:                   # the peers may be gone already
            log.debug("destroying the all-reduce workspace: %s", e)


def sum_in_norms(model, tp, max_tokens: int, dtype: torch.dtype) -> None:
    """--tp-all-reduce flashinfer: the model sums its sublayers' partial outputs in the norms after
    them, with FlashInfer's fused all-reduce + residual + RMSNorm on GPUs (all ranks, or none: then
    NCCL after each sublayer, as without the flag). On the CPU the same model structure sums over
    gloo: what CI checks the structure with."""
    if tp.device.type == "cuda":
        ar = try_flashinfer_all_reduce(tp, min(max_tokens, MAX_TOKENS), model.cfg.hidden_size, dtype)
        if ar is None:
            return
        tp.custom_all_reduce = ar
    else:
        log.warning("--tp-all-reduce flashinfer runs FlashInfer's kernel on GPUs only; on the CPU the norms "
                    "sum the partial outputs over gloo")
    model.fuse_reduce_into_norms(True)


def try_flashinfer_all_reduce(tp, max_tokens: int, hidden: int, dtype: torch.dtype) -> FlashInferAllReduce | None:
    """The custom all-reduce where every rank could build it (None, on every rank, where one could
    not: then NCCL, said once in the log)."""
    ar = tp.on_every_rank(lambda: FlashInferAllReduce(tp.rank, tp.size, max_tokens, hidden, dtype),
                          "FlashInfer's custom all-reduce")
    if ar is not None:
        log.info("tensor parallelism: FlashInfer's custom all-reduce (fused with the residual add and RMSNorm) "
                 "up to %d tokens, NCCL above", max_tokens)
    return ar
