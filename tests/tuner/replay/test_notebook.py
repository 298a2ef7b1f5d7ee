"""notebooks/block_size_analysis.ipynb runs top to bottom on the embedded day (small),
the fidelity check against the live engine included."""

import json
import sys
from pathlib import Path

import nbformat
import pytest
from nbclient import NotebookClient

pytestmark = pytest.mark.slow

NOTEBOOK = Path(__file__).resolve().parents[3] / "notebooks" / "block_size_analysis.ipynb"


def python3_kernel(folder: Path) -> None:
    """A 'python3' kernel spec running this interpreter: found first through JUPYTER_PATH,
    so the notebook runs in the test's environment whatever kernels the user installed."""
    spec = folder / "kernels" / "python3"
    spec.mkdir(parents=True)
    argv = [sys.executable, "-m", "ipykernel_launcher", "-f", "{connection_file}"]
    kernel = {"argv": argv, "display_name": "Python 3", "language": "python"}
    (spec / "kernel.json").write_text(json.dumps(kernel))


def test_the_analysis_notebook_executes(tmp_path, monkeypatch):
    python3_kernel(tmp_path)
    monkeypatch.setenv("JUPYTER_PATH", str(tmp_path))
    notebook = nbformat.read(NOTEBOOK, as_version=4)
    client = NotebookClient(
        notebook,
        kernel_name="python3",
        timeout=600,  # per cell: a guard against a hung kernel, not a speed limit
        resources={"metadata": {"path": str(NOTEBOOK.parent)}},
    )
    client.execute()
    outputs = [o for cell in notebook.cells if cell.cell_type == "code" for o in cell.outputs]
    assert not [o for o in outputs if o.output_type == "error"]
    images = [o for o in outputs if "image/png" in o.get("data", {})]
    assert len(images) == 6  # histograms, padding curves, timeline, lengths, policies, fidelity
    text = "".join(o.get("text", "") for o in outputs if o.output_type == "stream")
    assert "embedded customer-service day (rate scale 0.02)" in text
    assert "adaptive_vs_oracle_objective:" in text
    assert "predicted" in text and "median |error| over block sizes: tok/s" in text
    tables = [o["data"]["text/plain"] for o in outputs if o.output_type == "execute_result"]
    assert any("oracle" in t and "static-16" in t for t in tables)
