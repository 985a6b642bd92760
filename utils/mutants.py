"""Do a notebook's checks notice missing communication? The course's mutation testing.

    python -m utils.mutants solutions/02_data_parallel.ipynb [--max N]

Inside each `### BEGIN SOLUTION ... ### END SOLUTION` region, every line that calls a
torch.distributed communication function (all_reduce, isend, all_gather_single, ...) is, one at a
time, turned into a no-op that returns a completed handle: a mutant. So is every RPC (notebook 08):
`rpc.rpc_sync`, `rpc.rpc_async` and `rpc.remote`, distributed autograd's `backward` and a
`DistributedOptimizer`'s `step(context_id)` (an optimizer step given an argument: the RPCs that step every
worker) become that no-op, and a method called on an RRef (`stage.rpc_sync().forward(x)`) hands back its first argument,
as if the remote stage had been skipped. Each mutant notebook is run top
to bottom in a fresh kernel, without its timing cells (tag `nbval-ignore-output`): a check must
notice, not a benchmark. A mutant is killed when some cell fails (a check's AssertionError, the
launcher's TimeoutError, any error). A survivor is a solution that skips that call and still
passes every check: a check to strengthen. Exits 1 when a mutant survives or none can be made.
`pytest -m slow` runs it on every solution (tests/test_mutants.py).
"""
import argparse
import os
import re
import sys
from pathlib import Path

import nbformat
from nbclient import NotebookClient
from nbclient.exceptions import CellExecutionError, CellTimeoutError, DeadKernelError

from utils.notebooks import BEGIN, END, retry_kernel_start

OPS = ("all_reduce reduce_scatter reduce_scatter_tensor reduce_scatter_single all_gather all_gather_into_tensor "
       "all_gather_single broadcast reduce scatter gather send recv isend irecv batch_isend_irecv all_to_all "
       "all_to_all_single").split()
CALL = re.compile(r"\b(?:dist|torch\.distributed)\.(" + "|".join(OPS) + r")\(")
RPC_CALL = re.compile(r"\b(?:rpc\.(?:rpc_sync|rpc_async|remote)|dist_autograd\.backward)\(")
REMOTE_METHOD = re.compile(r"[\w.\[\]]+\.(?:rpc_sync|rpc_async|remote)\(\)\.\w+\(")  # rref.rpc_sync().forward(
DISTRIBUTED_STEP = re.compile(r"\b[\w.\[\]]+\.step\((?=[^)\s])")  # optimizer.step(context_id), not optimizer.step()
MUTATIONS = ((CALL, "_mutant_no_op("), (RPC_CALL, "_mutant_no_op("), (REMOTE_METHOD, "_mutant_skipped("),
             (DISTRIBUTED_STEP, "_mutant_no_op("))
NO_OP = '''class _MutantDone:
    def wait(self, *args, **kwargs): return True
    def is_completed(self): return True
    def __iter__(self): return iter(())
def _mutant_no_op(*args, **kwargs): return _MutantDone()
def _mutant_skipped(x=None, *args, **kwargs): return x'''
TIMING = "nbval-ignore-output"


def call_sites(nb):
    """(cell index, line index) of each communication call inside a solution region."""
    found = []
    for i, cell in enumerate(nb.cells):
        if cell.cell_type != "code":
            continue
        inside = False
        for j, line in enumerate(cell.source.splitlines()):
            if line.strip().startswith(BEGIN):
                inside = True
            elif line.strip().startswith(END):
                inside = False
            elif inside and any(pattern.search(line) for pattern, _ in MUTATIONS):
                found.append((i, j))
    return found


def mutant(nb, site):
    """The notebook with one call made a no-op, its timing cells left out, and the no-op defined first."""
    cell, line = site
    m = nbformat.from_dict(nb)
    lines = m.cells[cell].source.splitlines()
    for pattern, replacement in MUTATIONS:
        lines[line] = pattern.sub(replacement, lines[line])
    m.cells[cell].source = "\n".join(lines)
    m.cells = [nbformat.v4.new_code_cell(NO_OP)] + [c for c in m.cells if TIMING not in c.metadata.get("tags", [])]
    return m


def run_notebook(nb, cwd, timeout=240):
    """None when every cell ran, else a short reason (the last line of the error)."""
    try:
        client = NotebookClient(nb, timeout=timeout, kernel_name="python3", resources={"metadata": {"path": str(cwd)}})
        retry_kernel_start(client.execute)()
        return None
    except CellExecutionError as e:  # the error's first line (a check's hint), not the traceback's last
        return f"error: {e.ename}: " + (e.evalue.strip().splitlines() or [""])[0][:160]
    except (CellTimeoutError, DeadKernelError, TimeoutError) as e:
        return type(e).__name__


def run(path, max_mutants=None, log=print):
    """Make and run every mutant (or an even sample of `max_mutants`); returns (killed, total, survivors)."""
    path = Path(path)
    nb = nbformat.read(path, as_version=4)
    sites = call_sites(nb)
    if max_mutants and len(sites) > max_mutants:
        sites = [sites[int(k * len(sites) / max_mutants)] for k in range(max_mutants)]
    killed, survivors = 0, []
    for site in sites:
        where = f"cell {site[0]} line {site[1] + 1}: {nb.cells[site[0]].source.splitlines()[site[1]].strip()[:70]}"
        why = run_notebook(mutant(nb, site), cwd=path.parent)
        if why is None:
            survivors.append(where)
            log(f"SURVIVED {where}")
        else:
            killed += 1
            log(f"killed   {where}  ({why})")
    return killed, len(sites), survivors


def main(argv=None):
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("notebook", nargs="+")
    parser.add_argument("--max", type=int, default=None, help="try at most N call sites per notebook")
    args = parser.parse_args(argv)
    failed = False
    for notebook in args.notebook:
        killed, total, survivors = run(notebook, args.max)
        print(f"{os.path.basename(notebook)}: killed {killed}/{total} mutants")
        failed |= not total or bool(survivors)
    return 1 if failed else 0


if __name__ == "__main__":
    sys.exit(main())
