"""The text that train_small.py trains on, as token streams: which files, in which order, which are
held out, and where the token budget cuts the list. Knows nothing about models or training.

  repo    every *.py and *.md file under REPO_DIRS of this repository (~250k tokens), sorted by path;
          files 0, 20, 40, ... are held out. Small enough to be memorised.
  python  every *.py file of the Python installation running this: the stdlib directory, then the
          purelib and platlib directories; keyed "stdlib/json/decoder.py", "purelib/torch/nn/...",
          sorted by root then path. A site-packages inside the stdlib directory is skipped there: it
          is purelib, walked on its own, or in a venv the base interpreter's, not ours. A file is held
          out when a hash of its key is 0 mod 20, so installing or removing a package moves no other
          file between the halves. The stdlib alone is ~10M tokens (much of it its test suite); with
          torch, transformers, numpy... the whole is hundreds of MB, so a budget of tens of millions
          of tokens takes the stdlib and the packages up to some point in the alphabet.

Files over MAX_FILE_BYTES (generated tables) and files that are not UTF-8 (the stdlib's encoding tests)
are skipped. Files are read in order until the next one would take the total past the token budget, so
the same install and budget give the same streams. Each file enters its stream as bos + its tokens.
"""

from __future__ import annotations

import functools
import hashlib
import os
import sys
import sysconfig
import time
from dataclasses import dataclass
from pathlib import Path

import torch
from tokenizers import Tokenizer

from common import ROOT  # noqa: E402  (sets sys.path)
from splitserve.tiny_model import BOS_ID  # noqa: E402

CORPORA = ("python", "repo")
REPO_DIRS = ("bench", "decode_worker", "docs", "engine", "frontend", "kvstore", "planner",
             "prefill_worker", "router", "runtime", "splitserve", "tests")
HELDOUT_EVERY = 20                      # 1 file in 20 is held out
MAX_FILE_BYTES = 1 << 20
BATCH_CHARS = 8 << 20                   # text tokenized at once: enough for every core, bounded memory


@dataclass(frozen=True, slots=True)
class CorpusFile:
    key: str                            # the path relative to its root ("stdlib/os.py", "docs/x.md")
    path: Path
    heldout: bool


@dataclass(slots=True)
class Streams:
    train: torch.Tensor                 # int16 token ids (the vocab is 4096)
    heldout: torch.Tensor
    files_read: int                     # files of the list visited (read or skipped) before the budget ran out
    files_skipped: int
    num_train_files: int
    num_heldout_files: int
    chars: int
    seconds: float


def is_heldout(key: str) -> bool:
    """The python corpus's split: a function of the key alone, the same in every process."""
    return int.from_bytes(hashlib.sha1(key.encode()).digest()[:8], "little") % HELDOUT_EVERY == 0


@functools.cache
def corpus_files(corpus: str) -> tuple[CorpusFile, ...]:
    """The corpus's files in reading order (cached: listing site-packages takes a second)."""
    if corpus == "repo":
        files = sorted(p for d in REPO_DIRS for p in (ROOT / d).rglob("*") if p.suffix in (".py", ".md"))
        return tuple(CorpusFile(str(p.relative_to(ROOT)), p, i % HELDOUT_EVERY == 0) for i, p in enumerate(files))
    assert corpus == "python", corpus
    return tuple(CorpusFile(key, path, is_heldout(key)) for key, path in _python_files())


def _python_files() -> list[tuple[str, Path]]:
    paths, seen, out = sysconfig.get_paths(), set(), []
    for name in ("stdlib", "purelib", "platlib"):
        root = Path(paths[name]).resolve()
        if root in seen or not root.is_dir():
            continue                    # purelib and platlib are usually one directory
        seen.add(root)
        found = []
        for d, dirs, names in os.walk(root):
            if Path(d) == root and name == "stdlib":    # see the module docstring
                dirs[:] = [x for x in dirs if x not in ("site-packages", "dist-packages")]
            dirs[:] = [x for x in dirs if x != "__pycache__"]
            found += [Path(d, n) for n in names if n.endswith(".py")]
        out += sorted((f"{name}/{p.relative_to(root).as_posix()}", p) for p in found)
    return out


def _read(path: Path) -> str | None:
    try:
        if path.stat().st_size > MAX_FILE_BYTES:
            return None
        return path.read_text(encoding="utf-8")
    except (OSError, UnicodeDecodeError):
        return None


def read_streams(files: tuple[CorpusFile, ...] | list[CorpusFile], tok: Tokenizer, max_tokens: int,
                 label: str = "corpus") -> Streams:
    """Tokenize `files` in order into the training and held-out streams, stopping before the first
    file that would take their total past `max_tokens`. Text goes to the tokenizer in batches of up to
    BATCH_CHARS, no more than the rest of the budget is likely to need (encode_batch_fast: encode_batch
    without the offsets, which we do not use; both run on every core). Progress on stderr."""
    assert tok.get_vocab_size() <= 1 << 15, "ids are kept as int16"
    encode = getattr(tok, "encode_batch_fast", tok.encode_batch)
    parts: dict[bool, list[torch.Tensor]] = {False: [], True: []}
    total = chars = skipped = i = 0
    full, t0 = False, time.perf_counter()
    while i < len(files) and not full:
        batch, batch_chars, want = [], 0, min(BATCH_CHARS, 4 * (max_tokens - total))   # ~3 chars a token
        while i + len(batch) < len(files) and (not batch or batch_chars < want):
            batch.append(_read(files[i + len(batch)].path))
            batch_chars += len(batch[-1] or "")
        encodings = iter(encode([t for t in batch if t is not None], add_special_tokens=False))
        for text in batch:
            if text is None:
                skipped += 1
            else:
                ids = next(encodings).ids
                if total + len(ids) + 1 > max_tokens:
                    full = True
                    break
                parts[files[i].heldout].append(torch.tensor([BOS_ID] + ids, dtype=torch.int16))
                total, chars = total + len(ids) + 1, chars + len(text)
            i += 1
        print(f"{label}: {i}/{len(files)} files, {chars / 1e6:.1f} M chars, {total / 1e6:.2f} M tokens, "
              f"{time.perf_counter() - t0:.1f} s", file=sys.stderr, flush=True)
    return Streams(_cat(parts[False]), _cat(parts[True]), i, skipped, len(parts[False]), len(parts[True]),
                   chars, round(time.perf_counter() - t0, 2))


def _cat(parts: list[torch.Tensor]) -> torch.Tensor:
    return torch.cat(parts) if parts else torch.zeros(0, dtype=torch.int16)
