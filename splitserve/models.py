"""Resolves --model: a HF directory as given, or "tiny[-qwen2][:seed]" → the generated tiny model,
written once into a cache directory ($SPLITSERVE_CACHE, default ~/.cache/splitserve). A cached tiny
model whose tokenizer_config.json is older than this code's (a chat template that changed since) gets
the current one; its weights and tokenizer.json stay."""

from __future__ import annotations

import os
from pathlib import Path

from runtime.errors import InvalidRequest


def cache_dir() -> Path:
    return Path(os.environ.get("SPLITSERVE_CACHE", Path.home() / ".cache" / "splitserve"))


def resolve_model(spec: str) -> str:
    if spec.startswith("tiny"):
        name, _, seed = spec.partition(":")
        arch = "qwen2" if name == "tiny-qwen2" else "llama"
        if name not in ("tiny", "tiny-llama", "tiny-qwen2"):
            raise InvalidRequest(f"unknown tiny model {spec!r} (tiny, tiny-qwen2, tiny:SEED)")
        out = cache_dir() / "models" / f"tiny-{arch}-seed{int(seed or 0)}"
        if not (out / "model.safetensors").is_file():
            from splitserve.tiny_model import write_tiny_model
            tmp = out.with_name(out.name + f".tmp{os.getpid()}")
            try:
                write_tiny_model(tmp, arch=arch, seed=int(seed or 0))
            except ImportError as e:      # a control-plane install has no torch to make weights with
                raise InvalidRequest(f"writing the tiny model needs the engine extra "
                                     f"(pip install 'splitserve[engine]'): {e}") from None
            out.parent.mkdir(parents=True, exist_ok=True)
            try:
                tmp.rename(out)
            except OSError:  # another process won the race; theirs is identical
                import shutil
                shutil.rmtree(tmp, ignore_errors=True)
        _refresh_tokenizer_config(out, arch)
        return str(out)
    path = Path(spec).expanduser()
    if not (path / "config.json").is_file():
        raise InvalidRequest(f"--model {spec}: not a HF model directory (no config.json) and not 'tiny'")
    return str(path.resolve())


def _refresh_tokenizer_config(model_dir: Path, arch: str) -> None:
    import json
    from splitserve.tiny_model import tokenizer_config
    path, want = model_dir / "tokenizer_config.json", tokenizer_config(arch)
    try:
        if json.loads(path.read_text()) == want:
            return
    except (OSError, ValueError):
        pass
    tmp = path.with_name(path.name + f".tmp{os.getpid()}")
    tmp.write_text(json.dumps(want, indent=2, sort_keys=True) + "\n", encoding="utf-8")
    tmp.replace(path)
