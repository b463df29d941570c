"""Instructors run the course wider with papermill: every notebook takes a `world_size` parameter."""

import glob
import json
import os

import nbformat
import papermill
import pytest

NOTEBOOKS = sorted(glob.glob(os.path.join(os.path.dirname(__file__), "..", "..", "notebooks", "*.ipynb")))


@pytest.mark.parametrize("path", NOTEBOOKS, ids=os.path.basename)
def test_notebook_runs_at_another_world_size(path, tmp_path):
    with open(path) as f:
        cells = json.load(f)["cells"]
    parameters = [c for c in cells if "parameters" in c.get("metadata", {}).get("tags", [])]
    assert len(parameters) == 1 and "world_size =" in "".join(parameters[0]["source"])

    out = tmp_path / os.path.basename(path)
    papermill.execute_notebook(path, str(out), parameters={"world_size": 2}, cwd=os.path.dirname(path),
                               progress_bar=False, execution_timeout=240)
    executed = nbformat.read(out, as_version=4).cells
    injected = [c for c in executed if "injected-parameters" in c.metadata.get("tags", [])]
    assert "world_size = 2" in injected[0].source
    printed = "".join(o.get("text", "") for c in executed if c.cell_type == "code" for o in c.outputs)
    assert "[rank 1]" in printed or "2 ranks" in printed
    assert "[rank 2]" not in printed and "labkit: 4 ranks" not in printed
