"""The `splitserve` command: serve a cluster, run one component, operate its pools, make the tiny
model, benchmark.

The flags of `serve` and of every component are generated from the config dataclasses in
runtime/config.py (runtime/cli_args.py); a component also takes `--config FILE`, the JSON of its
config, which is how `serve` hands each child its config. Secrets (the API key) are read from the
environment (SPLITSERVE_API_KEY, SPLITSERVE_ADMIN_TOKEN) as well as flags, so launchers can pass
them without putting them on a command line that `ps` shows. `pools` and `workers` talk to a running
cluster's admin API (splitserve/admin_cli.py).

Each command imports only what it runs: engine code only for the commands that run one, and
`pools`/`workers` go straight to the admin CLI (its own parser, gRPC and the admin stubs; no config
classes, no asyncio, no numpy), so that an operator's `pools status` answers in a fraction of a second.
"""

from __future__ import annotations

import argparse
import sys
from typing import TYPE_CHECKING

if TYPE_CHECKING:
    from runtime.config import FrontendConfig

DESCRIPTION = ("The splitserve command: serve a cluster on this machine (or on Ray), run one of its "
               "components, operate its pools, make the tiny model, profile and benchmark.")

# serve's frontend follows the engine: its model is the workers', its block size is learned
SERVE_SKIPS = ("frontend.model", "frontend.block_size", "frontend.max_model_len")
WORKERS = {"decode-worker": "one decode worker (takes pushed KV, or prefills locally)",
           "prefill-worker": "one prefill worker (computes prompts, pushes KV over NIXL)"}


def show_defaults(parser: argparse.ArgumentParser) -> argparse.ArgumentParser:
    """End every option's help with its default, unless the help already says it (the generated
    config flags do: runtime/cli_args.py) or the option is required."""
    for action in parser._actions:
        text = action.help or ""
        if (not action.option_strings or action.required or "default" in text
                or action.default is argparse.SUPPRESS or isinstance(action, argparse._HelpAction)):
            continue
        value = action.default
        shown = "none" if value is None else ("on" if value else "off") if isinstance(value, bool) else value
        action.help = f"{text} (default: {shown})".lstrip()
    return parser


def build_parser() -> argparse.ArgumentParser:
    from runtime.cli_args import add_config_args
    from runtime.config import ControllerComponentConfig, FrontendConfig, PlannerComponentConfig, ServeConfig, WorkerConfig
    parser = argparse.ArgumentParser(prog="splitserve", description=DESCRIPTION)
    sub = parser.add_subparsers(dest="command", required=True, metavar="COMMAND")

    p = sub.add_parser("serve", help="a whole cluster on this machine")
    add_config_args(p, ServeConfig, skip=SERVE_SKIPS, config_file=False)
    p = sub.add_parser("frontend", help="the client edge (HTTP + gRPC)")
    add_config_args(p, FrontendConfig)
    for name, text in WORKERS.items():
        p = sub.add_parser(name, help=text)
        add_config_args(p, WorkerConfig, skip=("role",) if name == "prefill-worker" else ())

    p = sub.add_parser("planner", help="the SLA planner, driving a pool controller's admin API")
    add_config_args(p, PlannerComponentConfig)
    p = sub.add_parser("controller", help="the pool controller and admin API alone, scaling Kubernetes "
                                          "worker Deployments")
    add_config_args(p, ControllerComponentConfig)

    from splitserve import admin_cli
    admin_cli.add_arguments(sub)

    p = sub.add_parser("model", help="model utilities")
    msub = p.add_subparsers(dest="model_command", required=True)
    from splitserve import tiny_model
    tiny_model.add_arguments(msub.add_parser("tiny", help="write the tiny seeded-random model"))

    from splitserve import profiler
    profiler.add_arguments(sub.add_parser("profile", help="measure the engine: a performance profile for the "
                                          "planner and the mock (format 2)"))

    p = sub.add_parser("bench", help="benchmarks")
    bsub = p.add_subparsers(dest="bench_command", required=True)
    from splitserve.bench import serve as bench_serve
    bench_serve.add_arguments(bsub.add_parser("serve", help="load-generate against a running server"))
    from splitserve.bench import goodput as bench_goodput
    bench_goodput.add_arguments(bsub.add_parser(
        "goodput", help="the highest request rate at which a server meets TTFT and ITL targets"))
    from splitserve.bench import replay as bench_replay
    bench_replay.add_arguments(bsub.add_parser("replay", help="replay a trace on a local mock cluster"))
    from splitserve.bench import routesim as bench_routesim
    bench_routesim.add_arguments(bsub.add_parser(
        "routesim", help="the real router driving simulated workers on a virtual clock"))
    from splitserve.bench import plan as bench_plan
    bench_plan.add_arguments(bsub.add_parser("plan", help="simulate the SLA planner on a trace (virtual clock)"))
    for p in (msub.choices["tiny"], bsub.choices["serve"], bsub.choices["goodput"], bsub.choices["replay"]):
        show_defaults(p)
    return parser


def main(argv: list[str] | None = None) -> int:
    argv = sys.argv[1:] if argv is None else list(argv)
    if argv[:1] in (["pools"], ["workers"]):          # the operator's commands: nothing else to load
        from splitserve import admin_cli
        return admin_cli.main(admin_cli.parse(argv))
    from runtime.config_fields import ConfigError
    from kvstore.movers.disk_index import DiskTierError
    from runtime.errors import InvalidRequest, StartupError
    from runtime.host_checks import device_problem
    from runtime.logging import setup_logging
    from runtime.process import enable_stack_dumps, run_component
    args = build_parser().parse_args(argv)
    enable_stack_dumps()
    cmd = args.command
    if cmd in ("pools", "workers"):
        from splitserve import admin_cli
        return admin_cli.main(args)
    if cmd == "profile":
        from splitserve import profiler
        setup_logging("profile")
        return profiler.main(args)
    if cmd == "model":
        from splitserve import tiny_model
        return tiny_model.main(args)
    if cmd == "bench" and args.bench_command == "routesim":
        from splitserve.bench import routesim as bench_routesim
        return bench_routesim.main(args)
    if cmd == "bench" and args.bench_command == "plan":
        from splitserve.bench import plan as bench_plan
        return bench_plan.main(args)
    if cmd == "bench" and args.bench_command == "goodput":
        from splitserve.bench import goodput as bench_goodput
        return bench_goodput.main(args)
    if cmd == "bench" and args.bench_command == "replay":
        from splitserve.bench import replay as bench_replay
        return bench_replay.main(args)
    if cmd == "bench":
        from splitserve.bench import serve as bench_serve
        return bench_serve.main(args)
    try:
        cfg = component_config(args)
    except (ConfigError, InvalidRequest) as e:
        print(f"splitserve {cmd}: {e}", file=sys.stderr)
        return 2
    if cmd == "serve" and cfg.ray.address:
        if cfg.ray.address == "local":
            # a Ray of this machine alone binds loopback, not the machine's address (Ray reads this
            # when it is imported; Redis, the workers and the frontend follow the node's address)
            import os
            os.environ.setdefault("RAY_ENABLE_WINDOWS_OR_OSX_CLUSTER", "0")
        from splitserve.ray_serve import serve_ray
        setup_logging("serve")
        return serve_ray(cfg)
    if cmd == "serve":
        from splitserve.serve import serve
        setup_logging("serve")
        return serve(cfg)
    if cmd == "planner":
        setup_logging("planner")
        from planner.live import run_planner
        return run_component(run_planner(cfg))
    if cmd == "controller":
        setup_logging("controller")
        from pools.k8s_controller import run_controller
        return run_component(run_controller(cfg))
    if cmd == "frontend":
        setup_logging("frontend")
        from frontend.main import event_loop_factory, serve_frontend
        try:
            run_component(serve_frontend(cfg), event_loop_factory(cfg.event_loop))
        except StartupError as e:    # e.g. a port in use: one line, not a traceback
            print(f"splitserve frontend: {e}", file=sys.stderr)
            return 2
        return 0
    problem = device_problem(cfg.engine.device)
    if problem:                      # before the engine loads: no traceback 15 s later
        print(f"splitserve {cmd}: {problem}", file=sys.stderr)
        return 2
    setup_logging(cfg.worker_id or cmd)
    try:
        if cmd == "prefill-worker":
            from prefill_worker.main import serve_prefill_worker
            run_component(serve_prefill_worker(cfg))
        else:
            from decode_worker.main import serve_worker
            run_component(serve_worker(cfg))
    except (StartupError, DiskTierError) as e:   # e.g. an unusable --kv-disk-dir: one line, not a traceback
        print(f"splitserve {cmd}: {e}", file=sys.stderr)
        return 2
    return 0


def component_config(args: argparse.Namespace):
    """The config of the command in `args` (a ServeConfig, FrontendConfig, WorkerConfig,
    PlannerComponentConfig or ControllerComponentConfig), its model resolved (tiny → the generated
    directory). ConfigError or InvalidRequest for bad input."""
    import dataclasses

    from runtime.cli_args import config_from_args
    from runtime.config import (ControllerComponentConfig, EngineConfig, FrontendConfig, PlannerComponentConfig,
                                ServeConfig, WorkerConfig)
    from runtime.config_fields import ConfigError
    from splitserve.models import resolve_model
    cmd = args.command
    if cmd == "serve":        # serve resolves the model itself, to report a bad one its own way
        engine = config_from_args(EngineConfig, args, prefix="engine.")
        cfg = config_from_args(ServeConfig, args, given={"frontend.model": engine.model})
        from splitserve.serve_plan import itl_guard_settings
        check_itl_guard(dataclasses.replace(cfg.frontend, **itl_guard_settings(cfg)))
        return cfg
    if cmd == "planner":
        cfg = config_from_args(PlannerComponentConfig, args)
        from planner.live import check_sla
        try:
            check_sla(cfg)
        except (ValueError, OSError) as e:
            raise ConfigError(str(e)) from None
    elif cmd == "controller":
        cfg = config_from_args(ControllerComponentConfig, args)
    elif cmd == "frontend":
        cfg = config_from_args(FrontendConfig, args)
        check_itl_guard(cfg)
        cfg = dataclasses.replace(cfg, model=resolve_model(cfg.model))
    else:
        cfg = config_from_args(WorkerConfig, args, given={"role": "prefill"} if cmd == "prefill-worker" else None)
        if cmd == "decode-worker" and cfg.role == "prefill":
            raise ConfigError("role prefill is `splitserve prefill-worker`")
        cfg = dataclasses.replace(cfg, engine=dataclasses.replace(cfg.engine, model=resolve_model(cfg.engine.model)))
    if not cfg.redis.url:
        raise ConfigError("--redis-url (or SPLITSERVE_REDIS_URL, or redis.url in --config) is required")
    return cfg


def check_itl_guard(cfg: FrontendConfig) -> None:
    """A bad --itl-target-ms or --decode-profile is a start-up error, not a frontend that dies later."""
    from perf.itl_guard import make_itl_guard
    from runtime.config_fields import ConfigError
    if not 0 < cfg.itl_budget_share <= 1:
        raise ConfigError(f"--itl-budget-share must be in (0, 1], got {cfg.itl_budget_share}")
    try:
        make_itl_guard(cfg.itl_target_ms, cfg.decode_profile, cfg.itl_guard_mode, cfg.itl_budget_share,
                       cfg.ttft_target_ms)
    except ValueError as e:
        raise ConfigError(f"--itl-target-ms / --ttft-target-ms / --decode-profile: {e}") from None
