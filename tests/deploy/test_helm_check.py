"""`make helm-check` (helm/check.py) fails, naming the problem, on each kind of mistake it exists to
catch: a broken template, values that break the schema, a manifest Kubernetes would refuse, unlinted
YAML, and an unpinned install in a Dockerfile. (That it passes on the real chart is `make helm-check`
itself, which `make test` runs.)"""

from __future__ import annotations

import shutil
import subprocess
import sys
from pathlib import Path

import pytest

from tests.deploy.chart import CHART, ROOT

CHECK = ROOT / "helm" / "check.py"


def run_check(chart: Path, *args: str) -> subprocess.CompletedProcess:
    return subprocess.run([sys.executable, str(CHECK), "--chart", str(chart), *args],
                          capture_output=True, text=True, timeout=120)


@pytest.fixture
def chart(tmp_path: Path) -> Path:
    dest = tmp_path / "splitserve"
    shutil.copytree(CHART, dest)
    return dest


def edit(path: Path, old: str, new: str) -> None:
    text = path.read_text()
    assert old in text, old
    path.write_text(text.replace(old, new, 1))


def default_only(chart: Path) -> list[str]:
    return ["--values", str(chart / "ci" / "default-values.yaml"), "--docker", ""]


def test_passes_on_the_chart_as_is(chart):
    r = run_check(chart, *default_only(chart))
    assert r.returncode == 0, r.stdout + r.stderr
    assert '"helm_check": "ok"' in r.stdout


def test_fails_on_a_broken_template(chart):
    edit(chart / "templates" / "frontend.yaml", "{{ $fe.replicas }}", "{{ $fe.replicas ")
    r = run_check(chart, *default_only(chart))
    assert r.returncode == 1
    assert "frontend.yaml" in r.stdout and "render" in r.stdout


def test_fails_on_values_that_break_the_schema(chart, tmp_path):
    bad = tmp_path / "bad-values.yaml"
    bad.write_text("images:\n  worker:\n    tag: latest\nengine:\n  devcie: cuda\n")
    r = run_check(chart, "--values", str(bad), "--docker", "")
    assert r.returncode == 1
    assert "/images/worker/tag" in r.stdout and "devcie" in r.stdout


def test_fails_on_an_inline_redis_password(chart, tmp_path):
    bad = tmp_path / "bad-values.yaml"
    bad.write_text("redis:\n  mode: external\n  external:\n    url: redis://:hunter2@redis:6379/0\n")
    r = run_check(chart, "--values", str(bad), "--docker", "")
    assert r.returncode == 1
    assert "/redis/external/url" in r.stdout


def test_fails_on_a_field_kubernetes_does_not_know(chart):
    edit(chart / "templates" / "workers.yaml", "          readinessProbe:", "          readynessProbe:")
    r = run_check(chart, *default_only(chart))
    assert r.returncode == 1
    assert "'readynessProbe' was unexpected" in r.stdout
    assert "Kubernetes 1.27.0" in r.stdout and "Kubernetes 1.37.0" in r.stdout


def test_fails_on_a_kind_without_a_schema(chart):
    (chart / "templates" / "extra.yaml").write_text("apiVersion: example.com/v1\nkind: Widget\n"
                                                    "metadata:\n  name: w\n")
    r = run_check(chart, *default_only(chart))
    assert r.returncode == 1
    assert "Widget" in r.stdout


def test_fails_on_yaml_lint(chart):
    edit(chart / "templates" / "redis.yaml", "    - name: redis\n      port: 6379", "    - name: redis   \n      port: 6379")
    r = run_check(chart, *default_only(chart))
    assert r.returncode == 1
    assert "trailing spaces" in r.stdout


def test_fails_on_an_unpinned_dockerfile(chart, tmp_path):
    docker = tmp_path / "docker"
    shutil.copytree(ROOT / "docker", docker)
    edit(docker / "control-plane.Dockerfile", "\nFROM python:3.12.12-slim-bookworm\n",
         "\nFROM python:3.12.12-slim-bookworm\nRUN pip install --no-cache-dir uvloop\n")
    r = run_check(chart, "--values", str(chart / "ci" / "default-values.yaml"), "--docker", str(docker))
    assert r.returncode == 1
    assert "DL3013" in r.stdout            # pin versions in pip


def test_the_dockerfiles_lint_clean():
    r = run_check(CHART, "--values", "--docker", str(ROOT / "docker"))
    assert r.returncode == 0, r.stdout + r.stderr
