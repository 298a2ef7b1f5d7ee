"""The import rules of docs/architecture.md, read from the source (imports inside functions too)."""

import ast
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


def test_the_core_imports_no_other_tuner_package():
    tuner = ("blocktune.tuner",)
    found = {}
    for path in sources("tuner/core"):
        bad = [
            name
            for name in imported_modules(path)
            if name.startswith(tuner[0] + ".") and not name.startswith("blocktune.tuner.core")
        ]
        if bad:
            found[path.name] = bad
    assert found == {}


def test_tuner_has_one_shared_module_beside_its_packages():
    modules = sorted(p.name for p in (ROOT / "tuner").glob("*.py"))
    assert modules == ["__init__.py", "operations.py"]
    packages = sorted(p.parent.name for p in (ROOT / "tuner").glob("*/__init__.py"))
    assert packages == ["cli", "core", "replay", "serving", "sidecar", "sweep"]


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
