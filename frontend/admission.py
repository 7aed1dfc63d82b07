"""Which discovered workers this frontend may use: those that serve its model with its block size.

A frontend and its workers must agree on the model (else token ids mean different things) and on
the KV block size (else the block hashes the router matches are not the workers'). The model is
named by `runtime.model_config.model_fingerprint` of the frontend's own model directory: the
contents of config.json and tokenizer.json, so paths and machines do not matter. The block size is
the frontend's `--block-size` when given, else the first accepted worker's, for the frontend's
whole life. A worker that disagrees is refused: it never joins the pool, the router or the counts
of /health. Pure logic: no I/O; the pool logs each refusal once.
"""

from __future__ import annotations

from dataclasses import dataclass

from runtime.discovery import WorkerInfo


@dataclass(slots=True)
class Admission:
    model_fingerprint: str
    block_size: int | None = None           # None until the first worker is accepted
    block_size_from: str = "--block-size"   # what fixed it: the flag, or the first worker

    def refusal(self, info: WorkerInfo) -> str | None:
        """Why `info` may not join (None: it may, and the first one fixes the block size)."""
        if info.model_fingerprint != self.model_fingerprint:
            return (f"it serves another model (fingerprint {info.model_fingerprint or 'none published'} "
                    f"of {info.model} on its machine; this frontend's is {self.model_fingerprint})")
        if self.block_size is None:
            self.block_size, self.block_size_from = info.block_size, f"worker {info.worker_id}"
        elif info.block_size != self.block_size:
            return (f"its KV block size is {info.block_size} tokens, this frontend's is {self.block_size} "
                    f"(from {self.block_size_from})")
        return None
