"""`splitserve pools ...` and `splitserve workers ...`: the operator's commands, over the admin API.

    splitserve pools status [--json] [--watch [S]]     pools at a glance (and their workers with --json)
    splitserve pools scale [--prefill N] [--decode M]  an override, held until `pools release`
    splitserve pools release [--prefill] [--decode]    back to the planner's (or the start) size
    splitserve pools limits [--decode-min N] [--decode-max N] [--prefill-min N] [--prefill-max N]
    splitserve workers list [--json]
    splitserve workers drain ID                        drain one worker (it is replaced)

The admin API's address is --admin-url, else SPLITSERVE_ADMIN_URL, else 127.0.0.1:50052; its token
--admin-token, else SPLITSERVE_ADMIN_TOKEN, else (for a loopback address) the file `splitserve serve`
wrote for that port (runtime/admin_auth.py). Control plane only: no torch, no engine, no numpy;
`splitserve pools ...` reaches this module without loading the rest of the CLI (splitserve/cli.py),
so that it answers in a fraction of a second. Errors are one line and exit code 1 (unreachable,
refused token, an address that is not an admin API, a size the pool's limits refuse); bad flags
(a negative size, a --watch interval below MIN_WATCH_S) are argparse's one line and exit code 2.
"""

from __future__ import annotations

import argparse
import json
import os
import sys
import time

import grpc

from proto.splitserve.v1 import admin_pb2, admin_pb2_grpc
from runtime.admin_auth import read_token_file

DEFAULT_ADMIN_URL = "127.0.0.1:50052"
TIMEOUT_S = 10.0
MIN_WATCH_S = 0.5             # `pools status --watch S`: no faster than this (each redraw is a status call)
MAX_POOL_SIZE = 256           # pools/book.py HARD_MAX_WORKERS (not imported: this CLI stays light)
STATE_NAMES = {v: k.removeprefix("WORKER_STATE_").lower() for k, v in admin_pb2.WorkerState.items()}


class AdminError(Exception):
    """A failed call, said in one line for the operator."""


def parse(argv: list[str]) -> argparse.Namespace:
    """`splitserve pools|workers ...` parsed by this module's own parser (the same flags and help
    as under `splitserve`'s full parser, which adds them through `add_arguments`)."""
    parser = argparse.ArgumentParser(prog="splitserve")
    add_arguments(parser.add_subparsers(dest="command", required=True, metavar="COMMAND"))
    return parser.parse_args(argv)


def _watch_s(text: str) -> float:
    try:
        s = float(text)
    except ValueError:
        raise argparse.ArgumentTypeError(f"seconds between redraws, not {text!r}") from None
    if not s >= MIN_WATCH_S:           # also refuses nan
        raise argparse.ArgumentTypeError(f"redraw at most every {MIN_WATCH_S:g} s (got {text})")
    return s


def _pool_size(text: str) -> int:
    try:
        n = int(text)
    except ValueError:
        raise argparse.ArgumentTypeError(f"a number of workers, not {text!r}") from None
    if not 0 <= n <= MAX_POOL_SIZE:
        raise argparse.ArgumentTypeError(f"a number of workers from 0 to {MAX_POOL_SIZE} (got {n})")
    return n


def add_arguments(sub: argparse._SubParsersAction) -> None:
    p = sub.add_parser("pools", help="the worker pools: status, scale, release, limits (admin API)")
    psub = p.add_subparsers(dest="pools_command", required=True, metavar="COMMAND")
    s = psub.add_parser("status", help="each pool's size, load and latency")
    s.add_argument("--json", action="store_true", help="the whole status (pools and workers) as JSON")
    s.add_argument("--watch", nargs="?", const=2.0, type=_watch_s, metavar="S",
                   help=f"redraw every S seconds (default 2, at least {MIN_WATCH_S:g}); Ctrl-C ends it")
    _admin_flags(s)
    s = psub.add_parser("scale", help="hold pools at these sizes (an override, until `pools release`)")
    s.add_argument("--prefill", type=_pool_size, metavar="N",
                   help="prefill workers to hold the prefill pool at (within its limits: `pools limits`)")
    s.add_argument("--decode", type=_pool_size, metavar="M",
                   help="decode workers to hold the decode pool at (within its limits: `pools limits`)")
    _admin_flags(s)
    s = psub.add_parser("release", help="drop the override (every pool, or those named)")
    s.add_argument("--prefill", action="store_true", help="release the prefill pool's override only")
    s.add_argument("--decode", action="store_true", help="release the decode pool's override only")
    _admin_flags(s)
    s = psub.add_parser("limits", help="show, or set, each pool's min and max")
    for pool in ("decode", "prefill"):
        s.add_argument(f"--{pool}-min", type=_pool_size, metavar="N",
                       help=f"the {pool} pool never shrinks below N (the planner's and `pools scale`'s floor)")
        s.add_argument(f"--{pool}-max", type=_pool_size, metavar="N",
                       help=f"the {pool} pool never grows above N (the planner's and `pools scale`'s ceiling)")
    _admin_flags(s)

    p = sub.add_parser("workers", help="the workers: list, drain (admin API)")
    wsub = p.add_subparsers(dest="workers_command", required=True, metavar="COMMAND")
    s = wsub.add_parser("list", help="every worker, its state and load")
    s.add_argument("--json", action="store_true", help="every worker as JSON")
    _admin_flags(s)
    s = wsub.add_parser("drain", help="drain one worker: it finishes its requests and exits (and is replaced)")
    s.add_argument("worker_id", metavar="ID", help="a worker id or name from `splitserve workers list`")
    _admin_flags(s)


def _admin_flags(p: argparse.ArgumentParser) -> None:
    g = p.add_argument_group("admin API")
    g.add_argument("--admin-url", default=None,
                   help=f"host:port of the admin API (default: $SPLITSERVE_ADMIN_URL, else {DEFAULT_ADMIN_URL})")
    g.add_argument("--admin-token", default=None,
                   help="its token (default: $SPLITSERVE_ADMIN_TOKEN, else the file `splitserve serve` wrote "
                        "for a local admin port)")


def main(args: argparse.Namespace) -> int:
    name = f"splitserve {args.command} {getattr(args, 'pools_command', None) or args.workers_command}"
    try:
        client = AdminClient.from_args(args)
        with client:
            if args.command == "pools":
                return _pools(client, args)
            return _workers(client, args)
    except AdminError as e:
        print(f"{name}: {e}", file=sys.stderr)
        return 1
    except KeyboardInterrupt:
        return 0


def _pools(client: AdminClient, args) -> int:
    cmd = args.pools_command
    if cmd == "status":
        while True:
            st = client.call("GetStatus", admin_pb2.GetStatusRequest())
            text = json.dumps(_to_dict(st), indent=1) if args.json else format_pools(st.pools, st.workers)
            if args.watch is None:
                print(text)
                return 0
            print("\033[H\033[2J" + time.strftime("%H:%M:%S ") + client.url + "\n" + text, flush=True)
            time.sleep(args.watch)
    if cmd == "scale":
        req = admin_pb2.ScalePoolRequest()
        if args.prefill is None and args.decode is None:
            raise AdminError("say which pool: --prefill N and/or --decode M")
        for pool in ("prefill", "decode"):
            n = getattr(args, pool)
            if n is not None:
                setattr(req, pool, n)
        print(format_pools(client.call("ScalePool", req).pools))
        return 0
    if cmd == "release":
        pools = [p for p in ("prefill", "decode") if getattr(args, p)]
        print(format_pools(client.call("ReleasePools", admin_pb2.ReleasePoolsRequest(pools=pools)).pools))
        return 0
    changed = False
    for pool in ("decode", "prefill"):
        lo, hi = getattr(args, f"{pool}_min"), getattr(args, f"{pool}_max")
        if lo is None and hi is None:
            continue
        req = admin_pb2.SetPoolLimitsRequest(pool=pool)
        if lo is not None:
            req.min = lo
        if hi is not None:
            req.max = hi
        client.call("SetPoolLimits", req)
        changed = True
    pools = client.call("GetStatus", admin_pb2.GetStatusRequest()).pools
    print(("limits set\n" if changed else "") + "\n".join(
        f"{p.pool:<8} min {p.min}  max {p.max}  desired {p.desired}" + (f"  ({p.note})" if p.note else "")
        for p in pools))
    return 0


def _workers(client: AdminClient, args) -> int:
    if args.workers_command == "list":
        st = client.call("GetStatus", admin_pb2.GetStatusRequest())
        if args.json:
            print(json.dumps(_to_dict(st).get("workers", []), indent=1))
        else:
            print(format_workers(st.workers))
        return 0
    resp = client.call("DrainWorker", admin_pb2.DrainWorkerRequest(worker_id=args.worker_id))
    print(resp.message)
    return 0


class AdminClient:
    def __init__(self, url: str, token: str | None) -> None:
        self.url, self._token = url, token
        self._channel = grpc.insecure_channel(url)
        self._stub = admin_pb2_grpc.AdminStub(self._channel)

    @staticmethod
    def from_args(args) -> AdminClient:
        url = args.admin_url or os.environ.get("SPLITSERVE_ADMIN_URL") or DEFAULT_ADMIN_URL
        url = url.removeprefix("grpc://").removeprefix("http://").rstrip("/")
        token = args.admin_token or os.environ.get("SPLITSERVE_ADMIN_TOKEN") or _local_token(url)
        return AdminClient(url, token)

    def call(self, method: str, request):
        md = [("authorization", f"Bearer {self._token}")] if self._token else []
        try:
            return getattr(self._stub, method)(request, metadata=md, timeout=TIMEOUT_S)
        except grpc.RpcError as e:
            code = e.code()
            if _not_admin(e):
                raise AdminError(f"{self.url} is not a Splitserve admin API ({_what_answered(e)}); the admin API "
                                 f"listens on serve's --admin-port (default {DEFAULT_ADMIN_URL}, printed in its "
                                 f"banner): set --admin-url or SPLITSERVE_ADMIN_URL") from None
            if code == grpc.StatusCode.UNAVAILABLE:
                raise AdminError(f"cannot reach the admin API at {self.url} (is `splitserve serve` running? "
                                 f"set --admin-url or SPLITSERVE_ADMIN_URL)") from None
            if code == grpc.StatusCode.UNAUTHENTICATED:
                raise AdminError(f"the admin API at {self.url} refused the token"
                                 + ("" if self._token else " (none given)")
                                 + ": pass --admin-token or set SPLITSERVE_ADMIN_TOKEN") from None
            if code == grpc.StatusCode.DEADLINE_EXCEEDED:
                raise AdminError(f"the admin API at {self.url} did not answer within {TIMEOUT_S:.0f} s") from None
            raise AdminError(e.details() or code.name) from None

    def __enter__(self) -> AdminClient:
        return self

    def __exit__(self, *exc) -> None:
        self._channel.close()


def _not_admin(e: grpc.RpcError) -> bool:
    """Something other than an admin API answered: a gRPC server without the service (the frontend's
    port), one that wants other credentials (a worker's), or a peer that does not speak gRPC (an
    HTTP port, Redis)."""
    code, details = e.code(), (e.details() or "").lower()
    if code == grpc.StatusCode.UNIMPLEMENTED:
        return True
    if code == grpc.StatusCode.UNAUTHENTICATED:
        return "admin" not in details           # the admin API's refusal names itself
    return code in (grpc.StatusCode.UNKNOWN, grpc.StatusCode.INTERNAL, grpc.StatusCode.UNAVAILABLE) and any(
        w in details for w in ("http1", "http/1", "http/2", "protocol", "frame", "malformed", "content-type"))


def _what_answered(e: grpc.RpcError) -> str:
    if e.code() in (grpc.StatusCode.UNIMPLEMENTED, grpc.StatusCode.UNAUTHENTICATED):
        return "a gRPC server without the splitserve.v1.Admin service answered: a frontend's or a worker's port?"
    return "something that does not speak gRPC answered: an HTTP port?"


def _local_token(url: str) -> str | None:
    host, _, port = url.rpartition(":")
    if host.strip("[]") in ("127.0.0.1", "localhost", "::1") and port.isdigit():
        return read_token_file(int(port))
    return None


def _to_dict(msg) -> dict:
    from google.protobuf.json_format import MessageToDict     # only for --json
    return MessageToDict(msg, preserving_proto_field_name=True, always_print_fields_with_no_presence=True)


# ---- tables ---------------------------------------------------------------------------------------

def _table(header: list[str], rows: list[list[str]]) -> str:
    widths = [max(len(str(r[i])) for r in [header, *rows]) for i in range(len(header))]
    return "\n".join("  ".join(str(c).ljust(w) for c, w in zip(r, widths)).rstrip() for r in [header, *rows])


def _pair_ms(a: float | None, b: float | None) -> str:
    if a is None:
        return "-"
    return f"{a:.0f}/{b:.0f} ms" if max(a, b or 0) >= 10 else f"{a:.1f}/{b:.1f} ms"


def _opt(msg, field: str) -> float | None:
    return getattr(msg, field) if msg.HasField(field) else None


def format_pools(pools, workers=None) -> str:
    """The `pools status` table (with `workers`: each worker's GPUs), then one line per degraded pool."""
    rows = []
    has_decision = any(p.last_decision for p in pools)
    for p in pools:
        lat = p.latency
        desired = f"{p.desired}" + (" (override)" if p.HasField("override") else "")
        row = [p.pool, p.role, desired, str(p.ready), str(p.starting), str(p.draining), str(p.num_running),
               str(p.num_waiting), f"{p.kv_usage:.0%}",
               _pair_ms(_opt(lat, "ttft_p50_ms"), _opt(lat, "ttft_p90_ms")),
               _pair_ms(_opt(lat, "itl_p50_ms"), _opt(lat, "itl_p90_ms"))]
        if workers is not None:
            row.append(pool_gpus(workers, p.pool))
        if has_decision:
            row.append(p.last_decision or "-")
        rows.append(row)
    header = ["POOL", "ROLE", "DESIRED", "READY", "STARTING", "DRAINING", "RUNNING", "QUEUED", "KV USE",
              "TTFT p50/p90", "ITL p50/p90"] + (["GPUS"] if workers is not None else []) + \
        (["LAST DECISION"] if has_decision else [])
    out = _table(header, rows)
    notes = [f"{p.pool}: degraded, {p.ready} of {p.desired} ready" + (f", {p.failed} failed (crash loop)"
                                                                       if p.failed else "")
             for p in pools if p.degraded]
    window = max((p.latency.window_s for p in pools), default=60.0)
    return out + f"\n(latency over the last {window:.0f} s)" + "".join("\n" + n for n in notes)


def _uptime(s: float) -> str:
    s = int(s)
    return f"{s // 3600}h{s % 3600 // 60:02d}m" if s >= 3600 else f"{s // 60}m{s % 60:02d}s"


def format_workers(workers) -> str:
    rows = [[w.worker_id or "-", w.name or "-", w.pool, STATE_NAMES.get(w.state, "?"), w.gpus or "-",
             str(w.num_running), str(w.num_waiting),
             f"{w.num_used_blocks / w.num_total_blocks:.0%}" if w.num_total_blocks else "-",
             _uptime(w.uptime_s) if w.uptime_s else "-", str(w.restarts), w.address or "-",
             ("" if w.managed else "external ") + w.detail]
            for w in workers]
    return _table(["WORKER", "NAME", "POOL", "STATE", "GPUS", "RUNNING", "QUEUED", "KV USE", "UPTIME", "RESTARTS",
                   "ADDRESS", "NOTE"], rows)


def pool_gpus(workers, pool: str) -> str:
    """The GPUs of each of a pool's workers, e.g. "0,1 2,3" ("-": none placed)."""
    return " ".join(w.gpus for w in workers if w.pool == pool and w.gpus) or "-"
