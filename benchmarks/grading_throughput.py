"""How long does grading a class take, against running the solution once per student? And what does the sandbox cost?

    python benchmarks/grading_throughput.py [--notebook 05_fsdp] [--students 20] [--solution-runs 20] [--jobs 2]

1. The solution notebook executed `--solution-runs` times in a row (nbclient, as `jupyter nbconvert --execute`
   runs it: every cell, its timing cells too): the cost of running each student's notebook as it is.
2. `python -m utils.grade` on a class of `--students` copies of the solution as a student hands it in, with
   `--jobs` at once. The ratio of the two (per student) is the number to watch (issue 44: at most 0.7).
3. The sandbox's own cost: a checking process started and one cell importing torch run, with bubblewrap and
   without, five times each.
The machine may be shared: say so next to any number this prints.
"""
import argparse
import collections
import csv
import json
import subprocess
import sys
import tempfile
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT / "tests"))
sys.path.insert(0, str(ROOT))


def solution_seconds(name, runs):
    import nbformat
    from nbclient import NotebookClient
    times = []
    for _ in range(runs):
        nb = nbformat.read(ROOT / "solutions" / f"{name}.ipynb", as_version=4)
        start = time.perf_counter()
        with tempfile.TemporaryDirectory() as cwd:
            NotebookClient(nb, timeout=600, kernel_name="python3", resources={"metadata": {"path": cwd}}).execute()
        times.append(time.perf_counter() - start)
    return times


def grading_seconds(name, students, jobs):
    from test_grade import handed_in
    with tempfile.TemporaryDirectory() as folder:
        text = handed_in(name)
        for k in range(students):
            (Path(folder) / f"student{k:02d}").mkdir()
            (Path(folder) / f"student{k:02d}" / f"{name}.ipynb").write_text(text)
        start = time.perf_counter()
        run = subprocess.run([sys.executable, "-m", "utils.grade", folder, "--out", f"{folder}/grades.csv",
                              "--jobs", str(jobs), "--timeout", "900"], cwd=ROOT, capture_output=True, text=True)
        elapsed = time.perf_counter() - start
        verdicts = collections.Counter(row["verdict"] for row in csv.DictReader(open(f"{folder}/grades.csv")))
    assert run.returncode == 0, run.stderr[-2000:]
    if set(verdicts) != {"passed"}:  # on a loaded machine, a check's own spawn timeout (20 s) may end a run
        print(f"not every row passed: {dict(verdicts)}")
    return elapsed


def sandbox_seconds(runs=5):
    from utils.grading import sandbox
    found = {}
    for isolated in (True, False):
        if not isolated:
            sandbox.bwrap.cache_clear()
            which = sandbox.shutil.which
            sandbox.shutil.which = lambda name: None
        times = []
        for _ in range(runs):
            with tempfile.TemporaryDirectory() as workdir:
                start = time.perf_counter()
                slot = sandbox.Slot(workdir, 120)
                assert slot.run(0, "import torch, utils.launch") is None
                slot.close()
                times.append(time.perf_counter() - start)
        found[isolated] = times
        if not isolated:
            sandbox.shutil.which = which
            sandbox.bwrap.cache_clear()
    return found


def main():
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--notebook", default="05_fsdp")
    parser.add_argument("--students", type=int, default=20)
    parser.add_argument("--solution-runs", type=int, default=20)
    parser.add_argument("--jobs", type=int, default=2)
    args = parser.parse_args()
    cost = sandbox_seconds()
    for isolated, times in cost.items():
        print(f"a checking process started, torch imported, killed: {'bwrap' if isolated else 'no sandbox'} "
              f"{json.dumps([round(t, 2) for t in times])} s; median {sorted(times)[len(times) // 2]:.2f} s")
    solution = solution_seconds(args.notebook, args.solution_runs)
    per_run = sum(solution) / len(solution)
    print(f"the solution of {args.notebook} executed {len(solution)} times: {sum(solution):.0f} s "
          f"({per_run:.1f} s each: {json.dumps([round(t, 1) for t in solution])})")
    graded = grading_seconds(args.notebook, args.students, args.jobs)
    print(f"{args.students} submissions graded with --jobs {args.jobs}: {graded:.0f} s "
          f"({graded / args.students:.1f} s per student)")
    print(f"ratio to running the solution once per student: {graded / (per_run * args.students):.2f}")


if __name__ == "__main__":
    main()
