"""labkit's kernels under torchrun: two "nodes" on loopback, two processes each, c10d rendezvous."""

import json
import os
import subprocess
import sys

import pytest


def torchrun(node_rank: int, port: int, *cli_args: str) -> subprocess.Popen:
    command = [sys.executable, "-m", "torch.distributed.run", "--nnodes", "2", "--node-rank", str(node_rank),
               "--nproc-per-node", "2", "--rdzv-backend", "c10d", "--rdzv-endpoint", f"127.0.0.1:{port}",
               "--rdzv-id", "labkit-test", "--max-restarts", "0", "-m", "labkit.commands.allreduce_check",
               *cli_args]
    env = {**os.environ, "GLOO_SOCKET_IFNAME": "lo", "OMP_NUM_THREADS": "1"}  # both "nodes" are this machine
    return subprocess.Popen(command, env=env, text=True, stdout=subprocess.PIPE, stderr=subprocess.PIPE,
                            start_new_session=True)


@pytest.mark.parametrize("algorithm", ["ring_allreduce", "naive_allreduce"])
def test_two_torchrun_nodes_agree_with_torch(algorithm, port):
    nodes = [torchrun(node, port, "--algorithm", algorithm, "--numel", "37") for node in (0, 1)]
    outputs = [node.communicate(timeout=240) for node in nodes]
    assert [node.returncode for node in nodes] == [0, 0], [err[-2000:] for _, err in outputs]
    results = [json.loads(line) for out, _ in outputs for line in out.splitlines() if line.startswith("{")]
    assert sorted(r["rank"] for r in results) == [0, 1, 2, 3]
    assert all(r["ok"] and r["world_size"] == 4 and r["algorithm"] == algorithm for r in results)


def test_without_torchrun_the_command_says_how_to_start_it():
    env = {k: v for k, v in os.environ.items() if k not in ("RANK", "WORLD_SIZE", "MASTER_ADDR", "MASTER_PORT")}
    done = subprocess.run([sys.executable, "-m", "labkit.commands.allreduce_check"], env=env, capture_output=True,
                          text=True, timeout=60)
    assert done.returncode != 0
    assert "start it with torchrun" in done.stderr


def test_a_negative_numel_is_a_usage_error_before_any_rendezvous(capsys):
    from labkit.commands.allreduce_check import main
    with pytest.raises(SystemExit) as exited:
        main(["--numel", "-1"])
    assert exited.value.code == 2
    assert "error: --numel=-1: pass a whole number >= 0 (an int, not a bool)." in capsys.readouterr().err


@pytest.mark.parametrize("algorithm, numel, error, message", [
    ("all_gather", 4, ValueError, r"^algorithm='all_gather': use one of 'ring_allreduce', 'naive_allreduce'\.$"),
    ("ring_allreduce", True, ValueError, r"^numel=True: pass a whole number >= 0"),
    ("ring_allreduce", "4", TypeError, r"^numel='4': pass a whole number >= 0"),
])
def test_check_allreduce_refuses_bad_arguments_by_name(algorithm, numel, error, message):
    from labkit.commands.allreduce_check import check_allreduce
    with pytest.raises(error, match=message):
        check_allreduce(algorithm, numel)
