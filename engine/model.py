"""The Llama-family transformer (Llama, Mistral, Qwen2) over a paged KV cache.

One flattened batch per step: `forward(input_ids (T,), positions (T,))` → hidden states (T, E).
Attention goes through an `AttentionBackend`, which also writes the step's K/V into the cache.
Projections are fused at load time (q|k|v and gate|up) to halve the matmul launches; the HF
parameter names are mapped in engine/loader.py.

Two kernel sets compute the same function: plain torch (CPU, and the GPU reference), and FlashInfer's
fused kernels (`use_flashinfer_kernels`): add+RMSNorm in one kernel, RoPE in place on the q|k
projection output, SiLU·mul in one kernel. At batch 1 a decode step is ~10 kernels per layer
instead of ~30, which matters because each kernel costs ~2-3 µs even inside a CUDA graph. Where
Triton runs and the backend lets the model write K/V itself, RoPE and the K/V cache write are one
more fused kernel (engine/kernels/rope_kv.py; EngineConfig.fused_rope_kv=False turns it off).
The residual stream is carried beside the sublayer output (`x, residual`) so the add fuses into the
next norm. Both kernel sets round as FlashInfer's kernels do: add, norm × weight and SiLU·mul are
computed in float32 and rounded to the model dtype once (the residual sum is stored rounded, the norm
reads it unrounded). HF's Llama rounds twice in the norm (x̂ to the dtype, then × weight) and in
SiLU·mul; in float32 the two are the same, in bf16 this is the closer one to float32.

Every projection is an engine/layers/linear.py `Linear` whose method (model dtype, or FP8 from
engine/quant/) owns its storage and GEMM; `method_for` picks it per HF module name at construction.

Tensor parallelism (`tp`, an engine/parallel/group.py `TpGroup` of size N): a rank builds its share
(runtime/tensor_parallel.py): q|k|v and gate|up column-parallel, o_proj and down row-parallel and
all-reduced, the embedding and the LM head split by vocabulary rows (the embedding all-reduced, the
logits all-gathered). Attention and the KV cache hold the rank's heads only. The step's token ids
are broadcast from rank 0 first: only rank 0 samples, so only it knows the ids an async step reads
from the device. Size 1 runs the same code with identity collectives. With `fuse_reduce_into_norms`
the attention and MLP outputs stay partial sums and the next norm sums them (one kernel with
FlashInfer's all-reduce + residual add + RMSNorm: `--tp-all-reduce flashinfer`).
"""

from __future__ import annotations

from typing import Callable

import torch
import torch.nn.functional as F
from torch import nn

from engine.attention.base import AttentionBackend
from engine.layers.linear import COLUMN, ROW, Linear, LinearMethod, Split, rank_rows
from engine.parallel.group import SINGLE, TpGroup
from runtime.errors import InvalidRequest
from runtime.model_config import ModelConfig
from runtime.tensor_parallel import RankShare, rank_share
from engine.rope import RotaryEmbedding

MethodFor = Callable[[tuple[str, ...]], LinearMethod]   # HF module names of a (fused) Linear -> its method


def _dense(modules: tuple[str, ...]) -> LinearMethod:
    return _DENSE


_DENSE = LinearMethod()


class RMSNorm(nn.Module):
    def __init__(self, dim: int, eps: float, dtype: torch.dtype = torch.float32) -> None:
        super().__init__()
        self.weight = nn.Parameter(torch.ones(dim, dtype=dtype))
        self.eps = eps
        self.fi = None                       # the flashinfer module when its kernels are on

    def forward(self, x: torch.Tensor, residual: torch.Tensor | None = None):
        """norm(x) if residual is None, else (norm(x + residual), x + residual).
        The FlashInfer path updates x and residual in place."""
        if residual is None:
            return self.fi.norm.rmsnorm(x, self.weight, self.eps) if self.fi else self._norm(x)
        if self.fi:
            self.fi.norm.fused_add_rmsnorm(x, residual, self.weight, self.eps)
            return x, residual
        total = x.float() + residual.float()
        return self._norm(total, x.dtype), total.to(x.dtype)

    def _norm(self, x: torch.Tensor, dtype: torch.dtype | None = None) -> torch.Tensor:
        xf = x.float()
        xf = xf * torch.rsqrt(xf.pow(2).mean(-1, keepdim=True) + self.eps)
        return (xf * self.weight.float()).to(dtype or x.dtype)


class Attention(nn.Module):
    def __init__(self, cfg: ModelConfig, layer: int, dtype: torch.dtype, method_for: MethodFor,
                 share: RankShare, tp: TpGroup = SINGLE) -> None:
        super().__init__()
        self.layer, self.tp = layer, tp
        self.num_heads, self.num_kv_heads, self.head_dim = share.num_heads, share.num_kv_heads, cfg.head_dim
        self.q_size = share.num_heads * cfg.head_dim                        # this rank's heads
        self.kv_size = share.num_kv_heads * cfg.head_dim
        hf = f"model.layers.{layer}.self_attn."
        self.qkv_proj = Linear(cfg.hidden_size, self.q_size + 2 * self.kv_size, cfg.attention_bias,
                               method_for((hf + "q_proj", hf + "k_proj", hf + "v_proj")), dtype,
                               parts=(self.q_size, self.kv_size, self.kv_size), split=_split(COLUMN, share))
        self.o_proj = Linear(self.q_size, cfg.hidden_size, False, method_for((hf + "o_proj",)), dtype,
                             split=_split(ROW, share))
        self.reduce_out = True               # False: return this rank's partial sum (the next norm sums)
        self.fi = None
        self.rope_kv = None                  # engine.kernels.rope_kv.rope_and_write_kv when it is on

    def forward(self, x: torch.Tensor, positions: torch.Tensor, rope: RotaryEmbedding,
                backend: AttentionBackend, kv_layer: torch.Tensor,
                cos_sin_cache: torch.Tensor | None = None) -> torch.Tensor:
        T = x.shape[0]
        qkv = self.qkv_proj(x)                                                # (T, q + 2kv)
        kv_rows = backend.step_kv_rows() if self.rope_kv else None
        if kv_rows is not None:              # one kernel: RoPE on q and k, k and v into the cache
            self.rope_kv(qkv, positions, cos_sin_cache, kv_layer, kv_rows, self.num_heads,
                         self.num_kv_heads, self.head_dim)
            q = qkv[:, :self.q_size].view(T, self.num_heads, self.head_dim)
            o = backend.attend(self.layer, q, kv_layer)                       # (T, H, D)
            return self._out(o.reshape(T, self.q_size))
        q, k, v = qkv.split([self.q_size, self.kv_size, self.kv_size], dim=-1)
        if self.fi:
            self.fi.rope.apply_rope_with_cos_sin_cache_inplace(
                positions, q, k, self.head_dim, cos_sin_cache, is_neox=True)
            q = q.view(T, self.num_heads, self.head_dim)
            k = k.view(T, self.num_kv_heads, self.head_dim)
        else:
            q = rope(q.view(T, self.num_heads, self.head_dim), positions)    # (T, H, D)
            k = rope(k.view(T, self.num_kv_heads, self.head_dim), positions) # (T, Hkv, D)
        v = v.view(T, self.num_kv_heads, self.head_dim)
        o = backend.forward(self.layer, q, k, v, kv_layer)                    # (T, H, D)
        return self._out(o.reshape(T, self.q_size))

    def _out(self, o: torch.Tensor) -> torch.Tensor:
        y = self.o_proj(o)
        return self.tp.all_reduce(y) if self.reduce_out else y


class MLP(nn.Module):
    def __init__(self, cfg: ModelConfig, layer: int, dtype: torch.dtype, method_for: MethodFor,
                 share: RankShare, tp: TpGroup = SINGLE) -> None:
        super().__init__()
        self.intermediate = I = share.intermediate_size                      # this rank's features
        self.tp = tp
        hf = f"model.layers.{layer}.mlp."
        self.gate_up_proj = Linear(cfg.hidden_size, 2 * I, False, method_for((hf + "gate_proj", hf + "up_proj")),
                                   dtype, parts=(I, I), split=_split(COLUMN, share))
        self.down_proj = Linear(I, cfg.hidden_size, False, method_for((hf + "down_proj",)), dtype,
                                split=_split(ROW, share))
        self.reduce_out = True               # False: return this rank's partial sum (the next norm sums)
        self.fi = None

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        y = self._partial(x)
        return self.tp.all_reduce(y) if self.reduce_out else y

    def _partial(self, x: torch.Tensor) -> torch.Tensor:
        """down(silu(gate) * up) of this rank's features: under TP, one term of the sum."""
        gate_up = self.gate_up_proj(x)                                        # (T, 2I)
        down = self.down_proj
        if down.method.fuses_silu_mul(down, gate_up.shape[0]):   # FP8 W8A8: SiLU·mul writes fp8 itself
            return down.method.apply_silu_mul(down, gate_up)
        if self.fi:
            return self.down_proj(self.fi.activation.silu_and_mul(gate_up))
        gate, up = gate_up.split(self.intermediate, dim=-1)
        return self.down_proj((F.silu(gate.float()) * up.float()).to(gate_up.dtype))


class DecoderLayer(nn.Module):
    def __init__(self, cfg: ModelConfig, layer: int, dtype: torch.dtype, method_for: MethodFor,
                 share: RankShare, tp: TpGroup = SINGLE) -> None:
        super().__init__()
        self.input_layernorm = RMSNorm(cfg.hidden_size, cfg.rms_norm_eps, dtype)
        self.self_attn = Attention(cfg, layer, dtype, method_for, share, tp)
        self.post_attention_layernorm = RMSNorm(cfg.hidden_size, cfg.rms_norm_eps, dtype)
        self.mlp = MLP(cfg, layer, dtype, method_for, share, tp)
        self.tp, self.fuse_reduce = tp, False

    def forward(self, x, residual, positions, rope, backend, kv_layer, cos_sin_cache=None):
        """x: the previous sublayer's output (or the embeddings, with residual None); with
        `fuse_reduce`, sublayer outputs are partial sums that the norms sum."""
        if residual is None:
            residual = x
            h = self.input_layernorm(x)
        else:
            h, residual = add_norm(self.input_layernorm, x, residual, self.tp if self.fuse_reduce else None)
        h = self.self_attn(h, positions, rope, backend, kv_layer, cos_sin_cache)
        h, residual = add_norm(self.post_attention_layernorm, h, residual, self.tp if self.fuse_reduce else None)
        return self.mlp(h), residual


def add_norm(norm: RMSNorm, x: torch.Tensor, residual: torch.Tensor, sum_over: TpGroup | None):
    """(norm(x + residual), x + residual); `sum_over`: x is a partial sum over that group's ranks."""
    return norm(x, residual) if sum_over is None else sum_over.reduce_add_norm(norm, x, residual)


class VocabEmbedding(nn.Module):
    """The token embedding, split by vocabulary rows under TP: a rank looks up the ids in its rows,
    zeros elsewhere, and the all-reduce assembles every row (exact: one term is not zero)."""

    def __init__(self, cfg: ModelConfig, share: RankShare, dtype: torch.dtype, tp: TpGroup = SINGLE) -> None:
        super().__init__()
        self.tp, self.vocab_size = tp, cfg.vocab_size
        self.start, self.rows = share.vocab_start, share.vocab_rows
        self.weight = nn.Parameter(torch.empty(self.rows, cfg.hidden_size, dtype=dtype), requires_grad=False)

    def load(self, tensor: torch.Tensor) -> None:
        """Copy this rank's rows of the whole (vocab, hidden) table (zeros past the vocabulary)."""
        want = (self.vocab_size, self.weight.shape[1])
        if tuple(tensor.shape) != want:
            raise InvalidRequest(f"embed_tokens.weight has shape {tuple(tensor.shape)}, expected {want}")
        with torch.no_grad():
            self.weight.copy_(rank_rows(tensor, self.tp.rank, self.rows).to(self.weight.dtype))

    def forward(self, input_ids: torch.Tensor) -> torch.Tensor:
        if not self.tp.split:
            return F.embedding(input_ids, self.weight)
        local = input_ids - self.start
        inside = (local >= 0) & (local < self.rows)
        x = F.embedding(local.clamp(0, self.rows - 1), self.weight) * inside.unsqueeze(-1).to(self.weight.dtype)
        return self.tp.all_reduce(x)


class CausalLM(nn.Module):
    def __init__(self, cfg: ModelConfig, dtype: torch.dtype = torch.float32, method_for: MethodFor = _dense,
                 tp: TpGroup = SINGLE) -> None:
        """`method_for`: the LinearMethod of each projection, by its HF module names (default: the
        model dtype everywhere). A tied lm_head is the embedding table: always the model dtype.
        `tp`: the tensor-parallel group this model is one rank's share of."""
        super().__init__()
        self.cfg, self.tp = cfg, tp
        self.share = share = rank_share(cfg, tp.rank, tp.size)
        self.embed_tokens = VocabEmbedding(cfg, share, dtype, tp)
        self.layers = nn.ModuleList(DecoderLayer(cfg, i, dtype, method_for, share, tp) for i in range(cfg.num_layers))
        self.norm = RMSNorm(cfg.hidden_size, cfg.rms_norm_eps, dtype)
        head = _DENSE if cfg.tie_word_embeddings else method_for(("lm_head",))
        self.lm_head = Linear(cfg.hidden_size, share.vocab_rows, False, head, dtype, split=_split(COLUMN, share))
        self.fuse_reduce = False                # sublayers return partial sums; the norms sum them
        self.rope: RotaryEmbedding | None = None
        self.cos_sin_cache: torch.Tensor | None = None   # (P, D) float32: FlashInfer's RoPE table
        self.layer_waits: list | None = None    # per-layer CUDA events for one step (KV tiers' layered onboard)
        self.layer_driver = None                # kvstore.movers.cuda_driver.Driver: the waits inside a graph capture

    def setup_rope(self, max_positions: int, device: torch.device) -> None:
        c = self.cfg
        self.rope = RotaryEmbedding(c.head_dim, c.rope_theta, c.rope_scaling, max_positions, device)
        self.cos_sin_cache = torch.cat((self.rope.cos, self.rope.sin), dim=-1).contiguous()

    def linears(self) -> list[Linear]:
        return [m for m in self.modules() if isinstance(m, Linear)]

    def finish_loading(self) -> None:
        """Every weight is in: each method quantizes, dequantizes or re-lays out its layers (a
        row-parallel shard quantized here first learns its whole rows' amax from the other ranks)."""
        for m in self.linears():
            if m.split is not None and m.split.kind == ROW and m.method.quantizes_at_load(m):
                m.row_amax = self.tp.all_reduce_max(m.weight.detach().float().abs().amax(dim=1))
            m.method.finish_loading(m)

    def prepare_kernels(self, max_tokens: int) -> None:
        """Let each method pick its kernels for up to `max_tokens` rows (before CUDA graphs)."""
        by_method: dict[int, tuple[LinearMethod, list[Linear]]] = {}
        for m in self.linears():
            by_method.setdefault(id(m.method), (m.method, []))[1].append(m)
        for method, layers in by_method.values():
            method.prepare(layers, max_tokens)

    def use_input_major_weights(self) -> None:
        """Store o_proj, gate|up, down and an untied lm_head (in, out) where their method keeps the
        model dtype (GPU decode speed; a tied lm_head stays, its weight is the embedding table)."""
        for layer in self.layers:
            for m in (layer.self_attn.o_proj, layer.mlp.gate_up_proj, layer.mlp.down_proj):
                m.method.make_input_major(m)
        if self.lm_head.weight is not self.embed_tokens.weight:
            self.lm_head.method.make_input_major(self.lm_head)

    def fuse_reduce_into_norms(self, on: bool = True) -> None:
        """Under TP: sum each sublayer's partial output in the norm after it (`TpGroup.reduce_add_norm`:
        one kernel where a custom all-reduce fuses the residual add and RMSNorm) instead of after it."""
        on = on and self.tp.split
        self.fuse_reduce = on
        for m in self.modules():
            if isinstance(m, (Attention, MLP)):
                m.reduce_out = not on
            elif isinstance(m, DecoderLayer):
                m.fuse_reduce = on

    def use_flashinfer_kernels(self, flashinfer_module, fused_rope_kv: bool = True) -> None:
        """Switch norms, RoPE and SiLU·mul to FlashInfer's fused kernels (None: back to torch), and
        RoPE + K/V write to the Triton kernel where it runs (unless `fused_rope_kv` is off)."""
        rope_kv = _fused_rope_kv(self.cfg.head_dim) if flashinfer_module and fused_rope_kv else None
        for m in self.modules():
            if isinstance(m, (RMSNorm, Attention, MLP)):
                m.fi = flashinfer_module
            if isinstance(m, Attention):
                m.rope_kv = rope_kv

    def forward(self, input_ids: torch.Tensor, positions: torch.Tensor, backend: AttentionBackend,
                kv_cache: torch.Tensor) -> torch.Tensor:
        """input_ids, positions: (T,); kv_cache: (L, N, 2, bs, Hkv, D) of this rank's heads. Returns
        hidden (T, E). Under TP `input_ids` is overwritten with rank 0's first."""
        x, residual = self.embed_tokens(self.tp.broadcast_(input_ids)), None
        waits = self.layer_waits
        for i, layer in enumerate(self.layers):
            if waits is not None:           # this layer's KV is being onboarded: read it once it landed
                self._wait_layer(waits[i], x.device)
            x, residual = layer(x, residual, positions, self.rope, backend, kv_cache[i], self.cos_sin_cache)
        return add_norm(self.norm, x, residual, self.tp if self.fuse_reduce else None)[0]

    def _wait_layer(self, event, device) -> None:
        stream = torch.cuda.current_stream(device)
        if torch.cuda.is_current_stream_capturing():      # an external-event node: waited on at each replay
            self.layer_driver.wait_external(stream.cuda_stream, event.cuda_event)
        else:
            stream.wait_event(event)

    def compute_logits(self, hidden: torch.Tensor) -> torch.Tensor:
        """(R, E) → (R, V) float32. On CUDA the bf16/fp16 matmul writes float32 directly: rounding
        logits of ~50 to bf16 (steps of 0.25) would create exact ties and flip greedy choices."""
        logits = self._local_logits(hidden)                                    # (R, V / tp)
        if not self.tp.split:
            return logits
        return self.tp.all_gather_rows(logits)[:, :self.cfg.vocab_size]

    def _local_logits(self, hidden: torch.Tensor) -> torch.Tensor:
        head = self.lm_head
        w_t = head.weight_t if head.weight_t is not None else head.weight.t()   # the lm_head is never fp8
        if hidden.is_cuda and w_t.dtype != torch.float32 and _MM_OUT_DTYPE[0]:
            try:
                return torch.mm(hidden, w_t, out_dtype=torch.float32)
            except (RuntimeError, TypeError):
                _MM_OUT_DTYPE[0] = False
        return head(hidden).float()


_MM_OUT_DTYPE = [True]   # torch.mm(..., out_dtype=) available here (checked on first use)


def _split(kind: str, share: RankShare) -> Split | None:
    return Split(kind, share.rank, share.size) if share.size > 1 else None


def _fused_rope_kv(head_dim: int):
    """The fused RoPE + K/V-write kernel, or None where Triton or CUDA is missing or the head dim is
    not one it handles."""
    from engine.kernels import rope_kv
    return rope_kv.rope_and_write_kv if rope_kv.available() and rope_kv.supports(head_dim) else None
