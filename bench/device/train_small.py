"""Trains a small Llama on Python source: a test subject for bench/device/correctness.py whose
next-token distributions are peaked like a real model's (random weights have near-ties at almost
every step, so no bf16 implementation reproduces their greedy tokens).

  python bench/device/train_small.py --out DIR [--corpus python|repo] [--corpus-tokens N] [--steps N]
                                     [--max-seconds S] [--device cuda] [--shape tiny]

The model is HF `LlamaForCausalLM` in correctness.py's "small-hd128" shape (head_dim 128, 4 query
heads per KV head, untied lm_head) with the tiny model's 4096-token tokenizer (splitserve/tiny_model.py).
Corpus (train_corpus.py): by default the *.py files of the Python installation running this, up to
30M tokens, 1 file in 20 held out as the prompt source (`heldout_ids`). 2,500 steps of 32k tokens
see it ~2.7 times: enough to be confident where code is predictable, too little to memorise, so
held-out text gets peaked distributions where a real model's would be peaked and near-ties where its
would be, too. (`--corpus repo`, this repository's ~250k tokens, is memorised instead: train loss
~0.03 but held-out loss ~3.4, near-ties on every held-out prompt.) Training is seeded (initialisation
and data order; GPU kernels are not bitwise deterministic): AdamW on float32 weights under bf16
autocast on the GPU, random 512-token windows, linear warm-up then cosine decay. `--max-seconds`
times the first steps and cuts the step count to fit (the cosine then ends at the cut), with a hard
stop as well. Saves bf16 safetensors, the tokenizer and train_info.json; a directory holding a model
of the same `Recipe` is reused. Knows nothing about our engine beyond checking that it reads the config.
"""

from __future__ import annotations

import argparse
import dataclasses
import json
import math
import os
import shutil
import sys
import time
from dataclasses import dataclass, field
from pathlib import Path

import torch
import torch.nn.functional as F
from tokenizers import Tokenizer
from transformers import LlamaConfig, LlamaForCausalLM

from train_corpus import CORPORA, MAX_FILE_BYTES, corpus_files, read_streams  # (its `common` import sets sys.path)
from runtime.model_config import ModelConfig  # noqa: E402
from splitserve.tiny_model import BOS_ID, EOS_ID, PAD_ID, build_tokenizer, tokenizer_config  # noqa: E402

MAX_SECONDS = 150.0                     # default time budget of the training loop
HELDOUT_PROMPT_TOKENS = 2_000_000       # heldout_ids' cap: prompts need far less than the whole stream

# correctness.py's small-hd128: the 8B's attention shape (head_dim 128, GQA 4) at 1/4 of its width
HD128 = dict(hidden_size=1024, num_hidden_layers=4, num_attention_heads=8, num_key_value_heads=2,
             head_dim=128, intermediate_size=2816)
TINY = dict(hidden_size=64, num_hidden_layers=2, num_attention_heads=4, num_key_value_heads=2,
            head_dim=16, intermediate_size=128)
SHAPES = {"hd128": HD128, "tiny": TINY}


@dataclass(frozen=True, slots=True)
class Recipe:
    """Everything that decides the weights (but the installed files a corpus is read from): a saved
    model is reused only for an equal recipe. ~53 M parameters at HD128 and 64 x 512 tokens a step:
    ~11 TFLOP a step (6 x params x tokens); on an H100 ~17 steps/s, so 2,500 steps take ~145 s."""
    shape: dict = field(default_factory=lambda: dict(HD128))
    corpus: str = "python"
    corpus_tokens: int = 30_000_000     # the training and held-out streams together
    steps: int = 2500
    batch_size: int = 64
    seq_len: int = 512
    lr: float = 1e-3
    warmup_steps: int = 50
    weight_decay: float = 0.1
    seed: int = 0


def model_config(shape: dict) -> LlamaConfig:
    return LlamaConfig(vocab_size=4096, **shape, rms_norm_eps=1e-5, max_position_embeddings=4096,
                       rope_parameters={"rope_type": "default", "rope_theta": 500000.0},
                       tie_word_embeddings=False, bos_token_id=BOS_ID, eos_token_id=EOS_ID,
                       pad_token_id=PAD_ID)


def heldout_ids(model_dir: str | Path, max_tokens: int = HELDOUT_PROMPT_TOKENS) -> list[int]:
    """The first `max_tokens` of the held-out stream that the model in `model_dir` was evaluated on:
    its corpus's held-out files among those read before the budget ran out (train_info.json), with
    its saved tokenizer. Re-read rather than saved, so it is only as stable as the files."""
    info = json.loads((Path(model_dir) / "train_info.json").read_text())
    files = corpus_files(info["recipe"]["corpus"])[:info["corpus"]["files_read"]]
    tok = Tokenizer.from_file(str(Path(model_dir) / "tokenizer.json"))
    budget = max_tokens + MAX_FILE_BYTES + 1        # reads past max_tokens: no file has more tokens than bytes
    return read_streams([f for f in files if f.heldout], tok, budget, "held out").heldout[:max_tokens].tolist()


def lr_at(step: int, total: int, r: Recipe) -> float:
    """Linear warm-up, then cosine down to a tenth of the peak at `total`."""
    warmup = min(r.warmup_steps, total // 10)
    if step < warmup:
        return r.lr * (step + 1) / warmup
    t = (step - warmup) / max(total - warmup, 1)
    return r.lr * (0.1 + 0.45 * (1 + math.cos(math.pi * min(t, 1.0))))


def _windows(ids: torch.Tensor, n: int, seq_len: int, g: torch.Generator) -> torch.Tensor:
    starts = torch.randint(0, len(ids) - seq_len - 1, (n,), generator=g)
    return ids[starts[:, None] + torch.arange(seq_len + 1)].long()   # (n, seq_len + 1)


def _loss(model: LlamaForCausalLM, w: torch.Tensor) -> torch.Tensor:
    """Next-token cross-entropy of windows `w` (B, T + 1); bf16 autocast on the GPU."""
    with torch.autocast(w.device.type, dtype=torch.bfloat16, enabled=w.device.type == "cuda"):
        logits = model(input_ids=w[:, :-1], use_cache=False).logits      # (B, T, V)
    return F.cross_entropy(logits.float().flatten(0, 1), w[:, 1:].flatten())


def train(out_dir: str | Path, recipe: Recipe = Recipe(), device: str = "cuda", max_seconds: float | None = None,
          log_every: int = 50) -> Path:
    """Train and save into `out_dir` (written to a temporary sibling, then renamed), unless it
    already holds a model of `recipe`. Returns `out_dir`."""
    out = Path(out_dir)
    if _saved_recipe(out) == dataclasses.asdict(recipe):
        print(f"reusing {out} (same recipe)", flush=True)
        return out
    dev = torch.device(device)
    tok = build_tokenizer("llama")
    files = corpus_files(recipe.corpus)
    s = read_streams(files, tok, recipe.corpus_tokens, recipe.corpus)
    ids, held = s.train.to(dev), s.heldout.to(dev)
    corpus = {"files_listed": len(files), "files_read": s.files_read, "files_skipped": s.files_skipped,
              "train_files": s.num_train_files, "heldout_files": s.num_heldout_files, "chars": s.chars,
              "train_tokens": len(ids), "heldout_tokens": len(held), "read_seconds": s.seconds}
    print(f"corpus {recipe.corpus}: {json.dumps(corpus)}", file=sys.stderr, flush=True)
    torch.manual_seed(recipe.seed)
    model = LlamaForCausalLM(model_config(recipe.shape)).to(dev)
    num_params = sum(p.numel() for p in model.parameters())
    print(f"{num_params / 1e6:.1f} M parameters, {len(ids):,} training tokens, {len(held):,} held out, "
          f"device {dev}", flush=True)
    g = torch.Generator().manual_seed(recipe.seed + 1)
    info = _fit(model, ids, recipe, g, max_seconds, log_every)
    model.eval()
    with torch.no_grad():
        w = _windows(held, 32, min(recipe.seq_len, len(held) - 2), g)
        info["heldout_loss"] = round(_loss(model, w).item(), 4)
    info = {"recipe": dataclasses.asdict(recipe), **info, "corpus": corpus, "num_params": num_params,
            "device": str(dev), "torch": torch.__version__, "python": sys.version.split()[0]}
    print(json.dumps(info), flush=True)
    _save(out, model, tok, info)
    return out


def _fit(model: LlamaForCausalLM, ids: torch.Tensor, r: Recipe, g: torch.Generator,
         max_seconds: float | None, log_every: int) -> dict:
    """The training loop. With `max_seconds`, steps 2..12 are timed (after allocator and cuBLAS
    warm-up, still inside the warm-up of the schedule) and the step count is cut to what fits."""
    model.train()
    cuda = ids.device.type == "cuda"
    params = list(model.parameters())
    opt = torch.optim.AdamW([{"params": [p for p in params if p.ndim >= 2], "weight_decay": r.weight_decay},
                             {"params": [p for p in params if p.ndim < 2], "weight_decay": 0.0}],
                            lr=r.lr, betas=(0.9, 0.95), fused=cuda)
    total, step, tokens_per_step = r.steps, 0, r.batch_size * r.seq_len
    t0 = t_log = time.perf_counter()
    while step < total:
        for grp in opt.param_groups:
            grp["lr"] = lr_at(step, total, r)
        loss = _loss(model, _windows(ids, r.batch_size, r.seq_len, g))
        opt.zero_grad(set_to_none=True)
        loss.backward()
        torch.nn.utils.clip_grad_norm_(params, 1.0)
        opt.step()
        step += 1
        if step == 1:
            first_loss = loss.item()
        if max_seconds and step in (2, 12):
            if cuda:
                torch.cuda.synchronize()
            now = time.perf_counter()
            if step == 2:
                t_probe = now
            else:
                total = min(total, step + int((max_seconds - (now - t0)) / ((now - t_probe) / 10)))
        if step % log_every == 0 or step == total:
            now, n = time.perf_counter(), (step - 1) % log_every + 1
            print(f"step {step}/{total} loss {loss.item():.4f} lr {lr_at(step - 1, total, r):.2e} "
                  f"{n * tokens_per_step / (now - t_log):,.0f} tok/s {now - t0:.1f} s", flush=True)
            t_log = now
        if max_seconds and time.perf_counter() - t0 > max_seconds:
            print(f"stopped at step {step}: past --max-seconds {max_seconds}", flush=True)
            break
    seconds = time.perf_counter() - t0
    return {"steps": step, "first_loss": round(first_loss, 4), "final_loss": round(loss.item(), 4),
            "seconds": round(seconds, 1), "tokens_per_s": round(step * tokens_per_step / seconds)}


def _save(out: Path, model: LlamaForCausalLM, tok: Tokenizer, info: dict) -> None:
    tmp = out.with_name(out.name + f".tmp{os.getpid()}")
    model.to(torch.bfloat16).save_pretrained(tmp)       # transformers 5 writes only safetensors
    tok.save(str(tmp / "tokenizer.json"))
    tok_cfg = {**tokenizer_config("llama"), "model_max_length": model.config.max_position_embeddings}
    (tmp / "tokenizer_config.json").write_text(json.dumps(tok_cfg, indent=2) + "\n")
    (tmp / "train_info.json").write_text(json.dumps(info, indent=2) + "\n")
    assert (tmp / "model.safetensors").is_file(), sorted(os.listdir(tmp))
    mc, shape = ModelConfig.from_dir(tmp), info["recipe"]["shape"]   # what our engine will read
    assert (mc.rope_theta, mc.rope_scaling, mc.head_dim, mc.num_kv_heads, mc.tie_word_embeddings) == (
        500000.0, None, shape["head_dim"], shape["num_key_value_heads"], False), mc
    if out.exists():
        assert _saved_recipe(out) is not None, f"{out} exists and holds no model of ours; not replacing it"
        shutil.rmtree(out)
    tmp.rename(out)


def _saved_recipe(out: Path) -> dict | None:
    info = out / "train_info.json"
    return json.loads(info.read_text())["recipe"] if info.is_file() else None


def main() -> None:
    ap, default = argparse.ArgumentParser(description=__doc__.splitlines()[0]), Recipe()
    ap.add_argument("--out", required=True)
    ap.add_argument("--corpus", choices=CORPORA, default=default.corpus)
    ap.add_argument("--corpus-tokens", type=int, default=default.corpus_tokens,
                    help="token budget of the training and held-out streams together")
    ap.add_argument("--steps", type=int, default=default.steps)
    ap.add_argument("--max-seconds", type=float, default=MAX_SECONDS, help="time budget of the training loop")
    ap.add_argument("--device", default="cuda" if torch.cuda.is_available() else "cpu")
    ap.add_argument("--shape", choices=sorted(SHAPES), default="hd128")
    ap.add_argument("--batch-size", type=int, default=default.batch_size)
    ap.add_argument("--seq-len", type=int, default=default.seq_len)
    ap.add_argument("--lr", type=float, default=default.lr)
    ap.add_argument("--log-every", type=int, default=50)
    args = ap.parse_args()
    recipe = Recipe(shape=dict(SHAPES[args.shape]), corpus=args.corpus, corpus_tokens=args.corpus_tokens,
                    steps=args.steps, batch_size=args.batch_size, seq_len=args.seq_len, lr=args.lr)
    train(args.out, recipe, args.device, args.max_seconds, args.log_every)


if __name__ == "__main__":
    main()
