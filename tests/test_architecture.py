"""The import rules of docs/architecture.md, read from the source (imports inside functions too)."""

import ast
import os
import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]
HTTP_FRAMEWORKS = ("fastapi", "uvicorn", "starlette")
DASK = ("dask", "distributed")
HEAVY = ("torch", "pandas", "fastapi", "uvicorn", "dask", "distributed")


def imported_modules(path: Path) -> set[str]:
    """Every absolute module name a file imports, at any depth of its code."""
    names = set()
    for node in ast.walk(ast.parse(path.read_text(encoding="utf-8"))):
        if isinstance(node, ast.Import):
            names.update(alias.name for alias in node.names)
        elif isinstance(node, ast.ImportFrom) and node.level == 0 and node.module:
            names.add(node.module)
            names.update(f"{node.module}.{alias.name}" for alias in node.names)
    return names


def sources(folder: str) -> list[Path]:
    return sorted((ROOT / folder).rglob("*.py"))


def offenders(files: list[Path], forbidden: tuple[str, ...]) -> dict[str, list[str]]:
    found = {}
    for path in files:
        bad = sorted(
            name
            for name in imported_modules(path)
            if any(name == f or name.startswith(f + ".") for f in forbidden)
        )
        if bad:
            found[str(path.relative_to(ROOT))] = bad
    return found


def test_the_rule_reader_sees_imports_inside_functions(tmp_path):
    sample = tmp_path / "sample.py"
    sample.write_text("def f():\n    from blocktune.tuner.core import policy\n    import fastapi\n")
    assert {"blocktune.tuner.core", "blocktune.tuner.core.policy", "fastapi"} <= imported_modules(
        sample
    )


def test_runtime_and_kernels_never_import_tuner_or_traces():
    files = sources("runtime") + sources("kernels")
    assert files
    assert offenders(files, ("blocktune.tuner", "blocktune.traces")) == {}


def test_kernels_import_nothing_of_the_runtime():
    assert offenders(sources("kernels"), ("blocktune.runtime",)) == {}


def test_only_the_serving_layer_imports_http_frameworks():
    package = sources("tuner") + sources("runtime") + sources("kernels") + sources("traces")
    serving = set(sources("tuner/serving"))
    assert offenders([p for p in package if p not in serving], HTTP_FRAMEWORKS) == {}


def test_only_the_sweep_package_imports_dask():
    package = sources("tuner") + sources("runtime") + sources("kernels") + sources("traces")
    sweep = set(sources("tuner/sweep"))
    assert sweep
    assert offenders([p for p in package if p not in sweep], DASK) == {}


# The tuner's floors, lowest first: a package may import its own package and any lower floor.
TUNER_FLOORS = (
    ("config", "operations"),
    ("sim", "measure"),
    ("core",),
    ("replay", "fidelity", "sidecar"),
    ("sweep", "serving"),
    ("demo",),
    ("cli",),
)
FLOOR = {package: rank for rank, floor in enumerate(TUNER_FLOORS) for package in floor}


def tuner_package(module: str) -> str | None:
    parts = module.split(".")
    return parts[2] if len(parts) > 2 and parts[:2] == ["blocktune", "tuner"] else None


def test_every_tuner_package_has_a_floor():
    on_disk = {p.parent.name for p in (ROOT / "tuner").glob("*/__init__.py")}
    on_disk |= {p.stem for p in (ROOT / "tuner").glob("*.py") if p.stem != "__init__"}
    assert on_disk == set(FLOOR)


def test_no_tuner_import_runs_against_the_floors():
    found = {}
    for path in sources("tuner"):
        own = path.relative_to(ROOT / "tuner").parts[0].removesuffix(".py")
        for name in imported_modules(path):
            other = tuner_package(name)
            if other is None or other == own or other not in FLOOR:
                continue
            if FLOOR[other] >= FLOOR[own]:
                found.setdefault(str(path.relative_to(ROOT)), []).append(name)
    assert found == {}


def module_name(path: Path) -> str:
    relative = path.relative_to(ROOT).with_suffix("")
    parts = [p for p in relative.parts if p != "__init__"]
    return ".".join(("blocktune", *parts))


def import_graph() -> dict[str, set[str]]:
    """blocktune module -> the blocktune modules it imports (at any depth of its code)."""
    files = sources("tuner") + sources("runtime") + sources("kernels") + sources("traces")
    modules = {module_name(p): p for p in files}
    graph = {}
    for name, path in modules.items():
        graph[name] = {m for m in imported_modules(path) if m in modules and m != name}
    return graph


def test_the_cycle_finder_sees_a_circle():
    assert find_cycle({"a": {"b"}, "b": {"c"}, "c": {"a"}}) == ["a", "b", "c", "a"]
    assert find_cycle({"a": {"b"}, "b": set()}) is None


def find_cycle(graph: dict[str, set[str]]) -> list[str] | None:
    """One import circle of the graph as a path that ends where it starts, or None."""
    state: dict[str, int] = {}
    stack: list[str] = []

    def visit(node: str) -> list[str] | None:
        state[node] = 1
        stack.append(node)
        for nxt in sorted(graph.get(node, ())):
            if state.get(nxt) == 1:
                return stack[stack.index(nxt) :] + [nxt]
            if nxt not in state and (cycle := visit(nxt)):
                return cycle
        stack.pop()
        state[node] = 2
        return None

    for node in sorted(graph):
        if node not in state and (cycle := visit(node)):
            return cycle
    return None


def test_no_import_circle():
    assert find_cycle(import_graph()) is None


def test_tuner_has_one_shared_module_beside_its_packages():
    modules = sorted(p.name for p in (ROOT / "tuner").glob("*.py"))
    assert modules == ["__init__.py", "operations.py"]
    packages = sorted(p.parent.name for p in (ROOT / "tuner").glob("*/__init__.py"))
    assert packages == sorted(
        ["cli", "config", "core", "demo", "fidelity", "measure", "replay", "serving"]
        + ["sidecar", "sim", "sweep"]
    )


def loaded_after(statement: str) -> set[str]:
    code = (
        f"import sys\n{statement}\n"
        "print(' '.join(sorted({m.split('.')[0] for m in sys.modules})))"
    )
    done = subprocess.run(
        [sys.executable, "-c", code], capture_output=True, text=True, timeout=120, check=True
    )
    return set(done.stdout.split())


def test_the_sidecar_library_loads_no_http_framework():
    loaded = loaded_after("import blocktune.tuner.sidecar.sidecar")
    assert "blocktune" in loaded
    assert loaded.isdisjoint(HTTP_FRAMEWORKS)


@pytest.mark.parametrize(
    "statement", ["from blocktune.tuner.cli import build_parser; build_parser()"]
)
def test_building_the_command_line_loads_nothing_heavy(statement):
    loaded = loaded_after(statement)
    assert "blocktune" in loaded
    assert loaded.isdisjoint(HEAVY)


def test_pyproject_lists_every_package_folder():
    import tomllib

    config = tomllib.loads((ROOT / "pyproject.toml").read_text(encoding="utf-8"))["tool"]
    mapping = config["setuptools"]["package-dir"]
    listed = set(config["setuptools"]["packages"])
    on_disk = set()
    for package, folder in mapping.items():
        for init in (ROOT / folder).rglob("__init__.py"):
            relative = init.parent.relative_to(ROOT / folder)
            if package == "blocktune" and relative.parts:
                continue  # the other mapped folders own their sub-trees
            on_disk.add(".".join((package, *relative.parts)))
    assert on_disk == listed
    assert config["setuptools"]["package-data"]["blocktune.policies"] == ["*.yaml"]


@pytest.mark.parametrize("flag", ["-c", "-m"])
def test_started_in_the_package_folder_its_subpackages_are_not_top_level(tmp_path, flag):
    """Python started in the repository (the package's own folder: `python -c`, `python -m`)
    has that folder on its path; once blocktune is imported, `kernels` is no longer this
    package's subpackage but the Hugging Face package of that name (which transformers
    imports), or nothing."""
    probe = (
        "import importlib.util\n"
        "import blocktune\n"
        "spec = importlib.util.find_spec('kernels')\n"
        "print(spec.origin if spec else None)\n"
    )
    (tmp_path / "probe.py").write_text(probe, encoding="utf-8")
    command = [sys.executable, "-c", probe] if flag == "-c" else [sys.executable, "-m", "probe"]
    env = {**os.environ, "PYTHONPATH": str(tmp_path)}
    done = subprocess.run(command, cwd=ROOT, env=env, capture_output=True, text=True, check=True)
    origin = done.stdout.strip()
    assert origin == "None" or Path(origin).resolve().parent != ROOT / "kernels", origin
