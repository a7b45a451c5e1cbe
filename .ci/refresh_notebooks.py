"""Re-execute tutorial notebooks and store the outputs nbval checks.

Usage: .venv/bin/python .ci/refresh_notebooks.py [notebooks/NN_name.ipynb ...]

Only cells marked to be checked (tag nbval-check-output or a
"# NBVAL_CHECK_OUTPUT" comment) keep their outputs in the repository; the rest
are cleared, and the saved widget state (``metadata.widgets``, which carries
plotly's ~5 MB JS bundle for every FigureWidget) is dropped, so the files stay
small (tests/test_notebook_files.py: under 200 KB each) and diffs show only
what nbval compares.
"""
from __future__ import annotations

import glob
import sys

import nbformat
from nbclient import NotebookClient


def checked(cell) -> bool:
    return "nbval-check-output" in cell.metadata.get("tags", []) or "# NBVAL_CHECK_OUTPUT" in cell.source


def refresh(path: str) -> None:
    nb = nbformat.read(path, as_version=4)
    NotebookClient(nb, timeout=900, kernel_name="python3", allow_errors=False).execute()
    for cell in nb.cells:
        if cell.cell_type == "code" and not checked(cell):
            cell.outputs = []
            cell.execution_count = None
    nb.metadata.pop("widgets", None)
    nbformat.write(nb, path)
    print("refreshed", path)


if __name__ == "__main__":
    for p in sys.argv[1:] or sorted(glob.glob("notebooks/[0-9]*.ipynb")):
        refresh(p)
