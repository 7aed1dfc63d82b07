"""What the rendered chart promises an operator, for every value set `make helm-check` renders:
hardened pods, secrets only by reference, pinned images, probes and shutdown that fit the worker
lifecycle, GPUs and NIXL settings where asked, and one version across chart, images and package."""

from __future__ import annotations

import base64
import re
import tomllib

import pytest
import yaml

from tests.deploy.chart import (CHART, ROOT, VALUE_SETS, by_kind, component_configs, containers, manifests,
                                pod_specs, render_values, values_of)

SECRET_ENV = {"SPLITSERVE_API_KEY", "SPLITSERVE_ADMIN_TOKEN", "SPLITSERVE_CLUSTER_TOKEN"}


@pytest.mark.parametrize("value_set", VALUE_SETS)
def test_pods_are_hardened(value_set):
    for name, pod in pod_specs(manifests(value_set)).items():
        assert pod["securityContext"]["runAsNonRoot"] is True, name
        assert pod["securityContext"]["seccompProfile"] == {"type": "RuntimeDefault"}, name
        assert pod.get("automountServiceAccountToken") is (name.endswith("-planner")), name
        for c in containers(pod):
            sc = c["securityContext"]
            assert sc["readOnlyRootFilesystem"] is True and sc["allowPrivilegeEscalation"] is False, (name, c["name"])
            assert sc["capabilities"]["drop"] == ["ALL"] and "add" not in sc["capabilities"], (name, c["name"])
            mounts = {m["mountPath"] for m in c.get("volumeMounts", [])}
            assert "/tmp" in mounts or c["name"] == "redis", (name, c["name"])   # a writable /tmp


@pytest.mark.parametrize("value_set", VALUE_SETS)
def test_images_are_pinned(value_set):
    for name, pod in pod_specs(manifests(value_set)).items():
        for c in containers(pod):
            image = c["image"]
            assert re.fullmatch(r"[\w./-]+(:[\w][\w.-]*|@sha256:[0-9a-f]{64})", image), image
            assert not image.endswith(":latest"), image


@pytest.mark.parametrize("value_set", VALUE_SETS)
def test_secrets_come_only_from_secret_references(value_set):
    objs = manifests(value_set)
    secret_values = [base64.b64decode(v).decode() for s in by_kind(objs, "Secret").values()
                     for v in s.get("data", {}).values()]
    elsewhere = yaml.safe_dump([o for o in objs if o["kind"] != "Secret"])
    for v in secret_values:
        assert v not in elsewhere
    for name, pod in pod_specs(objs).items():
        for c in containers(pod):
            for e in c.get("env", []):
                if e["name"] in SECRET_ENV:
                    assert "secretKeyRef" in e["valueFrom"], (name, e)
                if e["name"] == "SPLITSERVE_REDIS_URL" and "value" in e:
                    assert "@" not in e["value"], (name, "a Redis URL with credentials inline")
            assert not any("--api-key" in a or "--admin-token" in a for a in c.get("args", [])), name
    for component, cfg in component_configs(objs).items():
        assert "api_key" not in cfg and "admin_token" not in cfg.get("controller", {}), component
        assert "url" not in cfg["redis"], component


def test_the_generated_secret_has_its_three_keys_and_each_reaches_only_its_users():
    objs = manifests("default-values.yaml")
    (secret,) = by_kind(objs, "Secret").values()
    assert set(secret["data"]) == {"api-key", "admin-token", "cluster-token"}
    assert all(len(base64.b64decode(v)) >= 32 for v in secret["data"].values())
    users: dict[str, set[str]] = {}
    for name, pod in pod_specs(objs).items():
        for c in pod["containers"]:
            for e in c.get("env", []):
                ref = e.get("valueFrom", {}).get("secretKeyRef")
                if ref:
                    assert ref["name"] == secret["metadata"]["name"]
                    users.setdefault(e["name"], set()).add(f"{name}/{c['name']}")
    assert users == {
        "SPLITSERVE_API_KEY": {"splitserve-frontend/frontend"},
        "SPLITSERVE_ADMIN_TOKEN": {"splitserve-planner/planner", "splitserve-planner/controller"},
        # every caller of a worker (frontends, the controller, decode workers) and every worker
        "SPLITSERVE_CLUSTER_TOKEN": {"splitserve-frontend/frontend", "splitserve-planner/controller",
                                     "splitserve-prefill/worker", "splitserve-decode/worker"}}


@pytest.mark.parametrize("value_set", VALUE_SETS)
def test_worker_ingress_admits_only_the_releases_frontends_planner_and_peer_workers(value_set):
    objs = manifests(value_set)
    values = values_of(value_set)
    workers = values.get("workers", {})
    grpc_port, metrics_port = workers.get("grpcPort", 50061), workers.get("metricsPort", 9090)
    policy = by_kind(objs, "NetworkPolicy")["splitserve-workers"]
    spec = policy["spec"]
    assert spec["policyTypes"] == ["Ingress"]
    assert spec["podSelector"]["matchLabels"]["splitserve.io/worker"] == "true"
    for d in by_kind(objs, "Deployment").values():       # it selects every worker pod and no other
        labels = d["spec"]["template"]["metadata"]["labels"]
        selected = all(labels.get(k) == v for k, v in spec["podSelector"]["matchLabels"].items())
        assert selected == d["metadata"]["name"].endswith(("-prefill", "-decode")), d["metadata"]["name"]
    peers, callers = spec["ingress"][:2]
    assert "ports" not in peers and [p["podSelector"]["matchLabels"]["splitserve.io/worker"]
                                     for p in peers["from"]] == ["true"]          # NIXL: any port
    assert sorted(p["podSelector"]["matchLabels"]["app.kubernetes.io/component"] for p in callers["from"]) == \
        ["frontend", "planner"]
    assert all(p["podSelector"]["matchLabels"]["app.kubernetes.io/instance"] == "splitserve"
               for rule in (peers, callers) for p in rule["from"])
    assert sorted(p["port"] for p in callers["ports"]) == sorted([grpc_port, metrics_port])
    assert len(spec["ingress"]) == 2          # no metricsFrom in these value sets: nothing else gets in
    off = render_values({"workers": {"networkPolicy": {"enabled": False}}})
    assert "splitserve-workers" not in by_kind(off, "NetworkPolicy")
    scraped = render_values({"workers": {"networkPolicy": {"enabled": True, "metricsFrom": [
        {"namespaceSelector": {"matchLabels": {"kubernetes.io/metadata.name": "monitoring"}}}]}}})
    extra = by_kind(scraped, "NetworkPolicy")["splitserve-workers"]["spec"]["ingress"][2]
    assert extra["ports"] == [{"port": 9090, "protocol": "TCP"}]


def test_frontends_write_the_tiny_model_with_the_control_plane_image():
    objs = manifests("default-values.yaml")
    pods = pod_specs(objs)
    (init,) = pods["splitserve-frontend"]["initContainers"]
    assert init["image"].startswith("ghcr.io/splitserve/splitserve-control-plane:")
    assert init["command"][-1] == "--no-weights"
    for pool in ("prefill", "decode"):                      # workers need the weights: their own image
        (init,) = pods[f"splitserve-{pool}"]["initContainers"]
        assert init["image"].startswith("ghcr.io/splitserve/splitserve-worker:") and "--no-weights" not in init["command"]


@pytest.mark.parametrize("value_set", VALUE_SETS)
def test_every_planner_pod_container_has_a_readiness_probe(value_set):
    pod = pod_specs(manifests(value_set)).get("splitserve-planner")
    if pod is None:
        return
    probes = {c["name"]: c.get("readinessProbe") for c in pod["containers"]}
    assert probes["planner"]["httpGet"] == {"path": "/metrics", "port": "metrics"}
    assert probes["controller"]["tcpSocket"] == {"port": "admin"}


def test_an_existing_secret_replaces_the_generated_one():
    objs = manifests("external-redis-values.yaml")
    assert by_kind(objs, "Secret") == {}
    pods = pod_specs(objs)
    env = {e["name"]: e for c in pods["splitserve-frontend"]["containers"] for e in c["env"]}
    assert env["SPLITSERVE_API_KEY"]["valueFrom"]["secretKeyRef"]["name"] == "splitserve-keys"
    assert env["SPLITSERVE_REDIS_URL"]["valueFrom"]["secretKeyRef"] == {"name": "splitserve-redis", "key": "url"}


@pytest.mark.parametrize("value_set", VALUE_SETS)
def test_workers_probe_readiness_and_liveness_by_grpc_health(value_set):
    objs = manifests(value_set)
    for name, pod in pod_specs(objs).items():
        if name.endswith("-planner"):        # the SLA planner beside the pool controller (the admin API)
            c = {c["name"]: c for c in pod["containers"]}
            assert sorted(c) == ["controller", "planner"]
            assert c["controller"]["readinessProbe"]["tcpSocket"] == c["controller"]["livenessProbe"]["tcpSocket"] \
                == {"port": "admin"}
            assert c["planner"]["livenessProbe"]["tcpSocket"] == {"port": "metrics"}
            continue
        (c,) = pod["containers"]
        if name.endswith(("-prefill", "-decode")):
            port = c["ports"][0]["containerPort"]
            assert c["readinessProbe"]["grpc"] == {"port": port, "service": "splitserve.v1.Worker"}
            assert c["livenessProbe"]["grpc"] == {"port": port, "service": ""}
            assert c["startupProbe"]["grpc"]["service"] == "splitserve.v1.Worker"   # model loaded once
        elif name.endswith("-frontend"):
            assert c["readinessProbe"]["httpGet"] == {"path": "/health", "port": "http"}
            assert c["livenessProbe"]["tcpSocket"] == {"port": "http"}


@pytest.mark.parametrize("value_set", VALUE_SETS)
def test_the_grace_period_outlasts_the_drain(value_set):
    objs = manifests(value_set)
    configs = component_configs(objs)
    for name, pod in pod_specs(objs).items():
        component = name.rsplit("-", 1)[1]
        if component not in ("prefill", "decode", "frontend"):
            continue
        drain_s = configs[component]["drain_timeout_s"]
        assert pod["terminationGracePeriodSeconds"] >= drain_s + 15, name
        assert "preStop" in pod["containers"][0]["lifecycle"], name


def test_the_grace_period_follows_the_drain_timeout_value():
    objs = render_values({"decode": {"config": {"drain_timeout_s": 300}}})
    assert pod_specs(objs)["splitserve-decode"]["terminationGracePeriodSeconds"] == 330
    assert component_configs(objs)["decode"]["drain_timeout_s"] == 300


@pytest.mark.parametrize("value_set", VALUE_SETS)
def test_workers_advertise_their_pod_ip_under_their_pod_name(value_set):
    for name, pod in pod_specs(manifests(value_set)).items():
        if not name.endswith(("-prefill", "-decode")):
            continue
        (c,) = pod["containers"]
        args = c["args"]
        assert args[args.index("--advertise-host") + 1] == "$(POD_IP)"
        assert args[args.index("--worker-id") + 1] == "$(POD_NAME)"
        env = {e["name"]: e.get("valueFrom", {}).get("fieldRef", {}).get("fieldPath") for e in c["env"]}
        assert env["POD_IP"] == "status.podIP" and env["POD_NAME"] == "metadata.name"


def test_gpu_workers_get_gpus_nixl_settings_and_placement():
    objs = manifests("gpu-disagg-values.yaml")
    values = values_of("gpu-disagg-values.yaml")
    for pool in ("prefill", "decode"):
        pod = pod_specs(objs)[f"splitserve-{pool}"]
        (c,) = pod["containers"]
        assert c["resources"]["limits"]["nvidia.com/gpu"] == 1
        assert c["resources"]["limits"]["rdma/rdma_shared_device_a"] == 1
        env = {e["name"]: e.get("value") for e in c["env"]}
        assert {k: env[k] for k in values["nixl"]["env"]} == values["nixl"]["env"]
        assert pod["nodeSelector"] == values[pool]["nodeSelector"]
        assert pod["tolerations"] == values[pool]["tolerations"]
        assert {v["name"]: v for v in pod["volumes"]}["model"]["persistentVolumeClaim"] == {"claimName": "models",
                                                                                              "readOnly": True}
        assert component_configs(objs)[pool]["engine"]["model"] == "/models/Llama-3.1-8B-Instruct"
    # a pool's engine overrides win over the shared engine, false and all
    assert component_configs(objs)["prefill"]["engine"]["cuda_graphs"] is False
    assert component_configs(objs)["decode"]["engine"]["cuda_graphs"] is True


def test_without_a_prefill_pool_decode_workers_serve_aggregated():
    objs = manifests("external-redis-values.yaml")
    assert "splitserve-prefill" not in by_kind(objs, "Deployment")
    assert component_configs(objs)["decode"]["role"] == "aggregated"
    assert component_configs(manifests("default-values.yaml"))["decode"]["role"] == "decode"


@pytest.mark.parametrize("value_set", VALUE_SETS)
def test_planner_rbac_is_limited_to_scaling_the_worker_deployments(value_set):
    objs = manifests(value_set)
    roles, bindings = by_kind(objs, "Role"), by_kind(objs, "RoleBinding")
    assert not by_kind(objs, "ClusterRole") and not by_kind(objs, "ClusterRoleBinding")
    if not values_of(value_set).get("planner", {}).get("enabled", True):
        assert roles == {} and bindings == {} and by_kind(objs, "ServiceAccount") == {}
        return
    (role,) = roles.values()
    workers = sorted(n for n in by_kind(objs, "Deployment") if n.endswith(("-prefill", "-decode")))
    scale, pods = role["rules"]
    scale["resourceNames"].sort()
    assert [scale, pods] == [
        {"apiGroups": ["apps"], "resources": ["deployments/scale"], "resourceNames": workers, "verbs": ["get", "patch"]},
        {"apiGroups": [""], "resources": ["pods"], "verbs": ["list"]},           # it writes to no pod
    ]
    (binding,) = bindings.values()
    assert binding["subjects"] == [{"kind": "ServiceAccount", "name": "splitserve-planner", "namespace": "serving"}]
    assert pod_specs(objs)["splitserve-planner"]["serviceAccountName"] == "splitserve-planner"
    k8s = component_configs(objs)["controller"]["kubernetes"]
    assert sorted(v for k, v in k8s.items() if k.endswith("_deployment")) == workers


@pytest.mark.parametrize("value_set", VALUE_SETS)
def test_every_pool_has_a_disruption_budget(value_set):
    objs = manifests(value_set)
    pdbs = by_kind(objs, "PodDisruptionBudget")
    for name, d in by_kind(objs, "Deployment").items():
        if name.endswith(("-frontend", "-prefill", "-decode")):
            assert pdbs[name]["spec"]["selector"] == d["spec"]["selector"]


def test_monitoring_objects_follow_their_conventions():
    objs = manifests("gpu-disagg-values.yaml")
    (dash,) = [o for o in objs if o["kind"] == "ConfigMap" and o["metadata"]["name"].endswith("-dashboard")]
    assert dash["metadata"]["labels"]["grafana_dashboard"] == "1"
    assert dash["metadata"]["namespace"] == "monitoring"
    assert dash["metadata"]["annotations"] == {"grafana_folder": "Splitserve"}
    (sm,) = [o for o in objs if o["kind"] == "ServiceMonitor"]
    assert sm["metadata"]["labels"]["release"] == "kube-prometheus-stack"
    assert not [o for o in manifests("default-values.yaml") if o["kind"] == "ServiceMonitor"]


def test_one_version_for_chart_images_and_package():
    chart = yaml.safe_load((CHART / "Chart.yaml").read_text())
    values = yaml.safe_load((CHART / "values.yaml").read_text())
    package = tomllib.loads((ROOT / "pyproject.toml").read_text())["project"]["version"]
    assert chart["version"] == chart["appVersion"] == package
    assert values["images"]["controlPlane"]["tag"] == values["images"]["worker"]["tag"] == package
    for dockerfile in (ROOT / "docker").glob("*.Dockerfile"):
        assert f":{package} ." in dockerfile.read_text(), dockerfile.name    # the documented build tag


FREE_FORM = {"resources", "requests", "limits", "labels", "annotations", "nodeSelector", "podAnnotations",
             "rdmaResources", "env", "affinity"}


def test_every_value_is_documented():
    """Each key of values.yaml has a comment right above it, except inside Kubernetes-shaped maps."""
    lines = (CHART / "values.yaml").read_text().splitlines()
    parents: list[tuple[int, str]] = []
    for i, line in enumerate(lines):
        m = re.match(r"^( *)([A-Za-z_][\w./-]*):", line)
        if not m:
            continue
        indent, key = len(m.group(1)), m.group(2)
        parents = [(d, k) for d, k in parents if d < indent]
        if not any(k in FREE_FORM for _, k in parents):
            assert lines[i - 1].lstrip().startswith("#"), f"values.yaml:{i + 1}: {key} has no comment"
        parents.append((indent, key))
