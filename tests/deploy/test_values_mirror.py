"""Helm values mirror the config dataclasses (runtime/config.py), and what the chart renders is what
the components read: each `config` block and `engine` in values.yaml and values.schema.json has the
fields of its class with the same defaults, types and choices; the JSON the chart puts in its
ConfigMap builds the component's config (runtime/config_file.py); the command line it gives each
container parses with `splitserve`'s own parser."""

from __future__ import annotations

import json
from dataclasses import fields

import pytest
import yaml

from runtime import config as config_module
from runtime.config import EngineConfig, FrontendConfig, RedisConfig, WorkerConfig
from runtime.config_fields import settings
from runtime.config_file import config_from_dict
from runtime.config_planner import HARD_MAX_WORKERS, PoolLimitsConfig, PredictorKind, PrefillOrder, SlaConfig
from splitserve.cli import build_parser
from tests.deploy.chart import CHART, VALUE_SETS, component_configs, manifests, pod_specs, render_values

SCHEMA = json.loads((CHART / "values.schema.json").read_text())
VALUES = yaml.safe_load((CHART / "values.yaml").read_text())
TYPES = {int: "integer", float: "number", str: "string", bool: "boolean"}


def json_type(t: type) -> str:
    return TYPES.get(t) or "string"          # a StrEnum is spelled as its values

# Fields the chart sets itself, so that pods, Services and probes agree (or that come by environment).
CHART_OWNED = {
    EngineConfig: {"model", "tensor_parallel_size"},         # the pool's `gpus`
    FrontendConfig: {"model", "redis.url", "host", "http_port", "grpc_port", "api_key",
                     "itl_budget_share"},                   # 1 / frontend.replicas
    WorkerConfig: {"engine.model", "engine.tensor_parallel_size", "redis.url", "role", "host", "advertise_host", "port", "metrics_port", "worker_id"},
    RedisConfig: {"url"},
}
# Fields the chart renders that runtime/config.py does not declare yet, by the work that adds them
# (none now: the lifecycle and planner work landed them).
PENDING: dict[type, set[str]] = {}


def leaves(cls) -> dict[str, object]:
    return {s.path: s for s in settings(cls)}


def schema_leaves(node: dict, prefix: str = "") -> dict[str, dict]:
    node = resolve(node)
    out = {}
    for key, sub in node.get("properties", {}).items():
        sub = resolve(sub)
        if sub.get("type") == "object" and "properties" in sub:
            out.update(schema_leaves(sub, f"{prefix}{key}."))
        else:
            out[prefix + key] = sub
    return out


def resolve(node: dict) -> dict:
    ref = node.get("$ref")
    return SCHEMA["definitions"][ref.rsplit("/", 1)[1]] if ref else node


def value_leaves(node: dict, prefix: str = "") -> dict[str, object]:
    out = {}
    for key, v in node.items():
        if isinstance(v, dict) and v:
            out.update(value_leaves(v, f"{prefix}{key}."))
        else:
            out[prefix + key] = v
    return out


def check_mirror(cls, schema_node: dict, values_node: dict, owned: set[str], prefix: str = "") -> None:
    declared = {p: s for p, s in leaves(cls).items() if p not in owned and p.startswith(prefix)}
    declared = {p.removeprefix(prefix): s for p, s in declared.items()}
    in_schema = schema_leaves(schema_node)
    pending = PENDING.get(cls, set())
    assert set(declared) <= set(in_schema), f"{cls.__name__} fields missing from values.schema.json"
    assert set(in_schema) <= set(declared) | pending, f"values.schema.json fields {cls.__name__} lacks"
    assert set(value_leaves(values_node)) == set(in_schema), "values.yaml and values.schema.json differ"
    for path, s in declared.items():
        node = in_schema[path]
        want = [json_type(s.type), "null"] if s.optional else json_type(s.type)
        assert node["type"] == want, path
        assert node.get("enum") == (None if not s.choices else [*s.choices, *([None] if s.optional else [])]), path
        assert value_leaves(values_node)[path] == s.default, f"values.yaml {path}: default differs from {cls.__name__}'s"


def test_engine_values_mirror_engine_config():
    check_mirror(EngineConfig, SCHEMA["definitions"]["engine"], VALUES["engine"], CHART_OWNED[EngineConfig])
    assert schema_leaves(SCHEMA["definitions"]["engineOverrides"]) == schema_leaves(SCHEMA["definitions"]["engine"])


def test_frontend_values_mirror_frontend_config():
    owned = CHART_OWNED[FrontendConfig] | {"redis.namespace", "redis.lease_ttl_s"}     # from redis.config
    check_mirror(FrontendConfig, SCHEMA["properties"]["frontend"]["properties"]["config"], VALUES["frontend"]["config"], owned)


def test_redis_values_mirror_redis_config():
    check_mirror(RedisConfig, SCHEMA["properties"]["redis"]["properties"]["config"], VALUES["redis"]["config"],
                 CHART_OWNED[RedisConfig])


@pytest.mark.parametrize("pool", ["prefill", "decode"])
def test_worker_values_mirror_worker_config(pool):
    node = SCHEMA["properties"][pool]["properties"]["config"]
    own = {p: s for p, s in leaves(WorkerConfig).items()
           if not p.startswith(("engine.", "redis.")) and p not in CHART_OWNED[WorkerConfig]}
    in_schema = {k for k in schema_leaves(node) if not k.startswith("engine.")}
    assert in_schema <= set(own) | PENDING.get(WorkerConfig, set())
    # the prefill pool needs no prefill lease, the decode pool no prefill deadline
    assert set(own) - {"prefill_lease_s" if pool == "prefill" else "prefill_deadline_ms"} <= in_schema
    assert resolve(node["properties"]["engine"]) is SCHEMA["definitions"]["engineOverrides"]
    values = {k: v for k, v in VALUES[pool]["config"].items() if k != "engine"}
    assert set(values) == in_schema


def test_planner_values_mirror_the_declared_planner_settings():
    """planner.config holds every SlaConfig field with its declared default, type and choices, and
    planner.config.controller every PoolLimitsConfig field, bounded by HARD_MAX_WORKERS."""
    node = SCHEMA["properties"]["planner"]["properties"]["config"]
    sla_node = {**node, "properties": {k: v for k, v in node["properties"].items() if k != "controller"}}
    sla_values = {k: v for k, v in VALUES["planner"]["config"].items() if k != "controller"}
    check_mirror(SlaConfig, sla_node, sla_values, set())
    check_mirror(PoolLimitsConfig, node["properties"]["controller"], VALUES["planner"]["config"]["controller"], set())
    assert {n["maximum"] for n in node["properties"]["controller"]["properties"].values()} == {HARD_MAX_WORKERS}
    pattern = node["properties"]["predictor"]["pattern"]
    assert pattern.startswith(f"^({'|'.join(PredictorKind)})")


def test_the_planner_settings_reach_the_planner_and_fifo_leaves_prefill_queues_in_arrival_order():
    """Every planner value the chart is given lands in the planner's config; with prefill_order fifo
    the prefill workers start without a deadline (the order the planner then sizes them for)."""
    given = {"prefill_order": "fifo", "predictor": "ewma(0.3)", "hysteresis": 0.2, "decode_down_delay_s": 40.0,
             "gpu_budget": 12, "num_samples": 1000, "controller": {"max_decode_workers": 12}}
    configs = component_configs(render_values({"planner": {"config": given}}))
    planner = config_from_dict(config_module.PlannerComponentConfig, configs["planner"], "planner.json")
    assert (planner.prefill_order, planner.predictor, planner.hysteresis, planner.decode_down_delay_s,
            planner.gpu_budget, planner.num_samples) == (PrefillOrder.FIFO, "ewma(0.3)", 0.2, 40.0, 12, 1000)
    assert "prefill_deadline_ms" not in configs["prefill"]
    assert configs["controller"]["controller"]["max_decode_workers"] == 12


def drop_pending(cls, data: dict) -> dict:
    names = {f.name for f in fields(cls)}
    return {k: v for k, v in data.items() if k in names or k not in PENDING.get(cls, set())}


@pytest.mark.parametrize("value_set", VALUE_SETS)
def test_rendered_configs_build_the_component_configs(value_set):
    configs = component_configs(manifests(value_set))
    fe = config_from_dict(FrontendConfig, drop_pending(FrontendConfig, configs["frontend"]), "frontend.json")
    assert fe.host == "0.0.0.0" and fe.model.startswith("/models/")
    for pool in ("prefill", "decode"):
        if pool in configs:
            w = config_from_dict(WorkerConfig, drop_pending(WorkerConfig, configs[pool]), f"{pool}.json")
            assert w.host == "0.0.0.0" and w.engine.model == fe.model and w.redis == fe.redis
            assert w.metrics_port and w.port
    if "prefill" in configs:       # the planner's TTFT target orders the prefill queues; none without it
        deadline = "planner" in configs and configs["planner"]["prefill_order"] == PrefillOrder.DEADLINE
        want = configs["planner"]["ttft_ms"] if deadline else None
        assert configs["prefill"].get("prefill_deadline_ms") == want
    if "planner" in configs:
        config_from_dict(config_module.PlannerComponentConfig, configs["planner"], "planner.json")
    # the planner's ITL target keeps long prefills off the decode workers; none without it
    assert fe.itl_target_ms == (configs["planner"]["itl_ms"] if "planner" in configs else None)


@pytest.mark.parametrize("value_set", VALUE_SETS)
def test_container_commands_parse(value_set):
    parser = build_parser()
    for name, pod in pod_specs(manifests(value_set)).items():
        if name.endswith(("-frontend", "-prefill", "-decode")):
            args = [a.replace("$(POD_IP)", "10.0.0.7").replace("$(POD_NAME)", "pod-0") for a in pod["containers"][0]["args"]]
            ns = parser.parse_args(args)
            assert ns.config.startswith("/etc/splitserve/") and ns.command == args[0]


def test_the_planner_pod_runs_splitserve_planner_with_its_targets():
    """The planner container's command parses as `splitserve planner`, and the planner settings the
    chart exposes besides the controller's limits (the SLA targets) are PlannerComponentConfig's."""
    assert hasattr(config_module, "ControllerConfig")
    objs = manifests("default-values.yaml")
    args = pod_specs(objs)["splitserve-planner"]["containers"][0]["args"]
    assert build_parser().parse_args(args).command == "planner"
    sla = {k for k in VALUES["planner"]["config"] if k != "controller"}
    assert sla and sla <= {f.name for f in fields(config_module.PlannerComponentConfig)}


def test_a_pools_gpus_are_its_workers_tensor_parallel_size():
    """`gpus: 2` gives each pod of the pool two GPUs and splits its workers' model over them; a CPU
    pool (gpus 0) runs unsplit."""
    objs = render_values({"decode": {"gpus": 2}, "prefill": {"gpus": 0}})
    configs = component_configs(objs)
    assert configs["decode"]["engine"]["tensor_parallel_size"] == 2
    assert configs["prefill"]["engine"]["tensor_parallel_size"] == 1
    decode = pod_specs(objs)["splitserve-decode"]["containers"][0]["resources"]
    assert decode["limits"]["nvidia.com/gpu"] == 2 and decode["requests"]["nvidia.com/gpu"] == 2
    w = config_from_dict(WorkerConfig, configs["decode"], "decode.json")
    assert w.engine.tensor_parallel_size == 2
