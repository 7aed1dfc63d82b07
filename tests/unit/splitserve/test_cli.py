"""The `splitserve` command line: flags generated from the config classes reach the processes that
use them, the flag names users know keep working, and bad input is a clear error, not a traceback."""

from __future__ import annotations

import json
import os
import stat
import time
from dataclasses import MISSING, fields

import pytest

from runtime.cli_args import config_from_args
from runtime.config import EngineConfig, FrontendConfig, ServeConfig, WorkerConfig
from runtime.config_fields import TRI_STATE, settings
from perf.profile import CURVE_PROFILE_PATH
from splitserve import serve
from splitserve.cli import build_parser, component_config, main


@pytest.fixture
def model_dir(tmp_path):
    d = tmp_path / "model"
    d.mkdir()
    (d / "config.json").write_text("{}")
    return str(d.resolve())


def parse(*argv: str):
    return component_config(build_parser().parse_args(list(argv)))


def not_default(s) -> tuple[list[str], object]:
    """Flag arguments that set setting `s` to something other than its default, and that value."""
    if s.tri_state:
        return [s.flag, "on"], True
    if s.type is bool:
        return [s.flag], not s.default
    if s.choices:                       # declared choices, or a StrEnum's members
        value = next(c for c in reversed(s.choices) if c != s.default)
    elif s.type is str:
        value = f"{s.default}-x"
    else:
        value = (s.default or 0) + (3 if s.type is int else 0.25)
    return [s.flag, str(value)], value


def test_every_engine_field_reaches_the_workers_through_their_config_files(tmp_path, model_dir):
    argv, expected = ["--model", model_dir], {"model": model_dir}
    for s in settings(EngineConfig):
        if s.name != "model":
            flag_args, expected[s.name] = not_default(s)
            argv += flag_args
    cfg = parse("serve", *argv, "--redis-url", "redis://r:1/0")
    assert cfg.engine == EngineConfig(**expected)
    cluster = serve.Cluster()
    try:
        for role in ("prefill", "decode"):
            path = os.path.join(cluster.config_dir, f"{role}.json")
            serve.write_config(serve.worker_config(cfg, model_dir, role, 0), path)
            child = parse(f"{role}-worker", "--config", path)
            assert child.engine == EngineConfig(**expected), role
            assert (child.role, child.worker_id, child.redis.url) == (role, f"{role}-0", "redis://r:1/0")
    finally:
        cluster.stop()


def test_every_frontend_field_reaches_the_frontend(model_dir):
    argv, expected = ["--model", model_dir], {}
    for s in settings(FrontendConfig):
        if s.path == "decode_profile":       # read when the config is built: a real profile
            flag_args, expected[s.path] = [s.flag, str(CURVE_PROFILE_PATH)], str(CURVE_PROFILE_PATH)
            argv += flag_args
        elif s.path == "itl_budget_share":   # a share, in (0, 1]
            argv += [s.flag, "0.5"]
            expected[s.path] = 0.5
        elif s.path.split(".")[0] not in ("model", "block_size", "max_model_len", "api_key"):
            flag_args, expected[s.path] = not_default(s)
            argv += flag_args
    cfg = parse("serve", *argv)
    fe = serve.frontend_config(cfg, model_dir)
    for path, value in expected.items():
        obj = fe
        for part in path.split("."):
            obj = getattr(obj, part)
        assert obj == value, path
    assert (fe.model, fe.block_size) == (model_dir, None)    # the frontend learns the block size


def test_the_flags_users_know_keep_their_names_and_meaning(model_dir, monkeypatch):
    monkeypatch.delenv("SPLITSERVE_REDIS_URL", raising=False)
    w = parse("decode-worker", "--model", model_dir, "--redis-url", "redis://h:6379/0", "--no-prefix-caching",
              "--no-cuda-graphs", "--kv-cpu-mib", "64", "--async-scheduling", "off", "--decode-tensor-cores", "on",
              "--mock", "--metrics-port", "9100", "--worker-id", "w", "--role", "aggregated", "--block-size", "32",
              "--kv-cache-dtype", "fp8", "--decode-kernel", "xqa", "--namespace", "ns", "--lease-ttl-s", "2",
              "--quantization", "fp8")
    e = w.engine
    assert (e.enable_prefix_caching, e.cuda_graphs, e.kv_cpu_mib, e.async_scheduling, e.decode_tensor_cores,
            e.mock, e.block_size, e.kv_cache_dtype, e.decode_kernel, e.quantization) == \
        (False, False, 64, False, True, True, 32, "fp8", "xqa", "fp8")
    assert (w.metrics_port, w.worker_id, w.role) == (9100, "w", "aggregated")
    assert (w.redis.url, w.redis.namespace, w.redis.lease_ttl_s) == ("redis://h:6379/0", "ns", 2.0)
    assert parse("prefill-worker", "--model", model_dir, "--redis-url", "redis://h/0").role == "prefill"
    s = parse("serve", "--model", model_dir, "--decode-workers", "3", "--prefill-workers", "0",
              "--startup-timeout-s", "9", "--router-policy", "round_robin", "--router-approximate",
              "--remote-prefill-min-tokens", "7", "--max-prefill-queue-tokens", "9", "--http-port", "1",
              "--grpc-port", "2", "--host", "0.0.0.0", "--model-name", "m", "--max-body-bytes", "5")
    f = s.frontend
    assert (s.decode_workers, s.prefill_workers, s.startup_timeout_s) == (3, 0, 9.0)
    assert (f.router_policy, f.router_approximate, f.remote_prefill_min_tokens, f.max_prefill_queue_tokens,
            f.http_port, f.grpc_port, f.host, f.model_name, f.max_body_bytes) == \
        ("round_robin", True, 7, 9, 1, 2, "0.0.0.0", "m", 5)
    fe = parse("frontend", "--model", model_dir, "--redis-url", "redis://h/0", "--block-size", "32",
               "--max-model-len", "100")
    assert (fe.block_size, fe.max_model_len) == (32, 100)


def test_defaults_without_flags_are_the_config_classes_defaults(monkeypatch):
    monkeypatch.delenv("SPLITSERVE_REDIS_URL", raising=False)
    monkeypatch.delenv("SPLITSERVE_API_KEY", raising=False)
    cfg = config_from_args(ServeConfig, build_parser().parse_args(["serve"]), given={"frontend.model": "tiny"})
    assert cfg == ServeConfig(engine=EngineConfig(model="tiny"), frontend=FrontendConfig(model="tiny"))


def test_ray_takes_an_address_or_alone_means_a_local_cluster():
    assert parse("serve").ray.address is None
    assert parse("serve", "--ray").ray.address == "local"
    assert parse("serve", "--ray", "10.0.0.1:6380", "--mock").ray.address == "10.0.0.1:6380"
    assert parse("serve", "--ray", "--mock").ray.address == "local"       # a flag after it is not its value
    assert parse("serve", "--ray-worker-gpus", "0.5").ray.worker_gpus == 0.5


def test_serve_on_an_unreachable_ray_address_is_a_message_and_exit_code_2(capsys):
    pytest.importorskip("ray")
    from runtime.redis_embedded import free_port
    port = free_port()                     # nothing listens there
    assert main(["serve", "--ray", f"127.0.0.1:{port}", "--mock", "--prefill-workers", "0"]) == 2
    err = capsys.readouterr().err
    assert f"cannot reach the Ray cluster at 127.0.0.1:{port}: Connection refused" in err, err


def test_tri_states_take_auto_on_off():
    for word, value in TRI_STATE.items():
        assert parse("serve", "--async-scheduling", word).engine.async_scheduling is value


def test_help_shows_every_flag_with_its_default(capsys):
    commands = build_parser()._subparsers._group_actions[0].choices
    for command, cls in (("serve", ServeConfig), ("frontend", FrontendConfig), ("decode-worker", WorkerConfig),
                         ("prefill-worker", WorkerConfig)):
        flags = {a.option_strings[0]: a.help for a in commands[command]._actions if a.option_strings}
        for s in settings(cls):
            if s.flag in flags:
                assert "(default: " in flags[s.flag], (command, s.flag)
        assert len(flags) >= len(list(settings(cls))) - 3, command
        with pytest.raises(SystemExit):
            build_parser().parse_args([command, "--help"])
        text = " ".join(capsys.readouterr().out.split())
        assert "(default: $SPLITSERVE_REDIS_URL, else none)" in text
        assert command == "frontend" or "--async-scheduling auto|on|off" in text


def test_the_planners_itl_target_and_profile_reach_the_frontend_unless_it_has_its_own(model_dir, capsys):
    def frontend(*argv):
        return serve.frontend_config(parse("serve", "--model", model_dir, *argv), model_dir)
    assert (frontend().itl_target_ms, frontend().decode_profile) == (None, None)
    fe = frontend("--planner", "--itl-ms", "20", "--planner-profile", str(CURVE_PROFILE_PATH))
    assert (fe.itl_target_ms, fe.decode_profile) == (20.0, str(CURVE_PROFILE_PATH))
    assert frontend("--planner", "--itl-ms", "20", "--itl-target-ms", "35").itl_target_ms == 35.0
    assert frontend("--itl-target-ms", "35").itl_target_ms == 35.0
    # N frontends meter a decode worker's local-prefill budget together: each gets 1/N of it
    assert (frontend().itl_budget_share, frontend("--frontends", "4").itl_budget_share) == (1.0, 0.25)
    assert frontend("--itl-guard-mode", "budget").itl_guard_mode == "budget"
    assert frontend().ttft_target_ms is None
    assert frontend("--planner", "--ttft-ms", "800").ttft_target_ms == 800.0
    assert frontend("--planner", "--ttft-ms", "800", "--ttft-target-ms", "500").ttft_target_ms == 500.0
    assert main(["serve", "--model", model_dir, "--itl-budget-share", "0"]) == 2
    assert "--itl-budget-share must be in (0, 1]" in capsys.readouterr().err
    assert main(["serve", "--model", model_dir, "--itl-target-ms", "0"]) == 2
    assert "the ITL target must be > 0" in capsys.readouterr().err
    assert main(["frontend", "--model", model_dir, "--redis-url", "redis://h/0", "--itl-target-ms", "15",
                 "--decode-profile", "/nonexistent.json"]) == 2
    assert "cannot read profile /nonexistent.json" in capsys.readouterr().err


def test_api_key_comes_from_the_environment_and_never_reaches_a_file(tmp_path, model_dir, monkeypatch):
    monkeypatch.setenv("SPLITSERVE_API_KEY", "sk-secret")
    monkeypatch.setenv("SPLITSERVE_REDIS_URL", "redis://h/0")
    cfg = parse("serve", "--model", model_dir)
    assert cfg.frontend.api_key == "sk-secret"
    fe = serve.frontend_config(cfg, model_dir)
    assert fe.api_key is None
    path = tmp_path / "fe.json"
    serve.write_config(cfg.frontend, path)        # even a config holding the key leaves it out
    assert "sk-secret" not in path.read_text() and "api_key" not in json.loads(path.read_text())
    assert stat.S_IMODE(os.stat(path).st_mode) == 0o600
    assert parse("frontend", "--config", str(path), "--model", model_dir).api_key == "sk-secret"   # by env


def test_serve_keeps_its_children_configs_in_a_private_directory_and_removes_it():
    cluster = serve.Cluster()
    assert stat.S_IMODE(os.stat(cluster.config_dir).st_mode) == 0o700
    cluster.stop()
    assert not os.path.exists(cluster.config_dir)


def test_bad_input_is_a_message_and_exit_code_2(tmp_path, model_dir, capsys, monkeypatch):
    monkeypatch.delenv("SPLITSERVE_REDIS_URL", raising=False)
    bad = tmp_path / "bad.json"
    bad.write_text(json.dumps({"engine": {"blok_size": 8}}))
    cases = {("decode-worker", "--config", str(bad)): "unknown field 'engine.blok_size'",
             ("decode-worker", "--config", str(tmp_path / "none.json")): "cannot read config file",
             ("frontend", "--model", model_dir): "--redis-url",
             ("decode-worker", "--model", str(tmp_path), "--redis-url", "redis://h/0"): "not a HF model directory",
             ("decode-worker", "--role", "prefill", "--redis-url", "redis://h/0"): "prefill-worker"}
    for argv, message in cases.items():
        assert main(list(argv)) == 2, argv
        err = capsys.readouterr().err
        assert message in err and "Traceback" not in err, (argv, err)


def test_config_classes_declare_help_for_every_field():
    for cls in (EngineConfig, FrontendConfig, WorkerConfig, ServeConfig):
        leaves = {s.path.split(".")[0] for s in settings(cls)}
        assert {f.name for f in fields(cls)} == leaves
        assert all(s.meta.help for s in settings(cls))
        assert all(s.default is not MISSING or s.meta.cli_default for s in settings(cls))


def test_serve_refuses_a_checkpoint_it_cannot_run_in_one_line(tmp_path, capsys):
    """An unsupported quantization_config stops `serve` before it starts anything: exit 2, one line
    naming the format; with --planner and FP8 weights, the missing FP8 profile is named too."""
    model = tmp_path / "gptq"
    model.mkdir()
    (model / "config.json").write_text(json.dumps({"model_type": "llama", "quantization_config": {
        "quant_method": "gptq", "bits": 4}}))
    assert main(["serve", "--model", str(model)]) == 2
    err = capsys.readouterr().err.strip()
    assert "quant_method 'gptq'" in err and len(err.splitlines()) == 1 and "Traceback" not in err
    assert main(["serve", "--quantization", "fp8", "--planner", "--mock"]) == 2
    assert "no performance profile is shipped for fp8" in capsys.readouterr().err


def test_device_cuda_without_cuda_is_one_line_within_three_seconds(capsys, monkeypatch):
    from runtime.host_checks import cuda_problem
    if not cuda_problem():
        pytest.skip("this machine has CUDA")
    monkeypatch.setenv("SPLITSERVE_REDIS_URL", "redis://127.0.0.1:1/0")
    for argv in (["serve", "--device", "cuda"], ["decode-worker", "--device", "cuda"],
                 ["prefill-worker", "--device", "cuda"]):
        t0 = time.monotonic()
        assert main(argv) == 2, argv
        took_s = time.monotonic() - t0
        err = capsys.readouterr().err
        assert took_s < 3.0, (argv, took_s)
        assert "--device cuda" in err and "Traceback" not in err and len(err.strip().splitlines()) == 1, err


def test_a_missing_kv_disk_dir_is_named_as_given_in_one_line(tmp_path, capsys, monkeypatch):
    monkeypatch.setenv("SPLITSERVE_REDIS_URL", "redis://127.0.0.1:1/0")
    missing = tmp_path / "no-such-dir"
    tiers = ["--kv-host-gib", "0.01", "--kv-disk-gib", "0.01", "--kv-disk-dir", str(missing), "--device", "cpu"]
    assert main(["serve", *tiers]) == 2
    err = capsys.readouterr().err
    assert f"--kv-disk-dir {missing} does not exist" in err and "Traceback" not in err, err
    from runtime.worker_host import worker_engine_config
    from runtime.errors import StartupError
    cfg = parse("decode-worker", *tiers, "--worker-id", "decode-0")
    with pytest.raises(StartupError, match=f"--kv-disk-dir {missing} does not exist"):
        worker_engine_config(cfg)              # the worker names the user's directory, not decode-0
    assert not missing.exists()


@pytest.mark.parametrize("why, flags", [("NIXL", []), ("NIXL", ["--mock"])])
def test_serving_aggregated_against_the_flags_says_what_was_asked_and_why(why, flags, monkeypatch, capsys):
    import sys
    from runtime.errors import InvalidRequest
    monkeypatch.setitem(sys.modules, "nixl", None)         # NIXL not installed
    monkeypatch.setenv("SPLITSERVE_REDIS_URL", "redis://127.0.0.1:1/0")
    cfg, reason = serve.serving_mode(parse("serve", "--prefill-workers", "1", "--decode-workers", "2", *flags))
    assert (cfg.prefill_workers, cfg.decode_workers) == (0, 2)
    assert "--prefill-workers 1 was asked" in reason and why in reason, reason
    note = serve.pool_book(cfg, reason).pools["prefill"].fixed      # what `pools status|limits` show
    assert "--prefill-workers 1 was asked" in note and why in note and "started with" not in note, note
    with pytest.raises(InvalidRequest, match="--prefill-workers 1 was asked") as e:
        serve.pool_book(cfg, reason).scale({"prefill": 1})           # `pools scale --prefill 1`
    assert "started with --prefill-workers 0" not in e.value.message
    asked_zero, none = serve.serving_mode(parse("serve", "--prefill-workers", "0"))
    assert none == "" and "started with --prefill-workers 0" in serve.pool_book(asked_zero).pools["prefill"].fixed


def test_mock_workers_serve_disaggregated_where_nixl_is(monkeypatch):
    from kvstore.movers import transfer
    monkeypatch.setattr(transfer, "nixl_available", lambda: True)
    monkeypatch.setenv("SPLITSERVE_REDIS_URL", "redis://127.0.0.1:1/0")
    cfg, reason = serve.serving_mode(parse("serve", "--mock", "--prefill-workers", "1", "--decode-workers", "2"))
    assert (cfg.prefill_workers, cfg.decode_workers, reason) == (1, 2, "")


def test_worker_ports_come_from_the_range_two_each_and_a_restart_keeps_its_own():
    from splitserve.serve_plan import WorkerPorts
    ports = WorkerPorts.parse("52000-52005", 3)
    assert ports.assign("decode-0", set()) == (52000, 52001)
    assert ports.assign("prefill-0", {"decode-0"}) == (52002, 52003)
    assert ports.assign("decode-0", {"decode-0", "prefill-0"}) == (52000, 52001)     # restarted: the same
    assert ports.assign("decode-1", {"prefill-0"}) == (52000, 52001)                 # decode-0 left: free again
    assert ports.assign("decode-2", {"prefill-0", "decode-1"}) == (52004, 52005)
    with pytest.raises(ValueError, match="no two free ports for decode-3: widen it"):
        ports.assign("decode-3", {"prefill-0", "decode-1", "decode-2"})
    assert WorkerPorts.parse(None, 3).assign("decode-0", set()) == (0, 0)            # free ones


@pytest.mark.parametrize("value, message", [
    ("52000", "give LOW-HIGH"), ("52010-52000", "give LOW-HIGH"), ("0-10", "give LOW-HIGH"),
    ("x-y", "give LOW-HIGH"), ("52000-52002", "holds 3 ports: 2 workers need 4"),
])
def test_bad_worker_ports_are_one_line_before_anything_starts(value, message, capsys, monkeypatch):
    monkeypatch.setenv("SPLITSERVE_REDIS_URL", "redis://127.0.0.1:1/0")
    assert main(["serve", "--device", "cpu", "--worker-ports", value]) == 2
    err = capsys.readouterr().err
    assert f"--worker-ports {value}" in err and message in err and "Traceback" not in err, err


def test_an_embedded_redis_port_in_use_is_one_line(capsys):
    import socket
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        s.listen()
        port = s.getsockname()[1]
        assert main(["serve", "--device", "cpu", "--redis-port", str(port), "--admin-port", "0"]) == 2
    err = capsys.readouterr().err
    assert f"the embedded Redis did not start on 127.0.0.1:{port}" in err and "--redis-port" in err, err
    assert "Traceback" not in err
