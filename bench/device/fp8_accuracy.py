"""FP8 weights against bf16 weights, on the GPU: held-out loss and teacher-forced top-1 agreement on
the trained small subject (bench/device/train_small.py), logits relative error on the 8B
architecture (random weights).

  python bench/device/fp8_accuracy.py [--out FILE] [--only trained,8b] [--train-seconds S]
                                      [--corpus-tokens N] [--windows N] [--window-tokens T]

Two engines hold the same weights: bf16, and the same bf16 tensors quantized to FP8 at load
(`--quantization fp8`: per-channel scales). Each runs the same token windows through its real path
(FlashInfer attention, fused kernels, the FP8 kernels the tuner chose, chunked prefill): a window is
one prompt, a hook on the model's forward keeps the hidden state of every position, and the model's
own compute_logits turns them into float32 logits. Per position: the cross-entropy of the text's
next token (the held-out loss, trained subject), argmax equal in both engines (teacher-forced top-1
agreement: both read the same context), and ‖fp8 − bf16‖ / ‖bf16‖ of the logits. Windows of the
trained subject come from its held-out files; the 8B's are random token ids.
"""

from __future__ import annotations

import argparse
import dataclasses
import gc
import statistics

import torch
import torch.nn.functional as F

from common import Emitter  # noqa: E402  (sets sys.path)
from engine.engine import Engine  # noqa: E402
from engine.loader import write_arch_dir  # noqa: E402
from engine.model_runner import ModelRunner  # noqa: E402
from runtime.config import EngineConfig  # noqa: E402
from runtime.types import EngineRequest, SamplingParams  # noqa: E402
from train_small import Recipe, heldout_ids, train  # noqa: E402


class WindowLogits:
    """Float32 logits of every position of a prompt, from one engine's real prefill path."""

    def __init__(self, runner: ModelRunner, chunk_tokens: int) -> None:
        self.runner, self.hidden = runner, []
        self.engine = Engine(dataclasses.replace(runner.cfg, max_num_batched_tokens=chunk_tokens,
                                                 async_scheduling=False, enable_prefix_caching=False), runner)
        forward = runner.model.forward

        def keep(*args, **kwargs):
            h = forward(*args, **kwargs)
            self.hidden.append(h.clone())
            return h
        runner.model.forward = keep
        self._n = 0

    def __call__(self, tokens: list[int]) -> torch.Tensor:
        self._n += 1
        self.hidden.clear()
        self.engine.add_request(EngineRequest(f"w{self._n}", tokens, SamplingParams(temperature=0.0, max_tokens=1)))
        while self.engine.has_work:
            self.engine.step()
        hidden = torch.cat(self.hidden)                    # one request: its chunks in order
        assert hidden.shape[0] == len(tokens), (hidden.shape, len(tokens))
        with torch.inference_mode():
            return self.runner.model.compute_logits(hidden).float()


def compare(a: WindowLogits, b: WindowLogits, windows: list[list[int]]) -> dict:
    """a (FP8) against b (bf16) over `windows`: losses, top-1 agreement, logits relative error."""
    nll = {"a": [], "b": []}
    agree = total = 0
    errs: list[float] = []
    for w in windows:
        la, lb = a(w), b(w)
        target = torch.tensor(w[1:], device=la.device)
        nll["a"].append(F.cross_entropy(la[:-1], target, reduction="sum").item())
        nll["b"].append(F.cross_entropy(lb[:-1], target, reduction="sum").item())
        agree += (la.argmax(-1) == lb.argmax(-1)).sum().item()
        total += len(w)
        errs += ((la - lb).norm(dim=-1) / lb.norm(dim=-1)).tolist()
    positions = sum(len(w) - 1 for w in windows)
    loss_a, loss_b = sum(nll["a"]) / positions, sum(nll["b"]) / positions
    return {"fp8_loss": round(loss_a, 5), "bf16_loss": round(loss_b, 5),
            "loss_rel_diff": round((loss_a - loss_b) / loss_b, 5), "top1_agreement": round(agree / total, 5),
            "positions": total, "logits_rel_err_median": round(statistics.median(errs), 5),
            "logits_rel_err_p99": round(sorted(errs)[int(0.99 * (len(errs) - 1))], 5),
            "logits_rel_err_max": round(max(errs), 5)}


def _runners(base: EngineConfig) -> tuple[ModelRunner, ModelRunner]:
    bf16 = ModelRunner(base)
    fp8 = ModelRunner(dataclasses.replace(base, quantization="fp8"))
    assert fp8.quantization is not None and bf16.quantization is None
    return fp8, bf16


def _windows(ids: list[int], n: int, length: int, seed: int) -> list[list[int]]:
    g = torch.Generator().manual_seed(seed)
    starts = torch.randint(0, len(ids) - length, (n,), generator=g).tolist()
    return [ids[s:s + length] for s in starts]


def trained(emit, args) -> None:
    recipe = Recipe(corpus_tokens=args.corpus_tokens)
    model_dir = train("/tmp/splitserve-models/trained-hd128-fp8", recipe, max_seconds=args.train_seconds)
    base = EngineConfig(model=str(model_dir), num_blocks=1024, max_model_len=4096, cuda_graphs=False, seed=0)
    fp8, bf16 = _runners(base)
    windows = _windows(heldout_ids(model_dir), args.windows, args.window_tokens, 1)
    import json
    info = json.loads((model_dir / "train_info.json").read_text())
    r = compare(WindowLogits(fp8, args.chunk), WindowLogits(bf16, args.chunk), windows)
    emit(metric="fp8_accuracy", model="trained-hd128", weights="fp8 (online, per-channel) vs bf16",
         training={k: info[k] for k in ("steps", "final_loss", "heldout_loss", "seconds")},
         corpus_train_tokens=info["corpus"]["train_tokens"], windows=len(windows), window_tokens=args.window_tokens,
         chunk_tokens=args.chunk, within_1pct=abs(r["loss_rel_diff"]) <= 0.01, **r)


def arch_8b(emit, args) -> None:
    model_dir = write_arch_dir("llama-3.1-8b", "/tmp/splitserve-models/llama-3.1-8b")
    base = EngineConfig(model=str(model_dir), load_format="dummy", num_blocks=1024, max_model_len=8192,
                        cuda_graphs=False, seed=0)
    fp8, bf16 = _runners(base)
    g = torch.Generator().manual_seed(2)
    windows = [torch.randint(10, 128000, (args.window_tokens,), generator=g).tolist() for _ in range(args.windows_8b)]
    r = compare(WindowLogits(fp8, args.chunk), WindowLogits(bf16, args.chunk), windows)
    emit(metric="fp8_accuracy", model="llama-3.1-8b", weights="dummy bf16 vs the same quantized to fp8 at load",
         windows=len(windows), window_tokens=args.window_tokens, chunk_tokens=args.chunk, **r)


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--out", default=None)
    ap.add_argument("--only", default="trained,8b")
    ap.add_argument("--train-seconds", type=float, default=45.0)
    ap.add_argument("--corpus-tokens", type=int, default=8_000_000)
    ap.add_argument("--windows", type=int, default=64, help="trained subject: held-out windows")
    ap.add_argument("--windows-8b", type=int, default=8)
    ap.add_argument("--window-tokens", type=int, default=512)
    ap.add_argument("--chunk", type=int, default=2048, help="max_num_batched_tokens of both engines")
    args = ap.parse_args()
    emit = Emitter("fp8_accuracy", args.out)
    for name, fn in (("trained", trained), ("8b", arch_8b)):
        if name in args.only.split(","):
            try:
                fn(emit, args)
            except Exception as e:      # one failed part must not lose the other
                emit(metric="fp8_accuracy", model=name, error=repr(e)[:500])
            gc.collect()
            torch.cuda.empty_cache()


if __name__ == "__main__":
    main()
