"""The import rules of the house, and the checks that enforce them (tests/unit/test_layering.py).

Layers, lowest first; a module may import from its own layer and from the layers listed as below
it, never from above. docs/architecture.md states the same table (a test keeps the two equal).

- `vocabulary`: plain data every process agrees on: the generated protobufs, the block-hash,
  KV-event and event-codec modules of kvstore, and the performance profiles (`perf`).
- `runtime`: the control plane's base (config, discovery, event streams, errors, metrics, the value
  types that cross the engine boundary).
- `kvstore`: the pure KV pools (`kvstore.pools`), the movers (`kvstore.movers`) and the tier manager.
- `engine`: model execution.
- `workers`: prefill_worker and decode_worker (neither imports the other).
- `router`, `planner`: decision cores over `runtime` and the vocabulary (the planner's live loop
  reads Redis; its core does not).
- `pools`: the pool controller, its connectors and the admin API.
- `frontend`: the client edge, over the router.
- `sim`: the virtual-clock simulators, over the real scheduler, router and planner core.
- `cli`: the `splitserve` package, which may import everything.

The control plane (frontend, router, runtime, planner, pools, kvstore's host-side modules, proto and
the CLI's non-engine modules) never imports torch or `engine`: it runs in an image without CUDA.
`control_plane_leaks` checks that by importing each such module in a fresh interpreter.

Pure modules (PURE: the router, the planner core, the pure KV pools, the scheduler, the profiles
and the simulators) import none of grpc, redis, ray, nixl, torch or kubernetes, not even lazily
inside a function: `impure_imports` reads their import statements, and `control_plane_leaks` with
that list checks what importing them brings in.

Everything here reads source files (ast) or runs a child interpreter; nothing imports the project.
"""

from __future__ import annotations

import ast
import json
import os
import subprocess
import sys
from dataclasses import dataclass
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
PACKAGES = ("proto", "perf", "runtime", "kvstore", "engine", "prefill_worker", "decode_worker", "router",
            "frontend", "planner", "pools", "sim", "splitserve")

# module prefix -> layer; the longest matching prefix wins
LAYER_OF = {
    "proto": "vocabulary",
    "kvstore.hashing": "vocabulary",
    "kvstore.events": "vocabulary",
    "kvstore.event_codec": "vocabulary",
    "perf": "vocabulary",
    "runtime": "runtime",
    "kvstore": "kvstore",
    "engine": "engine",
    "prefill_worker": "workers",
    "decode_worker": "workers",
    "router": "router",
    "planner": "planner",
    "pools": "pools",
    "frontend": "frontend",
    "sim": "sim",
    "splitserve": "cli",
}

# layer -> the layers it may import from (besides itself)
MAY_IMPORT = {
    "vocabulary": set(),
    "runtime": {"vocabulary"},
    "kvstore": {"vocabulary", "runtime"},
    "engine": {"vocabulary", "runtime", "kvstore"},
    "workers": {"vocabulary", "runtime", "kvstore", "engine"},
    "router": {"vocabulary", "runtime"},
    "planner": {"vocabulary", "runtime"},
    "pools": {"vocabulary", "runtime"},
    "frontend": {"vocabulary", "runtime", "router"},
    "sim": {"vocabulary", "runtime", "kvstore", "engine", "router", "planner"},
    "cli": {"vocabulary", "runtime", "kvstore", "engine", "workers", "router", "planner", "pools", "frontend",
            "sim"},
}

# Within the workers layer, these packages must not import each other.
SIBLINGS_APART = (("prefill_worker", "decode_worker"),)

# Control-plane modules may not bring these into a process.
FORBIDDEN_IN_CONTROL_PLANE = ("torch", "engine", "prefill_worker", "decode_worker")

# Packages of the control plane, and the modules inside them that are device-side by design.
CONTROL_PLANE = ("proto", "perf", "runtime", "kvstore", "router", "planner", "pools", "frontend", "splitserve")
DEVICE_SIDE = ("splitserve.tiny_model",)    # writes seeded weights with torch (imports it lazily)

# Pure logic: no I/O stack and no device, so it is unit-tested on the CPU in milliseconds. A prefix
# names a package or one module; the planner's live loop (planner.live) is I/O and not listed.
PURE = ("perf", "router", "planner.config", "planner.core", "planner.correction", "planner.decision",
        "planner.predictors", "planner.sizing", "kvstore.pools", "kvstore.hashing", "kvstore.events",
        "kvstore.event_codec", "engine.scheduler", "engine.sched", "engine.plan", "engine.request", "pools.book",
        "sim")
FORBIDDEN_IN_PURE = ("grpc", "redis", "ray", "nixl", "torch", "kubernetes")


@dataclass(frozen=True, slots=True)
class Violation:
    importer: str
    imported: str
    why: str

    def __str__(self) -> str:
        return f"{self.importer} imports {self.imported}: {self.why}"


def module_name(path: Path, root: Path = ROOT) -> str:
    parts = path.relative_to(root).with_suffix("").parts
    return ".".join(parts[:-1] if parts[-1] == "__init__" else parts)


def project_modules(root: Path = ROOT, packages=PACKAGES) -> dict[str, Path]:
    out = {}
    for pkg in packages:
        for path in sorted((root / pkg).rglob("*.py")):
            out[module_name(path, root)] = path
    return out


def imports_of(path: Path, module: str) -> set[str]:
    """Every module named by an import statement in the file (top level or inside functions),
    relative imports resolved against `module`."""
    tree = ast.parse(path.read_text(), str(path))
    package = module if path.name == "__init__.py" else module.rpartition(".")[0]
    out: set[str] = set()
    for node in ast.walk(tree):
        if isinstance(node, ast.Import):
            out.update(a.name for a in node.names)
        elif isinstance(node, ast.ImportFrom):
            if node.level:
                base = package.split(".")
                base = base[:len(base) - node.level + 1]
                prefix = ".".join(base + ([node.module] if node.module else []))
            else:
                prefix = node.module or ""
            out.add(prefix)
            out.update(f"{prefix}.{a.name}" for a in node.names if a.name != "*")
    return out


def import_graph(root: Path = ROOT, packages=PACKAGES) -> dict[str, set[str]]:
    """module -> the project modules it imports (names resolved to modules that exist)."""
    mods = project_modules(root, packages)
    graph: dict[str, set[str]] = {}
    for mod, path in mods.items():
        targets = set()
        for name in imports_of(path, mod):
            while name and name not in mods:      # `from pkg import name`: name may be an attribute
                name = name.rpartition(".")[0]
            if name and name != mod and not mod.startswith(name + "."):   # a package's own __init__
                targets.add(name)
        graph[mod] = targets
    return graph


def layer(module: str) -> str | None:
    best = None
    for prefix, name in LAYER_OF.items():
        if (module == prefix or module.startswith(prefix + ".")) and (best is None or len(prefix) > len(best[0])):
            best = (prefix, name)
    return best[1] if best else None


def layer_violations(graph: dict[str, set[str]]) -> list[Violation]:
    out = []
    for importer, targets in sorted(graph.items()):
        src = layer(importer)
        for imported in sorted(targets):
            dst = layer(imported)
            if src is None or dst is None or src == dst:
                if src == dst == "workers" and _apart(importer, imported):
                    out.append(Violation(importer, imported, "one worker never imports the other"))
                continue
            if dst not in MAY_IMPORT[src]:
                out.append(Violation(importer, imported, f"layer {src!r} may not import layer {dst!r}"))
    return out


def _apart(a: str, b: str) -> bool:
    top_a, top_b = a.split(".")[0], b.split(".")[0]
    return any({top_a, top_b} == set(pair) for pair in SIBLINGS_APART)


def cycles(graph: dict[str, set[str]]) -> list[list[str]]:
    """Strongly connected components of more than one module (Tarjan), each sorted."""
    index: dict[str, int] = {}
    low: dict[str, int] = {}
    stack: list[str] = []
    on_stack: set[str] = set()
    found: list[list[str]] = []
    counter = 0

    def visit(v: str) -> None:
        nonlocal counter
        index[v] = low[v] = counter
        counter += 1
        stack.append(v)
        on_stack.add(v)
        for w in graph.get(v, ()):
            if w not in index:
                visit(w)
                low[v] = min(low[v], low[w])
            elif w in on_stack:
                low[v] = min(low[v], index[w])
        if low[v] == index[v]:
            comp = []
            while True:
                w = stack.pop()
                on_stack.discard(w)
                comp.append(w)
                if w == v:
                    break
            if len(comp) > 1:
                found.append(sorted(comp))

    for v in sorted(graph):
        if v not in index:
            visit(v)
    return sorted(found)


def pure_modules(root: Path = ROOT) -> list[str]:
    return [m for m in project_modules(root) if any(m == p or m.startswith(p + ".") for p in PURE)]


def impure_imports(modules: dict[str, Path], forbidden=FORBIDDEN_IN_PURE) -> list[Violation]:
    """One violation per (module, forbidden package) that an import statement names, at the top
    level or inside a function. `modules`: module name -> its file."""
    found = {(mod, name.split(".")[0]) for mod, path in modules.items() for name in imports_of(path, mod)
             if name.split(".")[0] in forbidden}
    return [Violation(mod, pkg, "a pure module imports no I/O stack or device library") for mod, pkg in sorted(found)]


def control_plane_modules(root: Path = ROOT) -> list[str]:
    return [m for m in project_modules(root, CONTROL_PLANE)
            if not m.endswith(".__main__") and not any(m == d or m.startswith(d + ".") for d in DEVICE_SIDE)]


_PROBE = r"""
import importlib, json, sys
forbidden = tuple(sys.argv[1].split(","))
seen = lambda: sorted({m for m in sys.modules for f in forbidden if m == f or m.startswith(f + ".")})
report = []
for mod in sys.argv[2:]:
    try:
        importlib.import_module(mod)
    except Exception as e:
        report.append([mod, "error", f"{type(e).__name__}: {e}"])
        continue
    leaked = seen()
    if leaked:
        report.append([mod, "leak", leaked])
        break          # everything after would be blamed for what this one loaded
print(json.dumps(report))
"""


def control_plane_leaks(modules: list[str], root: Path = ROOT,
                        forbidden=FORBIDDEN_IN_CONTROL_PLANE, extra_path: Path | None = None) -> list:
    """Import `modules` one after another in a fresh interpreter; after each, look in sys.modules
    for a forbidden one. Returns [module, "leak", [what]] for the first module that brought one in
    (and [module, "error", message] for modules that failed to import)."""
    env_path = [str(root)] + ([str(extra_path)] if extra_path else [])
    proc = subprocess.run([sys.executable, "-c", _PROBE, ",".join(forbidden), *modules],
                          capture_output=True, text=True, cwd=root, timeout=300,
                          env=dict(os.environ, PYTHONPATH=":".join(env_path)))
    if proc.returncode != 0:
        raise RuntimeError(f"the probe interpreter failed:\n{proc.stderr[-3000:]}")
    return json.loads(proc.stdout)
