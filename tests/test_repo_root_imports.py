"""Python with the repository root on its path imports transformers' models: the root's
`kernels` folder (blocktune.kernels) steps aside for the Hugging Face package of that name,
installed or not."""

import importlib.metadata
import importlib.util
import os
import subprocess
import sys
from pathlib import Path

import pytest

pytestmark = pytest.mark.slow  # each test starts an interpreter that imports transformers

ROOT = Path(__file__).resolve().parents[1]
MODELS = "import transformers.modeling_utils; from transformers import LlamaForCausalLM"
"""Imports that reach transformers' `integrations.hub_kernels`, which imports `kernels`."""
SHOW_KERNELS = "import kernels; print(kernels.__file__)"


def python(*args: str, env: dict[str, str] | None = None) -> subprocess.CompletedProcess:
    """This interpreter run with `args` in the repository root."""
    return subprocess.run(
        [sys.executable, *args],
        cwd=ROOT,
        env={**os.environ, **(env or {})},
        capture_output=True,
        text=True,
        timeout=120,
        check=False,
    )


def kernels_installed() -> bool:
    try:
        importlib.metadata.distribution("kernels")
    except importlib.metadata.PackageNotFoundError:
        return False
    return True


def site_without_kernels(folder: Path) -> Path:
    """A site folder of links to every entry of transformers' site-packages but the Hugging
    Face `kernels` package and its metadata."""
    site = Path(importlib.util.find_spec("transformers").origin).parents[1]
    for entry in site.iterdir():
        if entry.name != "kernels" and not entry.name.startswith("kernels-"):
            (folder / entry.name).symlink_to(entry)
    return folder


@pytest.mark.skipif(not kernels_installed(), reason="no kernels package: checked without it below")
def test_transformers_models_import_in_the_root_and_kernels_is_the_installed_one():
    done = python("-c", f"{MODELS}; {SHOW_KERNELS}")
    assert done.returncode == 0, done.stderr
    installed = importlib.metadata.distribution("kernels").locate_file("kernels/__init__.py")
    assert Path(done.stdout.strip()) == Path(installed).resolve()


def test_transformers_models_import_in_the_root_without_the_kernels_package(tmp_path):
    site = site_without_kernels(tmp_path)
    code = f"import site; site.addsitedir({str(site)!r}); {MODELS}; {SHOW_KERNELS}"
    done = python("-S", "-c", code)
    assert done.returncode == 0, done.stderr
    # Nothing else is called kernels on that path: the root's folder stays what it is.
    assert Path(done.stdout.strip()) == ROOT / "kernels" / "__init__.py"


def test_a_bench_script_importing_transformers_runs_with_the_root_on_its_path():
    done = python("bench/smollm2_hf_folder.py", "--help", env={"PYTHONPATH": str(ROOT)})
    assert done.returncode == 0, done.stderr
    assert "usage: smollm2_hf_folder.py" in done.stdout


def test_blocktune_kernels_is_still_blocktunes():
    done = python("-c", "import blocktune.kernels as k; print(k.__file__, k.is_power_of_two(8))")
    assert done.returncode == 0, done.stderr
    assert done.stdout.split() == [str(ROOT / "kernels" / "__init__.py"), "True"]
