"""The benchmarks in bench/: each shows its --help, imports only blocktune's public names, and
writes its result to a new dated file."""

import ast
import datetime
import importlib.util
import os
import re
import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]
BENCH = ROOT / "bench"
SCRIPTS = sorted(p for p in BENCH.glob("*.py") if p.name != "result_file.py")


def load_result_file():
    spec = importlib.util.spec_from_file_location("result_file", BENCH / "result_file.py")
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


def private_blocktune_names(path: Path) -> list[str]:
    """Names starting with one underscore that `path` imports from blocktune or reads off a
    blocktune module it imported."""
    tree = ast.parse(path.read_text(encoding="utf-8"))
    found, modules = [], set()
    for node in ast.walk(tree):
        if isinstance(node, ast.ImportFrom) and (node.module or "").startswith("blocktune"):
            found += [p for p in node.module.split(".") if p.startswith("_")]
            found += [a.name for a in node.names if a.name.startswith("_")]
            modules |= {a.asname or a.name for a in node.names}
        elif isinstance(node, ast.Import):
            for alias in node.names:
                if alias.name.startswith("blocktune"):
                    found += [p for p in alias.name.split(".") if p.startswith("_")]
                    modules.add(alias.asname or alias.name.split(".")[0])
    for node in ast.walk(tree):
        if (
            isinstance(node, ast.Attribute)
            and isinstance(node.value, ast.Name)
            and node.value.id in modules
            and node.attr.startswith("_")
            and not node.attr.startswith("__")
        ):
            found.append(f"{node.value.id}.{node.attr}")
    return found


def test_the_reader_sees_private_names(tmp_path):
    sample = tmp_path / "sample.py"
    sample.write_text(
        "from blocktune.tuner.cli._common import load\n"
        "from blocktune.tuner.fidelity.validation import _engine, serve\n"
        "from blocktune.tuner.measure import engine_measure\n"
        "engine_measure._start(1)\nengine_measure.measure(2)\n"
    )
    assert private_blocktune_names(sample) == ["_common", "_engine", "engine_measure._start"]


def test_no_benchmark_imports_a_private_blocktune_name():
    assert SCRIPTS
    assert {p.name: private_blocktune_names(p) for p in SCRIPTS} == {p.name: [] for p in SCRIPTS}


def test_a_result_file_is_dated_holds_the_command_and_load_and_is_never_overwritten(tmp_path):
    result_file = load_result_file()
    argv = ["--limit", "3", "--results", str(ROOT / "bench" / "results")]
    files = []
    for run in range(2):
        out = result_file.ResultFile(
            str(BENCH / "block_manager.py"), "A title.\n\nMore.", tmp_path, argv=argv
        )
        out.print(f"run {run}")
        files.append(out.write())
    today = out.started.date().isoformat()
    assert [f.name for f in files] == [f"{today}-block-manager.md", f"{today}-block-manager-2.md"]
    lines = files[1].read_text(encoding="utf-8").splitlines()
    assert lines[0].startswith(f"# A title ({today} ")
    assert lines[2] == "    python bench/block_manager.py --limit 3 --results bench/results"
    assert re.fullmatch(
        rf"Load average [\d. ]+ before, [\d. ]+ after; {os.cpu_count()} CPUs\.", lines[4]
    )
    assert lines[6] == "run 1"
    assert files[0].read_text(encoding="utf-8").splitlines()[6] == "run 0"


def test_a_taken_name_gets_the_next_free_suffix(tmp_path):
    result_file = load_result_file()
    day = datetime.date(2026, 1, 2)
    for name in ("2026-01-02-x.md", "2026-01-02-x-2.md"):
        (tmp_path / name).write_text("kept")
    assert result_file.new_path(tmp_path, "x", day) == tmp_path / "2026-01-02-x-3.md"
    assert result_file.new_path(tmp_path, "y", day) == tmp_path / "2026-01-02-y.md"


@pytest.mark.slow
@pytest.mark.parametrize("script", SCRIPTS, ids=lambda p: p.name)
def test_every_benchmark_shows_its_help(script):
    done = subprocess.run(
        [sys.executable, str(script.relative_to(ROOT)), "--help"],
        cwd=ROOT,
        capture_output=True,
        text=True,
        timeout=120,
        check=False,
    )
    assert done.returncode == 0, done.stderr
    assert done.stdout.startswith(f"usage: {script.name}")
    if script.name != "smollm2_hf_folder.py":  # a tool that writes a model folder, no result
        assert "--results RESULTS" in done.stdout


@pytest.mark.slow
def test_the_gpu_check_shows_its_help():
    done = subprocess.run(
        ["bash", "bench/gpu_check.sh", "--help"], cwd=ROOT, capture_output=True, text=True
    )
    assert done.returncode == 0, done.stderr
    assert "bash bench/gpu_check.sh [OUT_DIR] [AZURE_TRACE_CSV]" in done.stdout
