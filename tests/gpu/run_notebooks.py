"""Run every notebook under NCCL, one rank per GPU, and say which backend really carried its collectives.

    python tests/gpu/run_notebooks.py [--world-size N] [notebooks/03_ring_allreduce.ipynb ...]

Each notebook runs through papermill with `-p world_size N`, N = min(GPUs, 8) unless given (one GPU: nothing
to run, since every notebook needs 2 or more ranks), in a kernel
started with this very interpreter (no installs, no kernelspec of the machine's). labkit's backend "auto"
then picks NCCL. What carried the collectives is counted, not taken from any label:

- NCCL operations from NCCL's own log: NCCL_DEBUG=INFO with NCCL_DEBUG_SUBSYS=COLL writes one line per
  collective, send and receive a rank issues (to files, via NCCL_DEBUG_FILE, not into the notebook);
- gloo operations from gloo itself: each gloo backend's sequence number (collectives and point-to-point),
  sampled on every rank by a small thread that a sitecustomize module starts in each rank process.
  Ranks are ended with SIGKILL, so the last quarter second of a rank's operations may go uncounted.

A notebook whose cells hand CPU tensors to collectives shows gloo operations under an NCCL pool: labkit's
NCCL group is "cpu:gloo,cuda:nccl". Prints a table (notebook, seconds, NCCL ops, gloo ops, carried by, result);
exit status 1 if a notebook failed. Without CUDA it says so and exits 0; `--cpu` runs the same under gloo,
to check this script itself on a machine without GPUs.
"""

from __future__ import annotations

import argparse
import importlib.util
import json
import os
import pathlib
import re
import sys
import tempfile
import textwrap
import time
from dataclasses import dataclass

from labkit.tables import text_table

ROOT = pathlib.Path(__file__).resolve().parents[2]
sys.path.insert(0, str(ROOT / "tests" / "notebooks"))
from solutions import with_solutions_as_code  # noqa: E402 - the folded reference solutions, as code cells

NCCL_LINE = re.compile(r"NCCL INFO (\w+): opCount")
KERNEL = "labkit-this-interpreter"

# Started in every Python process of the kernel's tree; acts only in rank processes (forked by labkit's fork
# server), where it samples each gloo backend's operation count into LABKIT_COUNT_DIR/<pid>.json.
SITECUSTOMIZE = textwrap.dedent('''
    import json, os, threading, time

    def _sample():
        import torch
        import torch.distributed as dist
        from labkit.groups import group_is_up
        path, last = os.path.join(os.environ["LABKIT_COUNT_DIR"], f"{os.getpid()}.json"), None
        while True:
            time.sleep(0.25)
            if os.environ.get("LABKIT_RANK_PROCESS") != "1" or not group_is_up():
                continue
            try:
                counts, seen = {}, set()
                for group in list(dist.distributed_c10d._world.pg_names):
                    for device in group._device_types:
                        backend = group._get_backend(torch.device(device.type))
                        if id(backend) not in seen:
                            seen.add(id(backend))
                            name = backend.name()
                            counts[name] = counts.get(name, 0) + backend._get_sequence_number_for_group()
            except Exception:
                continue
            if counts != last:
                with open(path + ".tmp", "w") as f:
                    json.dump(counts, f)
                os.replace(path + ".tmp", path)
                last = counts

    if os.environ.get("LABKIT_COUNT_DIR"):
        os.register_at_fork(after_in_child=lambda: threading.Thread(target=_sample, daemon=True).start())
''')


@dataclass
class Result:
    notebook: str
    seconds: float
    nccl_ops: int
    gloo_ops: int
    passed: bool
    error: str = ""

    @property
    def carried_by(self) -> str:
        if self.nccl_ops and self.gloo_ops:
            return "NCCL and gloo"
        return "NCCL" if self.nccl_ops else "gloo" if self.gloo_ops else "no collectives"


def gpu_count() -> int:
    import torch

    return torch.cuda.device_count() if torch.cuda.is_available() else 0


def this_interpreter_kernel(directory: pathlib.Path) -> None:
    """A kernelspec that starts `sys.executable`, found through JUPYTER_PATH."""
    spec = directory / "kernels" / KERNEL
    spec.mkdir(parents=True)
    (spec / "kernel.json").write_text(json.dumps({
        "argv": [sys.executable, "-m", "ipykernel_launcher", "-f", "{connection_file}"],
        "display_name": "labkit (this interpreter)", "language": "python"}))
    os.environ["JUPYTER_PATH"] = os.pathsep.join(filter(None, [str(directory), os.environ.get("JUPYTER_PATH")]))


def count_operations(directory: pathlib.Path) -> tuple[int, int]:
    """(NCCL operations in NCCL's logs, gloo operations in the ranks' samples) under `directory`."""
    nccl = sum(len(NCCL_LINE.findall(p.read_text(errors="replace"))) for p in directory.glob("nccl.*"))
    gloo = sum(json.loads(p.read_text()).get("gloo", 0) for p in directory.glob("*.json"))
    return nccl, gloo


def run_notebook(path: pathlib.Path, world_size: int, workdir: pathlib.Path) -> Result:
    """Execute one notebook with papermill, counting the operations of its ranks in `workdir`."""
    import papermill

    counts = workdir / path.stem
    counts.mkdir()
    os.environ.update(LABKIT_COUNT_DIR=str(counts), NCCL_DEBUG="INFO", NCCL_DEBUG_SUBSYS="COLL",
                      NCCL_DEBUG_FILE=str(counts / "nccl.%h.%p"))
    source = workdir / f"with_solutions_{path.name}"  # the reference solutions run too, as in test_papermill.py
    source.write_text(json.dumps(with_solutions_as_code(json.loads(path.read_text())), indent=1) + "\n")
    start, error = time.perf_counter(), ""
    try:
        papermill.execute_notebook(str(source), str(workdir / path.name), parameters={"world_size": world_size},
                                   kernel_name=KERNEL, cwd=str(path.parent), progress_bar=False,
                                   execution_timeout=600)
    except Exception as exc:  # noqa: BLE001 - one notebook's failure is a row of the table
        error = str(exc).strip().splitlines()[-1][:200] if str(exc).strip() else type(exc).__name__
    seconds = time.perf_counter() - start
    time.sleep(0.5)  # the last samples
    return Result(path.name, seconds, *count_operations(counts), passed=not error, error=error)


def print_table(results: list[Result], world_size: int, backend: str) -> None:
    print(f"\nEvery notebook at world_size={world_size} ({backend} pools):")
    header = ("notebook", "seconds", "NCCL ops", "gloo ops", "carried by", "result")
    rows = [(r.notebook, f"{r.seconds:.0f}", r.nccl_ops, r.gloo_ops, r.carried_by,
             "pass" if r.passed else f"FAIL: {r.error}") for r in results]
    print(text_table(header, rows, indent="  "))


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("notebooks", nargs="*", type=pathlib.Path)
    parser.add_argument("--world-size", type=int)
    parser.add_argument("--cpu", action="store_true", help="run under gloo without GPUs (checks this script)")
    args = parser.parse_args(argv)
    gpus = gpu_count()
    if not gpus and not args.cpu:
        print("No CUDA here (torch.cuda.is_available() is False): nothing to run under NCCL. `make notebooks` runs "
              "every notebook on the CPU.")
        return 0
    if gpus == 1 and not args.world_size:  # before the packages: nothing runs, so nothing is missing
        print("One GPU: NCCL needs one GPU per rank, and every notebook runs on 2 or more ranks, so under labkit's "
              "'auto' they would run over gloo, as CI runs them. Nothing to check here; tests/gpu covers one GPU.")
        return 0
    missing = [name for name in ("papermill", "ipykernel") if importlib.util.find_spec(name) is None]
    if missing:
        print(f"{' and '.join(missing)} missing in {sys.executable}: `{sys.executable} -m pip install papermill "
              "ipykernel` (or carry their wheels to a machine without a network), then run this again.")
        return 1
    world_size = args.world_size or (min(gpus, 8) if gpus else 2)
    if gpus and world_size > gpus:
        print(f"--world-size {world_size} > {gpus} GPUs: labkit would fall back to gloo.")
        return 1
    notebooks = [p.resolve() for p in args.notebooks] or sorted((ROOT / "notebooks").glob("*.ipynb"))
    with tempfile.TemporaryDirectory(prefix="labkit-gpu-notebooks-") as tmp:
        workdir = pathlib.Path(tmp)
        (workdir / "site").mkdir()
        (workdir / "site" / "sitecustomize.py").write_text(SITECUSTOMIZE)
        os.environ["PYTHONPATH"] = os.pathsep.join(filter(None, [str(workdir / "site"), os.environ.get("PYTHONPATH")]))
        this_interpreter_kernel(workdir / "jupyter")
        results = []
        for path in notebooks:
            results.append(run_notebook(path, world_size, workdir))
            print(f"{path.name}: {'pass' if results[-1].passed else 'FAIL'} in {results[-1].seconds:.0f} s", flush=True)
    print_table(results, world_size, "NCCL, one GPU per rank" if gpus else "gloo")
    return 0 if all(r.passed for r in results) else 1


if __name__ == "__main__":
    sys.exit(main())
