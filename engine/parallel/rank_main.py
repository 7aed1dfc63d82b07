"""A tensor-parallel rank other than 0: `python -m engine.parallel.rank_main --fd N --kv-fd M`,
started by its worker (engine/parallel/ranks.py) with one end of a socket pair as fd N (the steps)
and one as fd M (its KV transfer agent, served on a thread: engine/parallel/kv.py `serve_kv`).

It reads its `RankInit`, joins the process group (NCCL on its GPU: cuda:RANK of the worker's
CUDA_VISIBLE_DEVICES; gloo on the CPU), builds its share of the model (engine/model_runner.py
`ModelRunner` with its `TpGroup`), answers `RankReady`, and then follows rank 0: every `StepPlan`
it receives runs as rank 0 runs it, until `RankStop` or until rank 0's end of the channel closes
(rank 0 is gone: so is this rank). No scheduler, gRPC or Redis here: those live on rank 0 alone.
"""

from __future__ import annotations

import argparse
import logging
import sys
import threading
import time
import traceback
from multiprocessing.connection import Connection

log = logging.getLogger("engine.parallel.rank")


def main(argv: list[str] | None = None) -> int:
    args = _args(argv)
    conn = Connection(args.fd)
    try:
        init = conn.recv()
    except EOFError:
        return 0
    from runtime.logging import setup_logging
    setup_logging(f"{init.worker}/rank{init.rank}")
    try:
        runner, tp = _start(init)
    except Exception as e:              # the worker logs why, then stops (it cannot run without us)
        log.error("rank %d failed to start: %s", init.rank, e)
        _send(conn, _failed(init.rank, e))
        return 1
    from engine.parallel.kv import serve_kv
    from engine.parallel.ranks import RankReady
    threading.Thread(target=serve_kv, args=(Connection(args.kv_fd), runner), name="tp-kv", daemon=True).start()
    conn.send(RankReady(init.rank, runner.num_blocks, dict(runner.startup_s)))
    try:
        return _follow(conn, runner)
    finally:
        runner.release_graphs()
        tp.close()


def _args(argv: list[str] | None) -> argparse.Namespace:
    p = argparse.ArgumentParser(prog="engine.parallel.rank_main", description="a tensor-parallel rank")
    p.add_argument("--fd", type=int, required=True, help="this rank's end of the step channel to rank 0")
    p.add_argument("--kv-fd", type=int, required=True, help="this rank's end of its KV agent's channel")
    return p.parse_args(argv)


def _start(init):
    """Join the group and build this rank's share of the model."""
    import torch
    from engine.model_runner import ModelRunner, resolve_device
    from engine.parallel.group import TpGroup
    device = resolve_device(init.cfg.device)
    if device.type == "cuda":
        device = torch.device("cuda", init.rank)
        torch.cuda.set_device(device)
    t0 = time.perf_counter()
    tp = TpGroup.join(init.rank, init.size, init.store_addr, device)
    joined_s = time.perf_counter() - t0
    runner = ModelRunner(init.cfg, tp)
    runner.startup_s = {"process_group": round(joined_s, 3), **runner.startup_s}
    return runner, tp


def _follow(conn: Connection, runner) -> int:
    """Run each plan rank 0 sends, in order, until told to stop or rank 0 is gone."""
    from engine.parallel.ranks import RankStop
    from engine.plan import StepPlan
    while True:
        try:
            msg = conn.recv()
        except (EOFError, OSError):
            log.info("rank 0 is gone: exiting")
            return 0
        if isinstance(msg, StepPlan):
            runner.follow(msg)
        elif isinstance(msg, RankStop):
            return 0
        else:
            raise TypeError(f"not a rank message: {type(msg).__name__}")


def _failed(rank: int, e: Exception):
    from engine.parallel.ranks import RankFailed
    detail = getattr(e, "message", None) or f"{type(e).__name__}: {e}"
    log.debug("%s", traceback.format_exc())
    return RankFailed(rank, detail)


def _send(conn: Connection, msg) -> None:
    try:
        conn.send(msg)
    except OSError:
        pass


if __name__ == "__main__":
    sys.exit(main())
