"""The chart as the deploy tests see it: rendered value sets (cached), and walks over its manifests.

Rendering goes through helm/check.py (helm-python-sdk, the real Helm SDK, offline), so the tests
read exactly what `make helm-check` validates.
"""

from __future__ import annotations

import functools
import json
import sys
from pathlib import Path

import yaml

ROOT = Path(__file__).resolve().parents[2]
CHART = ROOT / "helm" / "splitserve"
sys.path.insert(0, str(ROOT / "helm"))
import check  # noqa: E402  (helm/check.py)

VALUE_SETS = tuple(f.name for f in check.value_sets(CHART))


def values_of(value_set: str) -> dict:
    return yaml.safe_load((CHART / "ci" / value_set).read_text()) or {}


@functools.cache
def _render(value_set: str) -> str:
    docs = check.render(CHART, values_of(value_set))
    return json.dumps([d for path in sorted(docs) for d in docs[path]])


def manifests(value_set: str) -> list[dict]:
    """Every object the value set renders (a fresh copy: tests may change it)."""
    return json.loads(_render(value_set))


def render_values(values: dict) -> list[dict]:
    return [d for docs in check.render(CHART, values).values() for d in docs]


def by_kind(objs: list[dict], kind: str) -> dict[str, dict]:
    return {o["metadata"]["name"]: o for o in objs if o["kind"] == kind}


def pod_specs(objs: list[dict]) -> dict[str, dict]:
    return {name: d["spec"]["template"]["spec"] for name, d in by_kind(objs, "Deployment").items()}


def containers(pod: dict) -> list[dict]:
    return pod.get("initContainers", []) + pod["containers"]


def component_configs(objs: list[dict]) -> dict[str, dict]:
    """{component: its --config JSON} from the chart's ConfigMap."""
    (cm,) = [o for o in objs if o["kind"] == "ConfigMap" and o["metadata"]["name"].endswith("-config")]
    return {key.removesuffix(".json"): json.loads(text) for key, text in cm["data"].items()}
