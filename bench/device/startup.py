"""Worker start-to-ready on the GPU: how long a new decode worker takes from process start to its lease
in Redis (the moment the router can send it work), and where the time goes.

  python bench/device/startup.py [--arch llama-3.1-8b] [--runs 3] [--out FILE] [--keep-weights DIR]

Writes a real safetensors checkpoint of the architecture (seeded random bf16 weights, sharded like
HF checkpoints) to local disk once, so the weights sit in the page cache as they do on a node that
served the model before, then starts `splitserve decode-worker --role aggregated` against an
embedded Redis `--runs` times. Each run prints a JSON line with the wall time from `Popen` to the
lease saying `ready`, and the phases the worker logs (`startup phases:` line: imports, weights, KV cache, attention
backend, CUDA graphs, ...). The first run pays FlashInfer's JIT compile unless its cache is warm
(`run.sh jit` before this stage); later runs show the steady start.
"""

from __future__ import annotations

import argparse
import json
import os
import re
import subprocess
import sys
import time
from pathlib import Path

from common import ROOT, Emitter  # noqa: E402  (sets sys.path)

import redis  # noqa: E402

from runtime.redis_embedded import EmbeddedRedis  # noqa: E402

_PHASES = re.compile(r"startup phases: (\{.*\})")


def write_checkpoint(arch: str, out: Path, shard_bytes: int = 4 << 30) -> float:
    """A safetensors checkpoint of `arch` with random bf16 weights; returns seconds spent."""
    import torch
    from safetensors.torch import save_file

    from engine.loader import write_arch_dir
    from runtime.model_config import ModelConfig

    t0 = time.perf_counter()
    write_arch_dir(arch, out)
    cfg = ModelConfig.from_dir(out)
    d, q, kv, inter = cfg.hidden_size, cfg.num_heads * cfg.head_dim, cfg.num_kv_heads * cfg.head_dim, \
        cfg.intermediate_size
    shapes = {"model.embed_tokens.weight": (cfg.vocab_size, d), "model.norm.weight": (d,)}
    if not cfg.tie_word_embeddings:
        shapes["lm_head.weight"] = (cfg.vocab_size, d)
    for i in range(cfg.num_layers):
        p = f"model.layers.{i}."
        shapes.update({p + "self_attn.q_proj.weight": (q, d), p + "self_attn.k_proj.weight": (kv, d),
                       p + "self_attn.v_proj.weight": (kv, d), p + "self_attn.o_proj.weight": (d, q),
                       p + "mlp.gate_proj.weight": (inter, d), p + "mlp.up_proj.weight": (inter, d),
                       p + "mlp.down_proj.weight": (d, inter), p + "input_layernorm.weight": (d,),
                       p + "post_attention_layernorm.weight": (d,)})
    gen = torch.Generator(device="cuda").manual_seed(0)
    shards, current, size, weight_map = [], {}, 0, {}
    for name, shape in shapes.items():
        t = (torch.randn(shape, generator=gen, device="cuda", dtype=torch.bfloat16) * 0.02).cpu()
        current[name] = t
        size += t.numel() * 2
        if size >= shard_bytes:
            shards.append(current)
            current, size = {}, 0
    if current:
        shards.append(current)
    for i, shard in enumerate(shards):
        fname = f"model-{i + 1:05d}-of-{len(shards):05d}.safetensors"
        save_file(shard, str(out / fname), metadata={"format": "pt"})
        weight_map.update({k: fname for k in shard})
    (out / "model.safetensors.index.json").write_text(json.dumps({"metadata": {}, "weight_map": weight_map}))
    return time.perf_counter() - t0


def start_once(model: Path, redis_url: str, log_path: Path, timeout_s: float, extra: list[str]) -> dict:
    client = redis.Redis.from_url(redis_url)
    for key in client.scan_iter(match="splitserve:worker:*"):
        client.delete(key)
    env = dict(os.environ, PYTHONUNBUFFERED="1")
    t0 = time.perf_counter()
    with open(log_path, "wb") as log:
        proc = subprocess.Popen([sys.executable, "-m", "splitserve", "decode-worker", "--model", str(model),
                                 "--redis-url", redis_url, "--role", "aggregated", "--device", "cuda", *extra],
                                cwd=ROOT, env=env, stdout=log, stderr=subprocess.STDOUT)
    ready_s = None
    try:
        while time.perf_counter() - t0 < timeout_s:
            # the lease appears as "starting" before the model loads; ready is what the router waits for
            if any(b'"state": "ready"' in (client.get(k) or b"") for k in client.scan_iter(match="splitserve:worker:*")):
                ready_s = time.perf_counter() - t0
                break
            if proc.poll() is not None:
                break
            time.sleep(0.02)
    finally:
        proc.terminate()
        try:
            proc.wait(60)
        except subprocess.TimeoutExpired:
            proc.kill()
            proc.wait()
    text = log_path.read_text(errors="replace")
    m = _PHASES.search(text)
    return {"start_to_ready_s": round(ready_s, 2) if ready_s else None,
            "phases_s": json.loads(m.group(1)) if m else None,
            "exit": proc.returncode, "log_tail": None if ready_s else text[-2000:]}


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--arch", default="llama-3.1-8b")
    ap.add_argument("--runs", type=int, default=3)
    ap.add_argument("--out", default=None)
    ap.add_argument("--weights-dir", default="/tmp/splitserve-startup-weights")
    ap.add_argument("--timeout-s", type=float, default=300)
    ap.add_argument("--worker-args", default="", help="extra decode-worker flags, space separated")
    args = ap.parse_args()
    emit = Emitter("startup", args.out)
    model = Path(args.weights_dir) / args.arch
    if not (model / "model.safetensors.index.json").is_file():
        model.mkdir(parents=True, exist_ok=True)
        emit(stage="write_checkpoint", arch=args.arch, seconds=round(write_checkpoint(args.arch, model), 1),
             bytes=sum(f.stat().st_size for f in model.glob("*.safetensors")))
    with EmbeddedRedis() as r:
        for i in range(args.runs):
            rec = start_once(model, r.url, Path(args.weights_dir) / f"worker-{i}.log", args.timeout_s,
                             args.worker_args.split())
            emit(stage="start_to_ready", arch=args.arch, run=i, weights="safetensors, page cache",
                 worker_args=args.worker_args, **rec)


if __name__ == "__main__":
    main()
