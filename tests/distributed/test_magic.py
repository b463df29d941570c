"""The %%ranks cell magic in a real IPython shell: state across cells, values, errors."""

import pytest
from IPython.testing.globalipapp import start_ipython

import labkit


@pytest.fixture(scope="module")
def ip():
    shell = start_ipython()
    shell.run_cell("%load_ext labkit")
    return shell


def run(ip, source: str):
    result = ip.run_cell(source)
    return result


def test_each_rank_keeps_its_variables_across_cells(ip, capsys):
    assert run(ip, "%%ranks 2\nx = 10 * labkit.rank()").success
    assert run(ip, "%%ranks 2\ny = x + 1\nprint('y is', y)").success
    out = capsys.readouterr().out
    assert "[rank 0] y is 1" in out and "[rank 1] y is 11" in out


def test_last_expression_is_shown_per_rank(ip, capsys):
    assert run(ip, "%%ranks 3\nt = torch.tensor([float(labkit.rank())])\ndist.all_reduce(t)\nt.item()").success
    out = capsys.readouterr().out
    assert [line for line in out.splitlines() if line.startswith("[rank")] == [
        "[rank 0] 3.0", "[rank 1] 3.0", "[rank 2] 3.0"]


def test_error_in_one_rank_shows_the_cells_line(ip):
    result = run(ip, "%%ranks 2\nvalue = 1\nif labkit.rank() == 1:\n    raise ValueError('only me')\nvalue")
    error = result.error_in_exec
    assert isinstance(error, labkit.RankError)
    message = str(error)
    assert "rank 1 of 2 failed" in message
    assert "line 4" in message and "raise ValueError('only me')" in message  # line 1 is %%ranks


def test_an_error_names_the_cell_the_notebook_shows(ip):
    for _ in range(2):  # a cell count that has moved on, as in a notebook
        ip.run_cell("x = 1", store_history=True)
    result = ip.run_cell("%%ranks 2\nraise KeyError('here')", store_history=True)
    assert isinstance(result.error_in_exec, labkit.RankError)
    assert f"Cell In[{result.execution_count}], line 2" in str(result.error_in_exec)


def test_bad_arguments_are_usage_errors(ip):
    assert not run(ip, "%%ranks\nx = 1").success
    result = run(ip, "%%ranks 0\nx = 1")
    assert isinstance(result.error_in_exec, ValueError)
