"""The planner's Kubernetes connector (pools/k8s_connector.py) through the real `kubernetes` client
against a stand-in API server (tests/deploy/k8s_stand_in.py) set up from the rendered chart: its
namespace, the Deployment names in the planner's config, their pod selectors.

- scale-up patches replicas through the scale subresource; a replica without a pod is a placeholder;
- scale-down drains the chosen pod first (Worker.Drain), waits for it to be reported not ready
  (its readiness probe), then lowers replicas: Kubernetes removes that pod and no other, and the
  connector wrote to no pod;
- a CrashLoopBackOff pod is `failed`; `stop` removes it the same way, without a drain;
- refusals and an unreachable API are ConnectorError;
- the chart's planner Role allows exactly the calls the connector made, and nothing more.
"""

from __future__ import annotations

import asyncio

import pytest

pytest.importorskip("kubernetes")

from pools.connector import ConnectorError, HandleState  # noqa: E402
from pools import k8s_connector  # noqa: E402
from pools.k8s_connector import KubernetesConnector  # noqa: E402
from pools.book import PoolName  # noqa: E402
from tests.deploy.chart import by_kind, component_configs, manifests  # noqa: E402
from tests.deploy.k8s_stand_in import StandInApi, rbac_request  # noqa: E402

VALUE_SET = "default-values.yaml"        # prefill + decode pools, planner on


def chart_setup() -> tuple[str, dict[PoolName, str], dict[str, dict[str, str]], dict]:
    objs = manifests(VALUE_SET)
    k8s = component_configs(objs)["controller"]["kubernetes"]
    deployments = {PoolName.DECODE: k8s["decode_deployment"], PoolName.PREFILL: k8s["prefill_deployment"]}
    found = by_kind(objs, "Deployment")
    labels = {name: found[name]["spec"]["selector"]["matchLabels"] for name in deployments.values()}
    (role,) = by_kind(objs, "Role").values()
    return k8s["namespace"], deployments, labels, role


@pytest.fixture
def setup():
    ns, deployments, labels, role = chart_setup()
    api = StandInApi(ns, labels, replicas=1)
    drained: list[str] = []

    async def drain_rpc(name: str) -> bool:
        api.calls.append(("DRAIN-RPC", name, ""))      # in order with the API calls
        drained.append(name)
        # the worker answers NOT_SERVING now; its readiness probe fails a moment later
        asyncio.get_running_loop().call_later(0.3, api.set_ready, name, False)
        return True

    conn = KubernetesConnector(ns, deployments, drain_rpc, api_client=api.client())
    yield api, conn, deployments, drained, role
    api.close()


def names(conn, pool=None, state=None) -> list[str]:
    return sorted(h.name for h in conn.list() if (pool is None or h.pool == pool) and (state is None or h.state == state))


def test_scale_up_patches_replicas_and_counts_the_new_pod_at_once(setup):
    api, conn, deployments, _, _ = setup
    decode = deployments[PoolName.DECODE]

    async def go():
        await conn.refresh()
        assert len(names(conn, PoolName.DECODE)) == 1 and len(names(conn, PoolName.PREFILL)) == 1
        api.hold_pods = True                           # the ReplicaSet has not made the pod yet
        h = await conn.start(PoolName.DECODE)
        assert h.name == f"{decode}-pending-0" and h.state == HandleState.RUNNING
        assert api.deployments[decode].replicas == 2
        await conn.refresh()
        assert names(conn, PoolName.DECODE)[-1] == f"{decode}-pending-0"   # counted while there is no pod
        api.release_pods()
        await conn.refresh()
        pods = [p["metadata"]["name"] for p in api.pods(decode)]
        assert names(conn, PoolName.DECODE) == sorted(pods) and len(pods) == 2
    asyncio.run(go())
    assert ("PATCH", f"/apis/apps/v1/namespaces/{api.namespace}/deployments/{decode}/scale", "") in api.calls


def test_scale_down_drains_the_chosen_pod_first_and_kubernetes_removes_that_one(setup):
    api, conn, deployments, drained, _ = setup
    decode = deployments[PoolName.DECODE]

    async def go():
        for _ in range(2):
            await conn.start(PoolName.DECODE)
        await conn.refresh()
        pods = [p["metadata"]["name"] for p in api.pods(decode)]
        assert len(pods) == 3
        chosen = pods[1]                          # neither the oldest nor the newest: Kubernetes' own pick
        del api.calls[:]
        await conn.drain(chosen)
        assert drained == [chosen]
        # first the drain, then (once it is not ready) one replica less; no pod is written to
        steps = [(m, p.rsplit("/", 1)[-1]) for m, p, _ in api.calls if m != "GET"]
        assert steps == [("DRAIN-RPC", chosen), ("PATCH", "scale")], steps
        assert api.deployments[decode].replicas == 2
        pod = {p["metadata"]["name"]: p for p in api.pods(decode)}
        terminating = [n for n, p in pod.items() if "deletionTimestamp" in p["metadata"]]
        assert terminating == [chosen]            # the drained pod goes, no other
        await conn.refresh()
        assert names(conn, PoolName.DECODE, HandleState.DRAINING) == [chosen]
        assert len(names(conn, PoolName.DECODE, HandleState.RUNNING)) == 2      # no placeholder for it
        api.finish_terminations()                 # its preStop drain is over, the pod is gone
        await conn.refresh()
        assert chosen not in names(conn) and len(names(conn, PoolName.DECODE)) == 2
    asyncio.run(go())


def test_a_drained_pod_still_ready_after_the_wait_is_scaled_down_anyway(setup, monkeypatch):
    """A readiness probe that never fails (a worker that took the drain but answers SERVING): the
    connector does not wait forever; Kubernetes then removes its own pick and the pool keeps its size."""
    api, conn, deployments, drained, _ = setup
    decode = deployments[PoolName.DECODE]
    monkeypatch.setattr(k8s_connector, "NOT_READY_WAIT_S", 1.0)

    async def go():
        await conn.start(PoolName.DECODE)
        await conn.refresh()
        pods = [p["metadata"]["name"] for p in api.pods(decode)]

        async def drain_but_stay_ready(name: str) -> bool:
            drained.append(name)
            return True
        conn._drain_rpc = drain_but_stay_ready
        await conn.drain(pods[0])
        assert drained == [pods[0]] and api.deployments[decode].replicas == 1
        assert len([p for p in api.pods(decode) if "deletionTimestamp" in p["metadata"]]) == 1
    asyncio.run(go())


def test_a_crash_looping_pod_is_failed_and_stop_removes_it_without_a_drain(setup):
    api, conn, deployments, drained, _ = setup
    prefill = deployments[PoolName.PREFILL]

    async def go():
        await conn.refresh()
        (pod,) = [p["metadata"]["name"] for p in api.pods(prefill)]
        api.crash_loop(pod)
        await conn.refresh()
        (h,) = [h for h in conn.list() if h.name == pod]
        assert h.state == HandleState.FAILED and h.restarts == 6 and "CrashLoopBackOff" in h.detail
        await conn.stop(pod)
        assert drained == []
        assert api.deployments[prefill].replicas == 0
        assert "deletionTimestamp" in api.pods(prefill)[0]["metadata"]
    asyncio.run(go())


def test_refusals_and_an_unreachable_api_are_connector_errors(setup):
    api, conn, deployments, _, _ = setup
    bad = KubernetesConnector(api.namespace, {PoolName.DECODE: "no-such-deployment"}, None, api.client())
    with pytest.raises(ConnectorError, match="refused read_namespaced_deployment_scale: 404"):
        asyncio.run(bad.refresh())
    wrong_token = KubernetesConnector(api.namespace, deployments, None, api.client(token="wrong"))
    with pytest.raises(ConnectorError, match="401"):
        asyncio.run(wrong_token.start(PoolName.DECODE))
    with pytest.raises(KeyError):
        asyncio.run(conn.drain("not-a-pod"))
    from kubernetes import client
    cfg = client.Configuration()
    cfg.host, cfg.retries = "http://127.0.0.1:1", 0
    gone = KubernetesConnector(api.namespace, deployments, None, client.ApiClient(cfg))
    with pytest.raises(ConnectorError, match="unreachable"):
        asyncio.run(gone.refresh())


def test_the_chart_role_allows_exactly_the_calls_the_connector_makes(setup):
    api, conn, deployments, _, role = setup

    async def every_path():
        await conn.refresh()
        for pool in (PoolName.DECODE, PoolName.PREFILL):
            await conn.start(pool)
            await conn.refresh()
            pods = names(conn, pool)
            await conn.drain(pods[0])
            await conn.refresh()
            api.crash_loop(pods[1])
            await conn.refresh()
            await conn.stop(pods[1])
            await conn.refresh()
    asyncio.run(every_path())

    made = {rbac_request(m, p, q) for m, p, q in api.calls if m != "DRAIN-RPC"}

    def allowed(group, resource, verb, name):
        return any(group in r["apiGroups"] and resource in r["resources"] and verb in r["verbs"]
                   and (not r.get("resourceNames") or name in r["resourceNames"]) for r in role["rules"])
    assert [c for c in made if not allowed(*c)] == []                 # everything it does is allowed
    granted = {(g, res, v, n) for r in role["rules"] for g in r["apiGroups"] for res in r["resources"]
               for v in r["verbs"] for n in (r.get("resourceNames") or ["*"])}
    used = {(g, res, v, n if (g, res) == ("apps", "deployments/scale") else "*") for g, res, v, n in made}
    assert granted == used                                            # and nothing it does not


def test_splitserve_controller_scales_the_chart_deployments_through_pools_scale(tmp_path):
    """The component end to end: `splitserve controller` (real Redis, admin API, CLI) against the
    stand-in API server, set up as the chart names things. No worker pods run, so no lease: every
    pod is a starting worker, and the drain RPC finds no address (the preStop drain remains)."""
    import os
    import signal
    import subprocess
    import sys

    from runtime.redis_embedded import EmbeddedRedis, free_port
    from tests.deploy.k8s_stand_in import TOKEN
    from tests.integration.cluster import ROOT, until

    ns, deployments, labels, _ = chart_setup()
    api = StandInApi(ns, labels, replicas=2)
    port = free_port()
    env = {**os.environ, "SPLITSERVE_KUBE_TOKEN": TOKEN, "SPLITSERVE_ADMIN_TOKEN": "t0ken-for-the-test"}
    log = tmp_path / "controller.log"
    with EmbeddedRedis() as redis, open(log, "wb") as out:
        proc = subprocess.Popen(
            [sys.executable, "-m", "splitserve", "controller", "--kube-api-url", api.url, "--kube-namespace", ns,
             "--decode-deployment", deployments[PoolName.DECODE], "--prefill-deployment",
             deployments[PoolName.PREFILL], "--redis-url", redis.url, "--admin-port", str(port),
             "--metrics-port", "0"], cwd=ROOT, env=env, stdout=out, stderr=subprocess.STDOUT)

        def cli(*args):
            r = subprocess.run([sys.executable, "-m", "splitserve", *args, "--admin-url", f"127.0.0.1:{port}"],
                               cwd=ROOT, env=env, capture_output=True, text=True, timeout=60)
            assert r.returncode == 0, r.stdout + r.stderr + log.read_text()
            return r.stdout
        try:
            until(lambda: proc.poll() is not None or "admin API on" in log.read_text(), 30, 0.1, "the controller")
            assert proc.poll() is None, log.read_text()
            decode = deployments[PoolName.DECODE]
            assert api.deployments[decode].replicas == 2          # it started from the current replicas
            cli("pools", "scale", "--decode", "4")
            until(lambda: api.deployments[decode].replicas == 4, 15, 0.1, "decode scaled to 4")
            assert len(api.pods(decode)) == 4
            status = cli("pools", "status")
            assert any(line.split()[:3] == ["decode", "decode", "4"] for line in status.splitlines()), status
            cli("pools", "scale", "--decode", "1")
            until(lambda: api.deployments[decode].replicas == 1, 15, 0.1, "decode scaled to 1")
            gone = [p for p in api.pods(decode) if "deletionTimestamp" in p["metadata"]]
            assert len(gone) == 3
            assert not [c for c in api.calls if c[0] == "PATCH" and "/pods/" in c[1]]     # no pod written to
            assert api.deployments[deployments[PoolName.PREFILL]].replicas == 2        # untouched
            proc.send_signal(signal.SIGTERM)
            assert proc.wait(20) == 0
        finally:
            if proc.poll() is None:
                proc.kill()
                proc.wait()
            api.close()
    text = log.read_text()
    assert "Traceback" not in text, text


@pytest.mark.parametrize("value_set", ["default-values.yaml", "external-redis-values.yaml"])
def test_the_chart_runs_splitserve_controller_with_a_config_it_reads(value_set):
    from runtime.config import ControllerComponentConfig
    from runtime.config_file import config_from_dict
    from splitserve.cli import build_parser
    from tests.deploy.chart import pod_specs
    objs = manifests(value_set)
    pod = pod_specs(objs)["splitserve-planner"]
    (controller,) = [c for c in pod["containers"] if c["name"] == "controller"]
    assert build_parser().parse_args(controller["args"]).command == "controller"
    cfg = config_from_dict(ControllerComponentConfig, component_configs(objs)["controller"], "controller.json")
    deployments = sorted(n for n in by_kind(objs, "Deployment") if n.endswith(("-prefill", "-decode")))
    assert sorted(filter(None, (cfg.kubernetes.decode_deployment, cfg.kubernetes.prefill_deployment))) == deployments
    assert cfg.kubernetes.namespace == "serving" and cfg.controller.admin_host == "0.0.0.0"
    assert cfg.kubernetes.api_url is None             # in the cluster: the pod's ServiceAccount
    env = {e["name"] for e in controller["env"]}
    assert {"SPLITSERVE_ADMIN_TOKEN", "POD_IP"} <= env
