"""Which workers a frontend admits (frontend/admission.py), what a worker advertises in its lease
(runtime/worker_host.py), and the model fingerprint both sides compare."""

from __future__ import annotations

import shutil
import socket

from frontend.admission import Admission
from runtime.config import EngineConfig, WorkerConfig
from runtime.discovery import WorkerInfo
from runtime.model_config import model_fingerprint
from runtime.worker_host import advertised_host, host_port
from splitserve.models import resolve_model


def info(worker_id: str, block_size: int = 16, fingerprint: str = "fp") -> WorkerInfo:
    return WorkerInfo(worker_id=worker_id, role="decode", address="h:1", model="/models/m", block_size=block_size,
                      num_blocks=10, model_fingerprint=fingerprint)


def test_the_first_worker_fixes_the_block_size_and_a_disagreeing_one_is_refused():
    a = Admission("fp")
    assert a.refusal(info("w1", 32)) is None
    assert a.block_size == 32
    assert a.refusal(info("w2", 32)) is None
    why = a.refusal(info("w3", 16))
    assert why == "its KV block size is 16 tokens, this frontend's is 32 (from worker w1)"


def test_an_explicit_block_size_is_not_overridden_by_workers():
    a = Admission("fp", block_size=16)
    assert "this frontend's is 16 (from --block-size)" in a.refusal(info("w1", 32))
    assert a.refusal(info("w2", 16)) is None


def test_a_worker_of_another_model_is_refused_and_fixes_nothing():
    a = Admission("fp")
    why = a.refusal(info("w1", 32, fingerprint="other"))
    assert why == "it serves another model (fingerprint other of /models/m on its machine; this frontend's is fp)"
    assert a.block_size is None
    assert "fingerprint none published" in a.refusal(info("w2", fingerprint=""))


def test_the_fingerprint_follows_content_not_path(tmp_path):
    tiny = resolve_model("tiny")
    copy = shutil.copytree(tiny, tmp_path / "elsewhere")
    assert model_fingerprint(copy) == model_fingerprint(tiny)
    assert model_fingerprint(resolve_model("tiny-qwen2")) != model_fingerprint(tiny)
    (copy / "tokenizer.json").write_text((copy / "tokenizer.json").read_text().replace('"', "'", 1))
    assert model_fingerprint(copy) != model_fingerprint(tiny)


def test_a_worker_advertises_where_it_can_be_reached():
    def cfg(**kw) -> WorkerConfig:
        return WorkerConfig(engine=EngineConfig(model="/m"), **kw)
    assert advertised_host(cfg(host="127.0.0.1")) == "127.0.0.1"
    assert advertised_host(cfg(host="0.0.0.0", advertise_host="pod-1.svc")) == "pod-1.svc"
    for wildcard in ("0.0.0.0", "::"):
        ip = advertised_host(cfg(host=wildcard))
        assert ip not in ("0.0.0.0", "::", "")
        socket.inet_aton(ip)           # an IPv4 address of this machine
    assert host_port("10.0.0.1", 7) == "10.0.0.1:7" and host_port("fe80::1", 7) == "[fe80::1]:7"
