"""labkit.launch.attach_commands: the command for the nodes, broken into shell lines a notebook shows whole, means
the same command to the shell."""

import subprocess

import labkit.launch


def test_the_printed_torchrun_command_is_the_one_line_command_to_the_shell():
    printed = labkit.launch.attach_commands(16, 2, connect="10.0.0.5:40917")
    one_line = labkit.launch.attach_commands(16, 2, connect="10.0.0.5:40917", lines=False)
    assert all(len(line) <= 100 for line in printed.splitlines())
    torchrun = printed[: printed.index("  srun")].strip()
    echoed = subprocess.run(["bash", "-c", "printf '%s ' " + torchrun.removeprefix("torchrun")], capture_output=True,
                            text=True, check=True).stdout.strip()
    assert "torchrun " + echoed == one_line.splitlines()[0]
