"""A timing verdict must survive a loaded machine: run a solution with two busy processes beside it, and every
verdict its timing cells print must say what the stored run said, or that this machine cannot separate the
variants (utils.bench.verdicts_agree). A verdict that flips means the spread test is too loose for the cell.

Slow (a whole notebook, on a machine made busier on purpose): `pytest -m "" tests/test_timing_verdicts.py`, or for
one notebook, with the verdicts and the timing cells' seconds side by side:
`python tests/test_timing_verdicts.py solutions/05_fsdp.ipynb`.
"""
import contextlib
import datetime
import re
import subprocess
import sys

import nbformat
import pytest
from nbclient import NotebookClient

from utils.bench import verdicts_agree, verdicts_contradict
from utils.notebooks import ROOT, TIMING, retry_kernel_start

VERDICT = re.compile(r"fastest to slowest: |least idle to most idle: |cannot separate | / .+ = [\d.]+ \(runs allow ")


def timing_cells(nb):
    return [(i, cell) for i, cell in enumerate(nb.cells) if TIMING in cell.metadata.get("tags", [])]


def verdicts(nb):
    """{cell index: [the verdict lines its stored outputs print]} of every timing cell."""
    found = {}
    for i, cell in timing_cells(nb):
        text = "".join(output.get("text", "") for output in cell.get("outputs", []))
        found[i] = [line.strip() for line in text.splitlines() if VERDICT.search(line)]
    return found


SOLUTIONS = sorted((ROOT / "solutions").glob("*.ipynb"))


def cell_seconds(cell):
    """Wall seconds of a cell's last run, from the times Jupyter stored with it (None if it has none)."""
    times = cell.metadata.get("execution", {})
    if "iopub.execute_input" not in times:
        return None
    start, end = (datetime.datetime.fromisoformat(times[k].replace("Z", "+00:00"))
                  for k in ("iopub.execute_input", "iopub.status.idle"))
    return (end - start).total_seconds()


@contextlib.contextmanager
def busy(processes=2):
    """`processes` Python processes that spin until the block ends: a machine under someone else's load."""
    spinners = [subprocess.Popen([sys.executable, "-c", "while True: pass"]) for _ in range(processes)]
    try:
        yield
    finally:
        for spinner in spinners:
            spinner.kill()
            spinner.wait()


def run_loaded(path, processes=2):
    nb = nbformat.read(path, as_version=4)
    with busy(processes):
        retry_kernel_start(NotebookClient(nb, timeout=600, kernel_name="python3",
                                          resources={"metadata": {"path": str(path.parent)}}).execute)()
    return nb


def disagreements(stored, loaded):
    """[(cell, stored verdict, loaded verdict)] where the loaded run claims an order the stored one does not."""
    found = []
    for i, lines in verdicts(stored).items():
        theirs = verdicts(loaded)[i]
        if len(theirs) != len(lines):
            found.append((i, " | ".join(lines), " | ".join(theirs)))
        found += [(i, a, b) for a, b in zip(lines, theirs) if not verdicts_agree(a, b)]
    return found


@pytest.mark.slow
@pytest.mark.parametrize("path", SOLUTIONS, ids=lambda p: p.stem)
def test_no_verdict_flips_under_load(path):
    stored = nbformat.read(path, as_version=4)
    if not any(verdicts(stored).values()):
        pytest.skip("no timing verdicts in its stored run")
    assert not disagreements(stored, run_loaded(path))


def main(argv):
    for name in argv:
        path = ROOT / name if not name.startswith("/") else name
        stored, loaded = nbformat.read(path, as_version=4), run_loaded(path)
        for i, cell in timing_cells(stored):
            print(f"{path.stem} cell {i}: {cell_seconds(cell)} s stored, {cell_seconds(loaded.cells[i])} s loaded")
            for a, b in zip(verdicts(stored)[i], verdicts(loaded)[i]):
                word = "agree" if verdicts_agree(a, b) else "FLIPPED" if verdicts_contradict(a, b) else \
                    "DISAGREE: the loaded run separates what the stored one could not"
                print(f"  stored: {a}\n  loaded: {b}\n  {word}")
        print(f"{path.stem}: {len(disagreements(stored, loaded))} disagreements")


if __name__ == "__main__":
    main(sys.argv[1:])
