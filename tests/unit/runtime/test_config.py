"""Config files: nested frozen configs round-trip through JSON; a wrong field, type or choice is an
error that names the field; secrets stay out; a flag beats the file, the file beats the environment."""

from __future__ import annotations

import argparse
import json

import pytest

from runtime.cli_args import add_config_args, config_from_args
from runtime.config import EngineConfig, FrontendConfig, RedisConfig, ServeConfig, WorkerConfig
from runtime.config_fields import ConfigError
from runtime.config_file import config_from_dict, config_to_dict, read_config, write_config


def test_nested_configs_round_trip_through_a_file(tmp_path):
    cfg = WorkerConfig(engine=EngineConfig(model="/m", block_size=32, num_blocks=None, kv_memory_fraction=0.5,
                                           async_scheduling=False, decode_tensor_cores=None, fused_rope_kv=False),
                       redis=RedisConfig(url="redis://h:1/0", lease_ttl_s=2.0), role="prefill",
                       advertise_host="10.0.0.7", metrics_port=0)
    path = tmp_path / "w.json"
    write_config(cfg, path)
    assert config_from_dict(WorkerConfig, json.loads(path.read_text())) == cfg
    serve = ServeConfig(engine=cfg.engine, frontend=FrontendConfig(model="/m", block_size=32), prefill_workers=0)
    assert config_from_dict(ServeConfig, json.loads(json.dumps(config_to_dict(serve)))) == serve


def test_a_file_may_leave_fields_out_but_not_the_required_ones():
    assert config_from_dict(WorkerConfig, {"engine": {"model": "/m"}}) == WorkerConfig(engine=EngineConfig(model="/m"))
    with pytest.raises(ConfigError, match="engine.model is required"):
        config_from_dict(WorkerConfig, {"engine": {}})


@pytest.mark.parametrize("data, message", [
    ({"engine": {"model": "/m", "blok_size": 16}}, "unknown field 'engine.blok_size' (EngineConfig has model, "),
    ({"engine": {"model": "/m"}, "redis": {"uri": "x"}}, "unknown field 'redis.uri'"),
    ({"engine": {"model": "/m", "block_size": "16"}}, "engine.block_size: expected int, got str '16'"),
    ({"engine": {"model": "/m", "block_size": True}}, "engine.block_size: expected int, got bool"),
    ({"engine": {"model": "/m", "block_size": None}}, "engine.block_size: must be set"),
    ({"engine": {"model": "/m", "mock": "yes"}}, "engine.mock: expected bool"),
    ({"engine": {"model": "/m", "device": "tpu"}}, "engine.device: 'tpu' is not one of auto, cpu, cuda"),
    ({"engine": "/m"}, "engine must be an object"),
    ([], "the top level must be an object"),
])
def test_a_bad_field_is_an_error_that_names_it(data, message):
    with pytest.raises(ConfigError) as e:
        config_from_dict(WorkerConfig, data, where="w.json")
    assert message in str(e.value) and str(e.value).startswith("w.json: ")


def test_ints_are_valid_floats_and_optionals_take_null():
    cfg = config_from_dict(WorkerConfig, {"engine": {"model": "/m", "kv_memory_fraction": 1, "num_blocks": None},
                                          "redis": {"lease_ttl_s": 3}})
    assert (cfg.engine.kv_memory_fraction, cfg.redis.lease_ttl_s, cfg.engine.num_blocks) == (1.0, 3.0, None)
    assert isinstance(cfg.redis.lease_ttl_s, float)


def test_secrets_are_never_written_and_refused_when_read(tmp_path):
    cfg = FrontendConfig(model="/m", api_key="sk-1")
    assert "api_key" not in config_to_dict(cfg)
    with pytest.raises(ConfigError, match="api_key is a secret .* set SPLITSERVE_API_KEY"):
        config_from_dict(FrontendConfig, {"model": "/m", "api_key": "sk-1"})


def test_not_json_is_a_clear_error(tmp_path):
    p = tmp_path / "c.json"
    p.write_text("model: /m")
    with pytest.raises(ConfigError, match="is not JSON"):
        read_config(WorkerConfig, p)


def test_a_flag_beats_the_file_the_file_beats_the_environment(tmp_path, monkeypatch):
    parser = argparse.ArgumentParser()
    add_config_args(parser, WorkerConfig)
    path = tmp_path / "w.json"
    path.write_text(json.dumps({"engine": {"model": "/file", "block_size": 32}, "redis": {"url": "redis://file/0"}}))
    monkeypatch.setenv("SPLITSERVE_REDIS_URL", "redis://env/0")
    cfg = config_from_args(WorkerConfig, parser.parse_args(["--config", str(path), "--block-size", "8"]))
    assert (cfg.engine.model, cfg.engine.block_size, cfg.redis.url) == ("/file", 8, "redis://file/0")
    path.write_text(json.dumps({"engine": {"model": "/file"}}))
    cfg = config_from_args(WorkerConfig, parser.parse_args(["--config", str(path)]))
    assert (cfg.engine.block_size, cfg.redis.url) == (16, "redis://env/0")
    cfg = config_from_args(WorkerConfig, parser.parse_args(["--config", str(path), "--redis-url", "redis://flag/0"]))
    assert cfg.redis.url == "redis://flag/0"
