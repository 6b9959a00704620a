"""The quickstart notebook executes end to end."""

from pathlib import Path

import jupytext
import nbclient

NOTEBOOKS = Path(__file__).resolve().parents[1] / "notebooks"


def test_quickstart_runs(tmp_path):
    nb = jupytext.read(NOTEBOOKS / "quickstart.py")
    client = nbclient.NotebookClient(nb, timeout=600, kernel_name="python3",
                                     resources={"metadata": {"path": str(tmp_path)}})
    client.execute()
    outputs = [o for cell in nb.cells if cell.cell_type == "code" for o in cell.get("outputs", [])]
    assert not [o for o in outputs if o.get("output_type") == "error"]
    assert any("top-20% share" in o.get("text", "") for o in outputs)
