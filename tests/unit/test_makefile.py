"""The Makefile's `make serve` as a user meets it: it installs NIXL (so the README's first command
serves disaggregated) with pins equal to pyproject.toml's, and a secret given in ARGS is neither
echoed by make nor handed to the cluster's processes in make's variables (MAKEFLAGS, ARGS).

`make serve` runs here against a stand-in venv whose `splitserve` prints its environment: the
recipe itself, with the real make, without installing anything."""

from __future__ import annotations

import os
import re
import shutil
import subprocess
import tomllib
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[2]
SECRET = "sk-make-7d1c44e09b2a"


def no_deps_pins() -> dict[str, str]:
    text = (ROOT / "Makefile").read_text()
    line = re.search(r"^NO_DEPS_PINS\s*:=\s*(.+)$", text, re.M)
    assert line, "the Makefile names what it installs without dependencies in NO_DEPS_PINS"
    return dict(p.split("==") for p in line.group(1).split())


def pyproject_pins() -> dict[str, str]:
    project = tomllib.loads((ROOT / "pyproject.toml").read_text())["project"]
    reqs = [r for extra in project["optional-dependencies"].values() for r in extra]
    return {name: version for name, _, version in (r.partition("==") for r in reqs) if version}


def test_make_serve_installs_nixl_and_xgrammar_at_pyprojects_pins():
    pins = no_deps_pins()
    assert {"nixl", "nixl-cu13", "xgrammar"} <= set(pins)
    declared = pyproject_pins()
    for name, version in pins.items():
        assert declared.get(name) == version, (name, version, declared.get(name))
    recipe = (ROOT / "Makefile").read_text().split("$(STAMP): pyproject.toml", 1)[1].split("\n\n", 1)[0]
    assert "--no-deps $(NO_DEPS_PINS)" in recipe and "'.[serve]'" in recipe


@pytest.mark.skipif(shutil.which("make") is None, reason="no make here")
def test_a_secret_in_args_is_not_echoed_nor_passed_on_in_makes_variables(tmp_path):
    venv = tmp_path / "venv"
    (venv / "bin").mkdir(parents=True)
    fake = venv / "bin" / "splitserve"
    fake.write_text("#!/bin/sh\necho \"argv: $*\"\nenv | sed 's/^/env: /'\n")
    fake.chmod(0o755)
    (venv / ".installed").touch()
    os.utime(venv / ".installed", (2**31, 2**31))      # newer than pyproject.toml: nothing to install
    r = subprocess.run(["make", "--no-print-directory", "-f", str(ROOT / "Makefile"), "-C", str(ROOT),
                        "serve", f"VENV={venv}", f"ARGS=--api-key {SECRET} --http-port 8001"],
                       capture_output=True, text=True, timeout=60)
    assert r.returncode == 0, r.stderr
    lines = r.stdout.splitlines()
    argv = [line for line in lines if line.startswith("argv: ")]
    assert argv == [f"argv: serve --api-key {SECRET} --http-port 8001"], lines   # it reached serve, once
    echoed = [line for line in lines if SECRET in line and not line.startswith("argv: ")]
    assert echoed == [], echoed        # neither make's echo of the recipe nor serve's environment
    assert SECRET not in r.stderr
