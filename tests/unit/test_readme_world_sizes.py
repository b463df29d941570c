"""The README's table of each notebook's world size says what the notebooks' `parameters` cells set."""

import json
import re
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]
TABLE_TITLE = "### How many ranks, and on which GPUs"


def readme_world_sizes() -> dict[str, int]:
    """{notebook: world_size} from the rows of the README's table under TABLE_TITLE."""
    section = (ROOT / "README.md").read_text().split(TABLE_TITLE, 1)[1].split("\n#", 1)[0]
    return {name: int(size) for name, size in re.findall(r"^\| `(\w+)` \| (\d+) \|", section, flags=re.MULTILINE)}


def parameters_world_size(notebook: Path) -> int:
    """The `world_size = N` of the notebook's cell tagged `parameters`."""
    cells = json.loads(notebook.read_text())["cells"]
    source = next("".join(c["source"]) for c in cells if "parameters" in c.get("metadata", {}).get("tags", []))
    return int(re.search(r"^world_size = (\d+)", source, flags=re.MULTILINE).group(1))


def test_the_readme_lists_every_notebook_with_its_parameters_world_size():
    notebooks = {path.stem: parameters_world_size(path) for path in sorted((ROOT / "notebooks").glob("*.ipynb"))}
    assert readme_world_sizes() == notebooks
