"""The notebooks execute end to end."""

from pathlib import Path

import jupytext
import nbclient

NOTEBOOKS = Path(__file__).resolve().parents[1] / "notebooks"


def _execute(name: str, tmp_path: Path) -> str:
    """Run notebooks/`name`; no cell may fail. Returns the text of every output."""
    nb = jupytext.read(NOTEBOOKS / name)
    client = nbclient.NotebookClient(nb, timeout=600, kernel_name="python3",
                                     resources={"metadata": {"path": str(tmp_path)}})
    client.execute()
    outputs = [o for cell in nb.cells if cell.cell_type == "code" for o in cell.get("outputs", [])]
    assert not [o for o in outputs if o.get("output_type") == "error"]
    return "".join(o.get("text", "") for o in outputs)


def test_quickstart_runs(tmp_path):
    assert "top-20% share" in _execute("quickstart.py", tmp_path)


def test_traces_runs(tmp_path):
    text = _execute("traces.py", tmp_path)
    assert "| cache slots | static | lru | lfu | lfru | belady |" in text
    assert "saved" in text and "tok/s (pcie)" in text


def test_ablation_runs(tmp_path):
    text = _execute("ablation.py", tmp_path)
    assert "| B | miss | tok/s | predicted | binding |" in text
    assert "saved step_rows.png" in text and "saved miss_remedies.png" in text
