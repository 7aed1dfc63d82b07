"""With an API key, /v1/* and the gRPC API need it; /health does not; the key never leaks into
the logs or into the command lines of the processes `splitserve serve` starts. The same for the admin
token (set here by flag or environment, like the key): the admin API needs it, not the API key, and
it reaches no child at all (argv, environment) and no file."""

from __future__ import annotations

import json
import os
from pathlib import Path

import grpc
import httpx
import pytest

from proto.splitserve.v1 import generation_pb2 as pb
from proto.splitserve.v1 import generation_pb2_grpc as pb_grpc

from .conftest import start_cluster

pytestmark = pytest.mark.slow

KEY = "sk-test-9f3a7c1e55d04b2b"
ADMIN = "adm-test-41c7e0b9a2d35f68"


def descendants(pid: int) -> list[int]:
    """Every live process below `pid` (from /proc: no psutil needed)."""
    children: dict[int, list[int]] = {}
    for entry in Path("/proc").iterdir():
        if entry.name.isdigit():
            try:
                ppid = int((entry / "stat").read_text().rsplit(")", 1)[1].split()[1])
            except (OSError, IndexError, ValueError):
                continue
            children.setdefault(ppid, []).append(int(entry.name))
    out, todo = [], [pid]
    while todo:
        for c in children.get(todo.pop(), []):
            out.append(c)
            todo.append(c)
    return out


@pytest.fixture(scope="module", params=["flag", "env"])
def keyed(request, tmp_path_factory):
    # a state directory of its own (admin token files: runtime/admin_auth.py), for the cluster, the
    # CLI and the checks below: the token file a test looks at is then this cluster's, never one that
    # a serve killed elsewhere left for the same port number
    with pytest.MonkeyPatch.context() as mp:
        mp.setenv("XDG_RUNTIME_DIR", str(tmp_path_factory.mktemp("state")))
        env = dict(os.environ)
        args = ["--model", "tiny"]
        if request.param == "flag":
            args += ["--api-key", KEY, "--admin-token", ADMIN]
        else:
            env["SPLITSERVE_API_KEY"] = KEY
            env["SPLITSERVE_ADMIN_TOKEN"] = ADMIN
        c = start_cluster(tmp_path_factory.mktemp("keyed"), *args, env=env)
        yield c
        assert c.stop() == 0


def completion(c, headers=None) -> httpx.Response:
    return httpx.post(f"{c.url}/v1/completions", headers=headers or {}, timeout=30,
                      json={"model": "tiny", "prompt": "hi", "max_tokens": 2})


def test_http_needs_the_key(keyed):
    for headers in (None, {"Authorization": "Bearer wrong"}, {"Authorization": KEY},
                    {"Authorization": f"Basic {KEY}"}, {"Authorization": f"Bearer {KEY}x"}):
        r = completion(keyed, headers)
        assert r.status_code == 401, (headers, r.text)
        assert r.json()["error"]["type"] == "authentication_error"
    assert httpx.get(f"{keyed.url}/v1/models", timeout=10).status_code == 401
    r = httpx.post(f"{keyed.url}/v1/chat/completions", timeout=10,
                   json={"model": "tiny", "messages": [{"role": "user", "content": "x"}]})
    assert r.status_code == 401
    ok = {"Authorization": f"Bearer {KEY}"}
    r = completion(keyed, ok)
    assert r.status_code == 200 and r.json()["usage"]["completion_tokens"] == 2
    assert httpx.get(f"{keyed.url}/v1/models", headers=ok, timeout=10).status_code == 200


def test_openai_client_with_the_key(keyed):
    openai = pytest.importorskip("openai")
    with openai.OpenAI(base_url=f"{keyed.url}/v1", api_key=KEY, max_retries=0) as c:
        assert c.completions.create(model="tiny", prompt="x", max_tokens=1).usage.completion_tokens == 1
    with openai.OpenAI(base_url=f"{keyed.url}/v1", api_key="nope", max_retries=0) as c:
        with pytest.raises(openai.AuthenticationError):
            c.completions.create(model="tiny", prompt="x", max_tokens=1)


def test_health_and_metrics_stay_open(keyed):
    assert httpx.get(f"{keyed.url}/health", timeout=10).status_code == 200
    assert httpx.get(f"{keyed.url}/metrics", timeout=10).status_code == 200


def test_grpc_needs_the_key(keyed):
    req = pb.GenerateRequest(model="tiny", text="hi", sampling=pb.SamplingParams(max_tokens=2))
    with grpc.insecure_channel(keyed.grpc_target) as ch:
        stub = pb_grpc.GenerationStub(ch)
        for md in (None, [("authorization", "Bearer wrong")], [("authorization", KEY)]):
            with pytest.raises(grpc.RpcError) as e:
                list(stub.Generate(req, metadata=md, timeout=30))
            assert e.value.code() == grpc.StatusCode.UNAUTHENTICATED, md
            with pytest.raises(grpc.RpcError) as e:
                stub.ListModels(pb.ListModelsRequest(), metadata=md, timeout=30)
            assert e.value.code() == grpc.StatusCode.UNAUTHENTICATED, md
        md = [("authorization", f"Bearer {KEY}")]
        out = list(stub.Generate(req, metadata=md, timeout=30))
        assert out[-1].usage.completion_tokens == 2
        assert stub.ListModels(pb.ListModelsRequest(), metadata=md, timeout=30).models[0].id == "tiny"
        # the health check is open, as orchestrators probe it without credentials
        from grpc_health.v1 import health_pb2, health_pb2_grpc
        r = health_pb2_grpc.HealthStub(ch).Check(health_pb2.HealthCheckRequest(), timeout=10)
        assert r.status == health_pb2.HealthCheckResponse.SERVING


def test_the_key_is_in_no_log_and_no_child_command_line(keyed):
    # provoke some logging first: failed and successful requests
    completion(keyed, {"Authorization": "Bearer wrong"})
    completion(keyed, {"Authorization": f"Bearer {KEY}"})
    kids = descendants(keyed.proc.pid)
    assert len(kids) >= 3                        # redis-server, a worker, the frontend
    holders = []
    for pid in kids:
        try:
            argv = Path(f"/proc/{pid}/cmdline").read_bytes().replace(b"\0", b" ").decode()
            environ = Path(f"/proc/{pid}/environ").read_bytes()
        except OSError:
            continue
        assert KEY not in argv, argv
        if KEY.encode() in environ:
            holders.append(argv)
    # the frontend alone holds the key (by environment); no worker, no Redis
    assert len(holders) == 1 and " frontend " in holders[0], holders
    assert KEY not in keyed.log()


def test_the_ready_banner_shows_a_curl_that_sends_the_key_by_placeholder(keyed):
    banner = keyed.log()[keyed.log().index("Splitserve is ready"):]
    curl = next(line for line in banner.splitlines() if "curl " in line)
    assert '-H "Authorization: Bearer $SPLITSERVE_API_KEY"' in curl, curl
    assert KEY not in banner


def test_the_admin_api_needs_the_admin_token_which_reaches_no_child(keyed):
    from proto.splitserve.v1 import admin_pb2, admin_pb2_grpc
    from runtime.admin_auth import token_file
    with grpc.insecure_channel(keyed.admin_url) as ch:
        stub = admin_pb2_grpc.AdminStub(ch)
        for md in (None, [("authorization", f"Bearer {KEY}")], [("authorization", ADMIN)]):
            with pytest.raises(grpc.RpcError) as e:
                stub.GetStatus(admin_pb2.GetStatusRequest(), metadata=md, timeout=10)
            assert e.value.code() == grpc.StatusCode.UNAUTHENTICATED, md
        st = stub.GetStatus(admin_pb2.GetStatusRequest(), metadata=[("authorization", f"Bearer {ADMIN}")], timeout=10)
        assert [p.pool for p in st.pools] == ["decode", "prefill"]
    assert not token_file(keyed.admin_port).exists()         # a configured token is never written
    env = {k: v for k, v in os.environ.items() if k != "SPLITSERVE_ADMIN_TOKEN"}
    r = keyed.cli("pools", "status", env=env, check=False)
    assert r.returncode == 1 and "refused the token (none given)" in r.stderr, r.stderr
    assert keyed.cli("pools", "status", "--admin-token", ADMIN, env=env).stdout.startswith("POOL")
    for pid in descendants(keyed.proc.pid):
        try:
            argv = Path(f"/proc/{pid}/cmdline").read_bytes()
            environ = Path(f"/proc/{pid}/environ").read_bytes()
        except OSError:
            continue
        assert ADMIN.encode() not in argv and ADMIN.encode() not in environ, argv
    assert ADMIN not in keyed.log()


def test_a_worker_refuses_calls_without_the_cluster_token(keyed):
    """With the API key set, a process that reaches a worker's port can neither drain it nor
    generate without the key: worker RPCs need the cluster token, which no log and no command line
    shows. The cluster itself (frontend, controller) uses it: the key tests above were served."""
    from proto.splitserve.v1 import worker_pb2, worker_pb2_grpc
    workers = json.loads(keyed.cli("workers", "list", "--json", "--admin-token", ADMIN).stdout)
    assert workers and all(w["address"] for w in workers)
    for w in workers:
        with grpc.insecure_channel(w["address"]) as ch:
            stub = worker_pb2_grpc.WorkerStub(ch)
            for call in (lambda: stub.Drain(worker_pb2.DrainRequest(), timeout=10),
                         lambda: stub.GetStatus(worker_pb2.WorkerStatusRequest(), timeout=10),
                         lambda: list(stub.Session(iter([]), timeout=10))):
                with pytest.raises(grpc.RpcError) as e:
                    call()
                assert e.value.code() == grpc.StatusCode.UNAUTHENTICATED
            assert stub.GetStatus(worker_pb2.WorkerStatusRequest(), timeout=10,
                                  metadata=keyed.worker_metadata).worker_id == w["worker_id"]
    assert completion(keyed, {"Authorization": f"Bearer {KEY}"}).status_code == 200    # nothing was drained
    assert keyed.cluster_token not in keyed.log()
    for pid in descendants(keyed.proc.pid):
        try:
            argv = Path(f"/proc/{pid}/cmdline").read_bytes()
        except OSError:
            continue
        assert keyed.cluster_token.encode() not in argv
