"""The import rules (tests/layering.py, stated in docs/architecture.md) hold for the whole tree, and
each check is shown to fail on a bad graph or a bad module."""

from __future__ import annotations

import re
import textwrap

from tests import layering as L


def test_no_cycle_between_files():
    assert L.cycles(L.import_graph()) == []


def test_no_import_runs_up_the_layers():
    assert [str(v) for v in L.layer_violations(L.import_graph())] == []


def test_every_project_module_has_a_layer():
    assert [m for m in L.project_modules() if L.layer(m) is None] == []


def test_control_plane_never_loads_torch_or_the_engine():
    mods = L.control_plane_modules()
    assert "frontend.main" in mods and "router.router" in mods and "splitserve.cli" in mods
    assert L.control_plane_leaks(mods) == []


def test_pure_modules_import_no_io_stack_or_device_library():
    mods = L.project_modules()
    pure = L.pure_modules()
    assert {"router.router", "planner.core", "kvstore.pools.block_pool", "engine.scheduler", "perf.profile",
            "sim.plan.simulator"} <= set(pure)
    assert [str(v) for v in L.impure_imports({m: mods[m] for m in pure})] == []
    assert L.control_plane_leaks(pure, forbidden=L.FORBIDDEN_IN_PURE) == []


def test_the_docs_state_the_same_layers():
    text = (L.ROOT / "docs" / "architecture.md").read_text()
    rows = dict(re.findall(r"^\| `(\w+)` \| .*? \| (.*?) \|$", text, re.M))
    stated = {layer: set(re.findall(r"`(\w+)`", below)) for layer, below in rows.items()}
    assert stated == L.MAY_IMPORT


# ---- each check fails on a bad change ---------------------------------------------------------

def test_a_cycle_is_found():
    graph = {"engine.a": {"engine.b"}, "engine.b": {"engine.c"}, "engine.c": {"engine.a"}, "engine.d": {"engine.a"}}
    assert L.cycles(graph) == [["engine.a", "engine.b", "engine.c"]]


def test_an_upward_import_is_found():
    graph = {"runtime.config": {"engine.engine"}, "frontend.main": {"router.router", "kvstore.hashing"},
             "router.router": {"frontend.generate"}, "decode_worker.main": {"prefill_worker.service"},
             "kvstore.hashing": {"runtime.config"}}
    found = {(v.importer, v.imported) for v in L.layer_violations(graph)}
    assert found == {("runtime.config", "engine.engine"), ("router.router", "frontend.generate"),
                     ("decode_worker.main", "prefill_worker.service"), ("kvstore.hashing", "runtime.config")}


def test_imports_are_read_from_the_source(tmp_path):
    pkg = tmp_path / "frontend"
    pkg.mkdir()
    (pkg / "__init__.py").write_text("")
    (pkg / "a.py").write_text("from . import b\nfrom .b import thing\n\ndef f():\n    import engine.model\n")
    (pkg / "b.py").write_text("thing = 1\n")
    eng = tmp_path / "engine"
    eng.mkdir()
    (eng / "__init__.py").write_text("")
    (eng / "model.py").write_text("")
    graph = L.import_graph(tmp_path, ("frontend", "engine"))
    assert graph["frontend.a"] == {"frontend.b", "engine.model"}     # an import inside a function counts
    assert [str(v) for v in L.layer_violations(graph)] == [
        "frontend.a imports engine.model: layer 'frontend' may not import layer 'engine'"]


def test_a_control_plane_module_that_loads_the_engine_is_blamed(tmp_path):
    (tmp_path / "cp_fine.py").write_text("import json\n")
    (tmp_path / "cp_bad.py").write_text(textwrap.dedent("""
        def later():
            pass
        import engine.scheduler
    """))
    report = L.control_plane_leaks(["cp_fine", "cp_bad", "cp_fine"], extra_path=tmp_path)
    assert len(report) == 1 and report[0][:2] == ["cp_bad", "leak"] and "engine.scheduler" in report[0][2]


def test_a_control_plane_module_that_loads_torch_is_blamed(tmp_path):
    (tmp_path / "cp_torch.py").write_text("import torch\n")
    report = L.control_plane_leaks(["json", "cp_torch"], extra_path=tmp_path, forbidden=("torch",))
    assert report == [["cp_torch", "leak", report[0][2]]] and "torch" in report[0][2]


def test_a_pure_module_that_imports_redis_even_lazily_is_blamed(tmp_path):
    (tmp_path / "fine.py").write_text("import math\n")
    (tmp_path / "lazy.py").write_text("def f():\n    import redis.asyncio as r\n    return r\n")
    (tmp_path / "eager.py").write_text("from torch import nn\n")
    found = L.impure_imports({m: tmp_path / f"{m}.py" for m in ("fine", "lazy", "eager")})
    assert [str(v) for v in found] == [
        "eager imports torch: a pure module imports no I/O stack or device library",
        "lazy imports redis: a pure module imports no I/O stack or device library"]
