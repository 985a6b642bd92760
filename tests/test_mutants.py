"""Mutation testing: every communication call of every solution, made a no-op, is caught by some check."""
import nbformat
import pytest

from utils import mutants
from utils.notebooks import ROOT

SOLUTIONS = sorted((ROOT / "solutions").glob("*.ipynb"))


def test_call_sites_are_found_only_inside_solution_regions():
    nb = nbformat.v4.new_notebook(cells=[nbformat.v4.new_code_cell(
        "dist.all_reduce(x)\n### BEGIN SOLUTION\ny = 1\ndist.all_reduce(x)\nwork = dist.isend(t, 1)\n"
        "### END SOLUTION\ndist.barrier()")])
    assert mutants.call_sites(nb) == [(0, 3), (0, 4)]
    mutated = mutants.mutant(nb, (0, 4))
    assert "work = _mutant_no_op(t, 1)" in mutated.cells[1].source
    assert mutated.cells[1].source.count("_mutant_no_op") == 1 and "def _mutant_no_op" in mutated.cells[0].source


def test_rpc_calls_are_mutants_too():
    """Notebook 08: an RPC is made a no-op; a method called on an RRef hands back its input (a skipped stage); a
    DistributedOptimizer's step(context_id) is a no-op (its RPCs step the workers), a plain optimizer.step() is not."""
    nb = nbformat.v4.new_notebook(cells=[nbformat.v4.new_code_cell(
        "### BEGIN SOLUTION\nx = stages[0].rpc_sync().forward(x)\nrref = rpc.remote('w1', f)\n"
        "dist_autograd.backward(ctx, [loss])\noptimizer.step(ctx)\noptimizer.step()\n### END SOLUTION")])
    assert mutants.call_sites(nb) == [(0, 1), (0, 2), (0, 3), (0, 4)]
    assert "x = _mutant_skipped(x)" in mutants.mutant(nb, (0, 1)).cells[1].source
    assert "rref = _mutant_no_op('w1', f)" in mutants.mutant(nb, (0, 2)).cells[1].source
    assert "_mutant_no_op(ctx, [loss])" in mutants.mutant(nb, (0, 3)).cells[1].source
    assert "\n_mutant_no_op(ctx)\noptimizer.step()\n" in mutants.mutant(nb, (0, 4)).cells[1].source


@pytest.mark.slow
@pytest.mark.timeout(3600)
@pytest.mark.parametrize("path", SOLUTIONS, ids=[p.stem for p in SOLUTIONS])
def test_every_mutant_is_killed(path):
    killed, total, survivors = mutants.run(path, log=lambda line: None)
    assert total, f"{path.name}: no communication call inside a solution region"
    assert not survivors, f"{path.name}: {len(survivors)} of {total} mutants survived:\n" + "\n".join(survivors)


def test_a_killed_mutant_is_reported_by_its_errors_first_line(monkeypatch):
    """The check's hint, not the traceback's last line (a C++ stack frame, for an error raised inside PyTorch)."""
    from nbclient.exceptions import CellExecutionError

    class Client:
        def __init__(self, *args, **kwargs):
            pass

        def execute(self):
            raise CellExecutionError("Traceback ...\nframe #49: <unknown function>", "AssertionError",
                                     "stage 0 got no gradient\nrank 0 of 3 failed: ...")

    monkeypatch.setattr(mutants, "NotebookClient", Client)
    assert mutants.run_notebook(None, cwd=ROOT) == "error: AssertionError: stage 0 got no gradient"
