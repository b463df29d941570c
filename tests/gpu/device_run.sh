#!/usr/bin/env bash
# One run on a CUDA machine with its own torch and no network: labkit's GPU paths, checked and logged.
#
#     bash tests/gpu/device_run.sh          (from the repository root)
#
# 1. Installs the wheels carried in .whl/ (the packages labkit and tests/gpu need that the machine lacks: plotly,
#    ipywidgets, IPython, papermill, ipykernel and their dependencies, for Python 3.12) into $SITE, offline.
# 2. Prints the GPUs (nvidia-smi -L), torch's version, CUDA build and NCCL, and the packages' versions.
# 3. python -m labkit.commands.gpu_check, then pytest tests/gpu (-ra, $PYTEST_FLAGS: -x unless set), then
#    tests/gpu/run_notebooks.py if time is left.
# Everything is tee'd to $OUT/gpu_log.txt (pytest's JUnit XML to $OUT/junit.xml). Every step has a timeout, within
# one deadline of $TOTAL_SECONDS (360) for the whole run. Exit status: the first that is not 0 of pytest's,
# gpu_check's and run_notebooks' (124 where one ran out of time or was skipped for lack of it).
# Where there is no GPU, each step says so and every test skips with its reason.
#
# Variables: PYTHON (python3), OUT (/tmp/labkit-gpu-out), SITE (/tmp/site), TOTAL_SECONDS (360), PYTEST_FLAGS (-x).

set -u
cd "$(dirname "$0")/../.."
PYTHON=${PYTHON:-python3}
OUT=${OUT:-/tmp/labkit-gpu-out}
SITE=${SITE:-/tmp/site}
TOTAL_SECONDS=${TOTAL_SECONDS:-360}
PYTEST_FLAGS=${PYTEST_FLAGS:--x}
LOG="$OUT/gpu_log.txt"
DEADLINE=$((SECONDS + TOTAL_SECONDS))
export PYTHONUNBUFFERED=1
mkdir -p "$OUT"
: >"$LOG"

say() { echo "device_run: $*" | tee -a "$LOG"; }

# step NAME CAP_SECONDS COMMAND...: run COMMAND for at most CAP seconds and never past the deadline (SIGINT
# first, so that pytest still prints its summary; SIGKILL 15 s later); its output tee'd to the log.
step() {
    local name=$1 cap=$2 left=$((DEADLINE - SECONDS))
    shift 2
    local limit=$((cap < left ? cap : left))
    if ((limit < 5)); then
        say "$name: skipped, the run's $TOTAL_SECONDS s are spent"
        return 124
    fi
    local command="$*"
    command=${command//$'\n'/ }
    say "$name (at most $limit s): ${command:0:160}$( ((${#command} > 160)) && echo ' ...')"
    local start=$SECONDS
    timeout -s INT -k 15 "$limit" "$@" 2>&1 | tee -a "$LOG"
    local status=${PIPESTATUS[0]}
    say "$name: exit status $status after $((SECONDS - start)) s"
    return "$status"
}

install_wheels() {
    if ! compgen -G ".whl/*.whl" >/dev/null; then
        say "no .whl/*.whl here (carry .whl): using $PYTHON's own packages"
        return 0
    fi
    step "install $(ls .whl/*.whl | wc -l) wheels into $SITE" 120 \
        "$PYTHON" -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --upgrade --target "$SITE" \
        .whl/*.whl || say "the wheels did not install: the steps below use $PYTHON's own packages"
}

describe_machine() {
    step "GPUs" 20 nvidia-smi -L || say "nvidia-smi: not found or failed"
    step "versions" 60 "$PYTHON" -c '
import importlib, platform, sys
import torch, torch.distributed as dist
print("python", platform.python_version(), sys.executable)
print("torch", torch.__version__, "| CUDA build", torch.version.cuda, "| cuda available", torch.cuda.is_available(),
      "| GPUs", torch.cuda.device_count())
for i in range(torch.cuda.device_count()):
    p = torch.cuda.get_device_properties(i)
    print(f"  cuda:{i}", p.name, f"{p.total_memory / 2**30:.0f} GiB", f"capability {p.major}.{p.minor}")
if torch.cuda.is_available():
    print("NCCL", ".".join(map(str, torch.cuda.nccl.version())))
print("torch.distributed: all_gather_single", hasattr(dist, "all_gather_single"),
      "| reduce_scatter_single", hasattr(dist, "reduce_scatter_single"))
for name in ("numpy", "cloudpickle", "tqdm", "plotly", "ipywidgets", "IPython", "papermill", "ipykernel",
             "nbformat", "nbclient", "jupyter_client", "pytest", "labkit"):
    try:
        module = importlib.import_module(name)
        print(" ", name, getattr(module, "__version__", "?"), "from", module.__file__)
    except Exception as exc:
        print(" ", name, "NOT IMPORTABLE:", type(exc).__name__, exc)
'
}

say "start $(date -u +%Y-%m-%dT%H:%M:%SZ) in $(pwd), $TOTAL_SECONDS s in all, log $LOG"
install_wheels
export PYTHONPATH="$SITE:.${PYTHONPATH:+:$PYTHONPATH}"
describe_machine
step "gpu_check" 120 "$PYTHON" -m labkit.commands.gpu_check
gpu_check_status=$?
# shellcheck disable=SC2086  # PYTEST_FLAGS is a list of flags
step "pytest tests/gpu" 330 "$PYTHON" -m pytest tests/gpu -ra -p no:cacheprovider $PYTEST_FLAGS --timeout=240 \
    --junitxml="$OUT/junit.xml"
pytest_status=$?
step "run_notebooks" 60 "$PYTHON" tests/gpu/run_notebooks.py
notebooks_status=$?
say "done after $SECONDS s: pytest exit status $pytest_status, gpu_check exit status $gpu_check_status," \
    "run_notebooks exit status $notebooks_status"
for status in "$pytest_status" "$gpu_check_status" "$notebooks_status"; do
    if ((status != 0)); then
        exit "$status"
    fi
done
exit 0
