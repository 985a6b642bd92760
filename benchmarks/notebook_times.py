"""How long does each notebook take under strict nbval, with ranks forked and with the spawn start method?

    python benchmarks/notebook_times.py [solutions/02_data_parallel.ipynb ...]

Each solution notebook (all of them by default) runs under `pytest --nbval` (the README's check,
outputs compared to the letter) once with the fork start method and once with SPAWN_START_METHOD=spawn
(macOS's path: warm ranks). Prints the seconds of each and the ratio, and the totals.
"""
import os
import subprocess
import sys
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent


def seconds(notebook, start_method):
    env = {**os.environ, "SPAWN_START_METHOD": start_method}
    start = time.perf_counter()
    run = subprocess.run([sys.executable, "-m", "pytest", "-q", str(notebook)], cwd=ROOT, env=env,
                         capture_output=True, text=True)
    elapsed = time.perf_counter() - start
    if run.returncode:
        print(run.stdout[-2000:])
        raise SystemExit(f"{notebook.name} failed under nbval with the {start_method} start method")
    return elapsed


def main():
    notebooks = [Path(a).resolve() for a in sys.argv[1:]] or sorted((ROOT / "solutions").glob("*.ipynb"))
    print(f"strict nbval, {os.cpu_count()} cores, {sys.platform}; seconds")
    print(f"  {'notebook':28}{'fork':>8}{'spawn':>8}{'spawn / fork':>14}")
    totals = [0.0, 0.0]
    for notebook in notebooks:
        fork, spawn = seconds(notebook, "fork"), seconds(notebook, "spawn")
        totals = [totals[0] + fork, totals[1] + spawn]
        print(f"  {notebook.stem:28}{fork:8.1f}{spawn:8.1f}{spawn / fork:13.2f}x")
    print(f"  {'all':28}{totals[0]:8.1f}{totals[1]:8.1f}{totals[1] / totals[0]:13.2f}x")


if __name__ == "__main__":
    main()
