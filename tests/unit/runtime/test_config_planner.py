"""The planner's settings are declared once (runtime/config_planner.py), and every place that reads
them sees the same default: the flags of `serve --planner`, `splitserve planner` and `splitserve
bench plan`, the JSON config, the Helm chart's values and the core's PlannerConfig. The pools'
limits likewise, and the router's lower-tier weight. Choices are enums, read and written as the
same strings as before."""

from __future__ import annotations

import argparse
import json
from pathlib import Path

import pytest
import yaml

from perf.profile import DEFAULT_STARTUP_S
from planner import PlannerConfig
from router import RouterConfig
from runtime.cli_args import config_from_args
from runtime.config import (ControllerConfig, Device, FrontendConfig, PlannerComponentConfig, RoutingPolicy,
                            ServeConfig)
from runtime.config_fields import ConfigError, settings
from runtime.config_file import config_from_dict, config_to_dict
from runtime.config_planner import (DEFAULT_POOL_LIMITS, HARD_MAX_WORKERS, PoolLimitsConfig, PredictorKind,
                                    PrefillOrder, SlaConfig)
from splitserve.bench import plan as bench_plan
from splitserve.cli import build_parser

VALUES = yaml.safe_load((Path(__file__).resolve().parents[3] / "helm/splitserve/values.yaml").read_text())
SLA = list(settings(SlaConfig))
BENCH = ["bench", "plan", "--trace", "x", "--ttft-ms", "1000", "--itl-ms", "50"]


def help_of(argv: list[str], flag: str) -> str:
    parser = build_parser()
    for a in argv:                    # walk down to the subcommand's parser
        if a.startswith("-"):
            break
        parser = next(x for x in parser._actions if isinstance(x, argparse._SubParsersAction)).choices[a]
    return next(" ".join(a.help.split()) for a in parser._actions if flag in a.option_strings)


def shown(value) -> str:
    return "none" if value is None else str(value)


@pytest.mark.parametrize("s", SLA, ids=lambda s: s.name)
def test_one_declaration_gives_every_place_the_same_default(s):
    declared = s.default
    serve = config_from_args(ServeConfig, build_parser().parse_args(["serve"]), given={"frontend.model": "/m"})
    planner = config_from_args(PlannerComponentConfig, build_parser().parse_args(["planner"]))
    bench = bench_plan.plan_settings(build_parser().parse_args(BENCH))
    assert getattr(serve.planner, s.name) == getattr(planner, s.name) == declared
    if s.name not in ("ttft_ms", "itl_ms"):               # bench plan requires its targets
        assert getattr(bench.sla, s.name) == declared
    for argv in (["serve"], ["planner"], BENCH):          # each --help says that default
        assert f"(default: {shown(declared)})" in help_of(argv, s.flag) or s.name in ("ttft_ms", "itl_ms")
    assert config_to_dict(PlannerComponentConfig())[s.name] == declared       # the JSON config
    assert getattr(config_from_dict(PlannerComponentConfig, {}), s.name) == declared
    assert VALUES["planner"]["config"][s.name] == declared                     # the Helm value


def test_the_core_config_defaults_are_the_declared_ones():
    """PlannerConfig, the core's view in seconds, has no defaults of its own: built from the declared
    settings (start-up from the shipped profile) it equals the one built from its defaults."""
    assert PlannerConfig.from_settings(SlaConfig(), DEFAULT_STARTUP_S) == PlannerConfig(
        ttft_target_s=SlaConfig().ttft_ms / 1e3, itl_target_s=SlaConfig().itl_ms / 1e3)
    assert PlannerConfig(1.0, 0.05).prefill_deadline is SlaConfig().deadline_ordered is True
    custom = SlaConfig(ttft_ms=2500, itl_ms=40, interval_s=30, startup_s=8, predictor="ewma(0.3)", hysteresis=0.2,
                       prefill_order="fifo", num_samples=100, min_records=5, gpu_budget=9)
    core = PlannerConfig.from_settings(custom, DEFAULT_STARTUP_S, PoolLimitsConfig(1, 4, 2, 5))
    assert (core.ttft_target_s, core.itl_target_s, core.interval_s, core.startup_s) == (2.5, 0.04, 30, 8)
    assert (core.predictor, core.hysteresis, core.prefill_deadline, core.num_samples, core.min_records,
            core.gpu_budget) == ("ewma(0.3)", 0.2, False, 100, 5, 9)
    assert (core.prefill.min_workers, core.prefill.max_workers, core.decode.min_workers,
            core.decode.max_workers) == (1, 4, 2, 5)


def test_pool_limits_have_one_default_everywhere_bench_plan_names_its_own():
    limits = {s.name: s.default for s in settings(PoolLimitsConfig)}
    assert {k: getattr(ControllerConfig(), k) for k in limits} == limits                 # controller, serve
    serve = config_from_args(ServeConfig, build_parser().parse_args(["serve"]), given={"frontend.model": "/m"})
    assert {k: getattr(serve.controller, k) for k in limits} == limits
    assert VALUES["planner"]["config"]["controller"] == limits                          # the chart
    core = PlannerConfig(1.0, 0.05)                                                     # the planner core
    assert (core.prefill, core.decode) == (DEFAULT_POOL_LIMITS.prefill, DEFAULT_POOL_LIMITS.decode)
    assert "(default: 8)" in help_of(["serve"], "--max-decode-workers")
    # bench plan simulates unbounded disaggregated pools, a named override of the same declaration
    bench = bench_plan.plan_settings(build_parser().parse_args(BENCH))
    assert bench.pools == bench_plan.SIMULATED_POOLS
    assert bench.pools.prefill.max_workers == bench.pools.decode.max_workers == HARD_MAX_WORKERS
    assert f"(default: {HARD_MAX_WORKERS})" in help_of(BENCH, "--max-decode-workers")


@pytest.mark.parametrize("kwargs", [dict(min_decode_workers=3, max_decode_workers=2),
                                    dict(max_prefill_workers=HARD_MAX_WORKERS + 1)])
def test_bad_pool_limits_are_a_clear_error(kwargs):
    with pytest.raises(ConfigError, match=f"0 <= min <= max <= {HARD_MAX_WORKERS}"):
        PoolLimitsConfig(**kwargs)
    flags = [f"--{k.replace('_', '-')}={v}" for k, v in kwargs.items()]
    with pytest.raises(ConfigError, match="pool limits must satisfy"):
        config_from_args(ServeConfig, build_parser().parse_args(["serve", *flags]), given={"frontend.model": "/m"})


def test_choices_are_enums_read_and_written_as_their_strings(tmp_path):
    argv = ["planner", "--prefill-order", "fifo"]
    planner = config_from_args(PlannerComponentConfig, build_parser().parse_args(argv))
    assert planner.prefill_order is PrefillOrder.FIFO and not planner.deadline_ordered
    assert "prefill queues in fifo order" in planner.targets()
    data = config_to_dict(planner)
    assert data["prefill_order"] == "fifo" and type(data["prefill_order"]) is str
    assert config_from_dict(PlannerComponentConfig, json.loads(json.dumps(data))) == planner
    with pytest.raises(ConfigError, match="prefill_order: 'lifo' is not one of deadline, fifo"):
        config_from_dict(PlannerComponentConfig, {"prefill_order": "lifo"})
    with pytest.raises(ConfigError, match="prefill_order: expected str, got int"):
        config_from_dict(PlannerComponentConfig, {"prefill_order": 1})
    serve = config_from_args(ServeConfig, build_parser().parse_args(
        ["serve", "--device", "cpu", "--router-policy", "round_robin"]), given={"frontend.model": "/m"})
    assert serve.engine.device is Device.CPU and serve.frontend.router_policy is RoutingPolicy.ROUND_ROBIN
    assert config_to_dict(serve)["engine"]["device"] == "cpu" and serve.engine.device == "cpu"
    with pytest.raises(SystemExit):
        build_parser().parse_args(["serve", "--device", "tpu"])
    assert set(PredictorKind) == {"constant", "ewma", "holt"} and SlaConfig().predictor == PredictorKind.HOLT


def test_the_router_lower_tier_weight_has_one_default():
    """The frontend serves with it, the router's own config defaults to it, and the simulators'
    and benches' routers (bench replay, routesim: `--lower-tier-weight`) take it unless told."""
    from frontend.routing import FrontendRouter
    declared = FrontendConfig(model="/m").router_lower_tier_weight
    assert RouterConfig().lower_tier_weight == declared == 0.5
    assert FrontendRouter("kv")._config.lower_tier_weight == declared
    for sim in ("replay", "routesim"):
        assert build_parser().parse_args(["bench", sim]).lower_tier_weight == declared
    assert build_parser().parse_args(["bench", "routesim", "--lower-tier-weight", "0"]).lower_tier_weight == 0
