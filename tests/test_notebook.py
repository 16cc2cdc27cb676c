import pytest

"""The example notebook runs top to bottom in a fresh kernel: a tiny run trained from a cell, its loss plotted inline."""

import nbformat
from nbclient import NotebookClient

from tests.helpers import ROOT

pytestmark = pytest.mark.launches  # its tests start training processes


def test_quickstart_notebook_trains_and_plots_the_loss_inline(tmp_path):
    notebook = nbformat.read(ROOT / "examples" / "quickstart.ipynb", as_version=4)
    NotebookClient(notebook, timeout=600, kernel_name="python3", resources={"metadata": {"path": str(tmp_path)}}).execute()
    outputs = [output for cell in notebook.cells if cell.cell_type == "code" for output in cell.outputs]
    assert not [output for output in outputs if output.output_type == "error"]
    assert any("image/png" in output.get("data", {}) for output in outputs), "no inline plot"
    assert (tmp_path / "outputs" / "quickstart" / "adapter_model.safetensors").is_file()
