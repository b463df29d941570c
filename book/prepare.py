"""Execute the course for the web and write the site's sources: `python book/prepare.py build/book`.

Each notebook of notebooks/ runs top to bottom under papermill at `--world-size` ranks (2: the CPU of a laptop or a
CI runner), as a new student's would: its reference solutions stay folded Markdown and never run, and its progress
goes to a file of the build's own (LABKIT_PROGRESS), so every "your turn" shows the grader's verdict on the
untouched stub and `show_progress` a student who has passed nothing. The executed notebooks are kept in
OUT/executed/ (the browser test counts their figures); their web editions (book/web_edition.py) and the landing
page (book/landing.py) go to OUT/src/, which `sphinx-build -c book OUT/src OUT/html` turns into the site.
notebooks/ is only read: its notebooks stay without outputs.
"""

from __future__ import annotations

import argparse
import datetime
import json
import os
import platform
import subprocess
import sys
import time
from concurrent.futures import ProcessPoolExecutor
from pathlib import Path

BOOK = Path(__file__).resolve().parent
ROOT = BOOK.parent
sys.path.insert(0, str(BOOK))

from landing import landing_page  # noqa: E402 - book/ is a folder of scripts, not a package
from web_edition import read, web_notebook  # noqa: E402

CELL_TIMEOUT_SECONDS = 240  # the slowest cell takes about 30 s on 2 busy cores


def commit() -> str:
    """The checkout's commit (short), marked -dirty when the working tree differs from it."""
    described = subprocess.run(["git", "describe", "--always", "--dirty", "--abbrev=9"], cwd=ROOT,
                               capture_output=True, text=True)
    return described.stdout.strip() or "unknown commit"


def where_it_ran(world_size: int) -> str:
    """"2 CPU ranks over gloo, torch 2.13.0, Linux x86_64 with 2 cores, commit abc123, 2026-12-07": what the ranks
    ran on, as labkit.run chose it (one GPU per rank and NCCL, else the CPU and gloo)."""
    import torch

    from labkit.launch.backend import choose_backend

    gpus = torch.cuda.device_count() if torch.cuda.is_available() else 0
    backend = choose_backend("auto", world_size, gpus).backend
    device = f"{torch.cuda.get_device_name(0)} " if backend == "nccl" else "CPU "
    today = datetime.date.today().isoformat()
    return (f"Executed for this site on {world_size} {device}ranks over {backend}: torch {torch.__version__}, "
            f"{platform.system()} {platform.machine()} with {os.cpu_count()} cores, commit {commit()}, {today}. "
            f"The timings shown are that machine's, and the outputs {world_size} ranks' where the text counts the "
            "notebook's own default (often 4): run it yourself for yours.")


def execute(notebook: Path, executed: Path, world_size: int) -> float:
    """Run one notebook under papermill into `executed`, in its own folder as the course runs; its seconds."""
    import papermill

    started = time.monotonic()
    papermill.execute_notebook(str(notebook), str(executed), parameters={"world_size": world_size},
                               cwd=str(notebook.parent), kernel_name="labkit", progress_bar=False,
                               execution_timeout=CELL_TIMEOUT_SECONDS)
    return time.monotonic() - started


def execute_all(notebooks: list[Path], executed: Path, world_size: int, workers: int) -> list[str]:
    """Execute the notebooks, `workers` at a time, each one's time printed; the names of those that failed."""
    failed = []
    with ProcessPoolExecutor(workers) as pool:
        runs = {n.stem: pool.submit(execute, n, executed / n.name, world_size) for n in notebooks}
        for name, run in runs.items():
            try:
                print(f"book: {name} executed in {run.result():.0f} s", flush=True)
            except Exception as error:  # noqa: BLE001 - papermill's (a cell's error, a timeout): said, then exit 1
                failed.append(name)
                print(f"book: {name} FAILED: {type(error).__name__}: {str(error).strip()[-2000:]}", flush=True)
    return failed


def write_sources(out: Path, notebooks: list[Path]) -> None:
    """The web editions of the executed notebooks, the landing page and plotly.js, in out/src/; where and at which
    commit they ran, as out/executed/provenance.json recorded it when they did."""
    import plotly

    provenance = json.loads((out / "executed" / "provenance.json").read_text())["where it ran"]
    source = out / "src"
    (source / "_static").mkdir(parents=True, exist_ok=True)
    for notebook in notebooks:
        web = web_notebook(read(out / "executed" / notebook.name), f"*{provenance}*",
                           {str((out / "progress.json").resolve()): "~/.labkit/progress.json"})
        (source / notebook.name).write_text(json.dumps(web, indent=1, ensure_ascii=False) + "\n", encoding="utf-8")
    readme = (ROOT / "README.md").read_text(encoding="utf-8")
    (source / "index.md").write_text(landing_page(readme, [n.stem for n in notebooks], provenance), encoding="utf-8")
    plotly_js = Path(plotly.__file__).parent / "package_data" / "plotly.min.js"
    (source / "_static" / "plotly.min.js").write_bytes(plotly_js.read_bytes())
    (source / "_static" / "labkit-book.css").write_bytes((BOOK / "labkit-book.css").read_bytes())


def _arguments(argv: list[str] | None) -> tuple[argparse.Namespace, list[Path]]:
    """The command line (module docstring), and the notebooks it names."""
    parser = argparse.ArgumentParser(prog="python book/prepare.py", description=__doc__.split("\n")[0])
    parser.add_argument("out", type=Path, help="the build folder (its executed/ and src/ are replaced)")
    parser.add_argument("--world-size", type=int, default=2, help="ranks per notebook (default 2)")
    parser.add_argument("--workers", type=int, default=2, help="notebooks executed at a time (default 2)")
    parser.add_argument("--only", nargs="+", metavar="NAME",
                        help="these notebooks only, e.g. 03_ring_allreduce (a partial site, for a quick look: its "
                        "links to the others are broken)")
    parser.add_argument("--sources-only", action="store_true",
                        help="execute nothing: the web editions again from OUT/executed/ (after a change to them)")
    arguments = parser.parse_args(argv)
    for option in ("world_size", "workers"):
        if getattr(arguments, option) < 1:
            parser.error(f"--{option.replace('_', '-')} must be 1 or more, not {getattr(arguments, option)}")
    notebooks = sorted((ROOT / "notebooks").glob("*.ipynb"))
    if arguments.only:
        unknown = sorted(set(arguments.only) - {n.stem for n in notebooks})
        if unknown:
            parser.error(f"no such notebook: {', '.join(unknown)} (see notebooks/)")
        notebooks = [n for n in notebooks if n.stem in arguments.only]
    missing = [n.name for n in notebooks if not (arguments.out / "executed" / n.name).is_file()]
    if arguments.sources_only and missing:
        parser.error(f"--sources-only: {arguments.out / 'executed'} lacks {', '.join(missing)}; build without it first")
    return arguments, notebooks


def main(argv: list[str] | None = None) -> int:
    """Execute the notebooks, then write the site's sources; 1 if a notebook failed, 2 for a wrong command line."""
    arguments, notebooks = _arguments(argv)
    executed = arguments.out / "executed"
    executed.mkdir(parents=True, exist_ok=True)
    os.environ["LABKIT_PROGRESS"] = str((arguments.out / "progress.json").resolve())  # never the builder's own
    Path(os.environ["LABKIT_PROGRESS"]).unlink(missing_ok=True)
    started = time.monotonic()
    if arguments.sources_only:
        write_sources(arguments.out, notebooks)
        return 0
    (executed / "provenance.json").write_text(json.dumps({"where it ran": where_it_ran(arguments.world_size)}) + "\n")
    failed = execute_all(notebooks, executed, arguments.world_size, arguments.workers)
    if failed:
        print(f"book: {len(failed)} notebook(s) failed ({', '.join(failed)}): the site is not built. Each one as it "
              f"ran, up to its error, is in {executed}/; `make lab` and Run All shows the same cell failing.")
        return 1
    print(f"book: {len(notebooks)} notebooks executed in {time.monotonic() - started:.0f} s", flush=True)
    write_sources(arguments.out, notebooks)
    return 0


if __name__ == "__main__":
    sys.exit(main())
