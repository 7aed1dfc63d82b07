"""A stand-in for the Kubernetes API server: the REST paths and objects the planner's connector uses,
served over HTTP on loopback so that the real `kubernetes` client talks to it.

    GET   /apis/apps/v1/namespaces/NS/deployments/NAME/scale        autoscaling/v1 Scale
    PATCH /apis/apps/v1/namespaces/NS/deployments/NAME/scale        {"spec": {"replicas": N}}
    GET   /api/v1/namespaces/NS/pods?labelSelector=k=v,...           PodList
    PATCH /api/v1/namespaces/NS/pods/NAME                            a merge patch of metadata

It plays the ReplicaSet and the kubelet too: a higher replica count creates pods (at once, or when
`release_pods()` is called with `hold_pods` set), a lower one marks terminating the pods a
ReplicaSet removes first — not ready before ready, then the lowest
controller.kubernetes.io/pod-deletion-cost, then the newest — and `finish_terminations()` removes
them (their preStop drain is over); `set_ready(pod, False)` is a failing readiness probe. Every request is recorded as (method, path, query) in
`calls`; anything else is a 404, a request without the bearer token a 401.
"""

from __future__ import annotations

import itertools
import json
import threading
from dataclasses import dataclass, field
from datetime import datetime, timezone
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from urllib.parse import parse_qs, urlsplit

TOKEN = "stand-in-token"
DELETION_COST = "controller.kubernetes.io/pod-deletion-cost"


def _now() -> str:
    return datetime.now(timezone.utc).strftime("%Y-%m-%dT%H:%M:%SZ")


@dataclass
class Deployment:
    name: str
    labels: dict[str, str]
    replicas: int = 0
    pods: list[dict] = field(default_factory=list)


class StandInApi:
    def __init__(self, namespace: str, deployments: dict[str, dict[str, str]], replicas: int = 1) -> None:
        self.namespace = namespace
        self.deployments = {n: Deployment(n, labels) for n, labels in deployments.items()}
        self.calls: list[tuple[str, str, str]] = []
        self.hold_pods = False
        self._serial = itertools.count()
        self._lock = threading.Lock()
        for d in self.deployments.values():
            d.replicas = replicas
            self._reconcile(d)
        api = self

        class Handler(BaseHTTPRequestHandler):
            def log_message(self, *args):          # quiet
                pass

            def do_GET(self):
                api._serve(self, "GET")

            def do_PATCH(self):
                api._serve(self, "PATCH")

            def do_POST(self):
                api._serve(self, "POST")

            def do_DELETE(self):
                api._serve(self, "DELETE")

            def do_PUT(self):
                api._serve(self, "PUT")

        self.server = ThreadingHTTPServer(("127.0.0.1", 0), Handler)
        self.url = f"http://127.0.0.1:{self.server.server_address[1]}"
        self._thread = threading.Thread(target=self.server.serve_forever, daemon=True)
        self._thread.start()

    def close(self) -> None:
        self.server.shutdown()
        self.server.server_close()

    def client(self, token: str = TOKEN):
        """A real `kubernetes` ApiClient pointed at this server."""
        from kubernetes import client
        cfg = client.Configuration()
        cfg.host = self.url
        cfg.api_key = {"authorization": token}
        cfg.api_key_prefix = {"authorization": "Bearer"}
        return client.ApiClient(cfg)

    # ---- what a test does as the cluster -------------------------------------------------
    def pods(self, deployment: str) -> list[dict]:
        with self._lock:
            return [dict(p) for p in self.deployments[deployment].pods]

    def release_pods(self) -> None:
        with self._lock:
            self.hold_pods = False
            for d in self.deployments.values():
                self._reconcile(d)

    def finish_terminations(self) -> None:
        with self._lock:
            for d in self.deployments.values():
                d.pods = [p for p in d.pods if "deletionTimestamp" not in p["metadata"]]

    def set_ready(self, pod_name: str, ready: bool) -> None:
        with self._lock:
            for d in self.deployments.values():
                for p in d.pods:
                    if p["metadata"]["name"] == pod_name:
                        p["status"]["containerStatuses"][0]["ready"] = ready
                        p["status"]["conditions"] = [{"type": "Ready", "status": str(ready)}]

    def crash_loop(self, pod_name: str) -> None:
        with self._lock:
            for d in self.deployments.values():
                for p in d.pods:
                    if p["metadata"]["name"] == pod_name:
                        cs = p["status"]["containerStatuses"][0]
                        cs.update(ready=False, restartCount=6,
                                  state={"waiting": {"reason": "CrashLoopBackOff", "message": "back-off 5m0s"}})
                        p["status"]["conditions"] = [{"type": "Ready", "status": "False"}]

    # ---- the REST side -------------------------------------------------------------------
    def _serve(self, h: BaseHTTPRequestHandler, method: str) -> None:
        url = urlsplit(h.path)
        self.calls.append((method, url.path, url.query))
        if h.headers.get("Authorization") != f"Bearer {TOKEN}":
            return self._reply(h, 401, self._status(401, "Unauthorized", "Unauthorized"))
        body = None
        if method in ("PATCH", "POST", "PUT"):
            body = json.loads(h.rfile.read(int(h.headers.get("Content-Length") or 0)) or b"null")
        parts = url.path.strip("/").split("/")
        with self._lock:
            code, obj = self._route(method, parts, parse_qs(url.query), body)
        self._reply(h, code, obj)

    def _route(self, method: str, parts: list[str], query: dict, body) -> tuple[int, dict]:
        ns = self.namespace
        if parts[:5] == ["apis", "apps", "v1", "namespaces", ns] and len(parts) == 8 and \
                parts[5] == "deployments" and parts[7] == "scale":
            d = self.deployments.get(parts[6])
            if d is None:
                return 404, self._status(404, "NotFound", f'deployments.apps "{parts[6]}" not found')
            if method == "PATCH":
                replicas = ((body or {}).get("spec") or {}).get("replicas")
                if not isinstance(replicas, int) or replicas < 0:
                    return 422, self._status(422, "Invalid", "spec.replicas: must be a non-negative integer")
                d.replicas = replicas
                self._reconcile(d)
            elif method != "GET":
                return 405, self._status(405, "MethodNotAllowed", method)
            return 200, self._scale(d)
        if parts[:4] == ["api", "v1", "namespaces", ns] and parts[4:5] == ["pods"]:
            if len(parts) == 5 and method == "GET":
                want = dict(kv.split("=", 1) for kv in query.get("labelSelector", [""])[0].split(",") if kv)
                items = [p for d in self.deployments.values() for p in d.pods
                         if all(p["metadata"]["labels"].get(k) == v for k, v in want.items())]
                return 200, {"apiVersion": "v1", "kind": "PodList", "metadata": {"resourceVersion": "1"},
                             "items": items}
            if len(parts) == 6 and method == "PATCH":
                pod = next((p for d in self.deployments.values() for p in d.pods
                            if p["metadata"]["name"] == parts[5]), None)
                if pod is None:
                    return 404, self._status(404, "NotFound", f'pods "{parts[5]}" not found')
                annotations = ((body or {}).get("metadata") or {}).get("annotations") or {}
                pod["metadata"].setdefault("annotations", {}).update(annotations)
                return 200, pod
        return 404, self._status(404, "NotFound", "the server could not find the requested resource")

    def _reconcile(self, d: Deployment) -> None:
        live = [p for p in d.pods if "deletionTimestamp" not in p["metadata"]]
        while len(live) < d.replicas and not self.hold_pods:
            pod = self._pod(d)
            d.pods.append(pod)
            live.append(pod)
        surplus = len(live) - d.replicas
        if surplus > 0:
            def rank(p):          # a ReplicaSet's order of removal (controller.ActivePodsWithRanks)
                ready = p["status"]["containerStatuses"][0]["ready"]
                return ready, int(p["metadata"].get("annotations", {}).get(DELETION_COST, "0")), -p["serial"]
            victims = sorted(live, key=rank)[:surplus]
            for p in victims:
                p["metadata"]["deletionTimestamp"] = _now()

    def _pod(self, d: Deployment) -> dict:
        n = next(self._serial)
        return {"apiVersion": "v1", "kind": "Pod", "serial": n,
                "metadata": {"name": f"{d.name}-7d9f8-{n:05d}", "namespace": self.namespace, "labels": dict(d.labels),
                             "creationTimestamp": _now(), "annotations": {}},
                "spec": {"containers": [{"name": "worker", "image": "splitserve-worker"}]},
                "status": {"phase": "Running", "startTime": _now(), "conditions": [{"type": "Ready", "status": "True"}],
                           "containerStatuses": [{"name": "worker", "image": "splitserve-worker", "imageID": "",
                                                  "ready": True, "restartCount": 0,
                                                  "state": {"running": {"startedAt": _now()}}}]}}

    def _scale(self, d: Deployment) -> dict:
        return {"apiVersion": "autoscaling/v1", "kind": "Scale",
                "metadata": {"name": d.name, "namespace": self.namespace},
                "spec": {"replicas": d.replicas},
                "status": {"replicas": len(d.pods), "selector": ",".join(f"{k}={v}" for k, v in d.labels.items())}}

    @staticmethod
    def _status(code: int, reason: str, message: str) -> dict:
        return {"apiVersion": "v1", "kind": "Status", "status": "Failure", "message": message, "reason": reason,
                "code": code}

    @staticmethod
    def _reply(h: BaseHTTPRequestHandler, code: int, obj: dict) -> None:
        data = json.dumps(obj).encode()
        h.send_response(code)
        h.send_header("Content-Type", "application/json")
        h.send_header("Content-Length", str(len(data)))
        h.end_headers()
        h.wfile.write(data)


def rbac_request(method: str, path: str, query: str) -> tuple[str, str, str, str]:
    """(apiGroup, resource, verb, resource name or "") that an API request needs, as the API server's
    RBAC authorizer derives it."""
    parts = path.strip("/").split("/")
    if parts[0] == "api":
        group, rest = "", parts[2:]
    else:
        group, rest = parts[1], parts[3:]
    assert rest[0] == "namespaces", path
    resource, name = rest[2], rest[3] if len(rest) > 3 else ""
    if len(rest) > 4:
        resource = f"{resource}/{rest[4]}"
    verb = {"GET": "get" if name else "list", "PATCH": "patch", "PUT": "update", "POST": "create",
            "DELETE": "delete"}[method]
    if verb == "get" and "watch=true" in query:
        verb = "watch"
    return group, resource, verb, name
