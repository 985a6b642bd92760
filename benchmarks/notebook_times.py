"""How long does each notebook take under strict nbval, with ranks forked and with the spawn start method?

    python benchmarks/notebook_times.py [solutions/02_data_parallel.ipynb ...]

Each solution notebook (all of them by default) runs under `pytest --nbval` (the README's check,
outputs compared to the letter) once with the fork start method and once with SPAWN_START_METHOD=spawn
(macOS's path: warm ranks). Prints the seconds of each and the ratio, and the totals (00-05's, and all).
When 00-05 all ran, it also times them in one `pytest` command, as a student or contributor runs several
notebooks at once: on two workers (pytest-xdist, utils/pytest_plugin.py), so both cores are used; and in one
pytest process without workers (`-n0`), one notebook after the other, as pytest ran them before the suite had
workers.
"""
import os
import subprocess
import sys
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
CORE = ("00", "01", "02", "03", "04", "05")  # collectives to FSDP: their total is printed on its own line too


def seconds(notebooks, start_method, *options):
    env = {**os.environ, "SPAWN_START_METHOD": start_method}
    start = time.perf_counter()
    run = subprocess.run([sys.executable, "-m", "pytest", "-q", *options, *map(str, notebooks)], cwd=ROOT, env=env,
                         capture_output=True, text=True)
    elapsed = time.perf_counter() - start
    if run.returncode:
        print(run.stdout[-2000:])
        raise SystemExit(f"{', '.join(n.name for n in notebooks)} failed under nbval with the {start_method} "
                         f"start method")
    return elapsed


def main():
    notebooks = [Path(a).resolve() for a in sys.argv[1:]] or sorted((ROOT / "solutions").glob("*.ipynb"))
    print(f"strict nbval, {os.cpu_count()} cores, {sys.platform}; seconds")
    print(f"  {'notebook':28}{'fork':>8}{'spawn':>8}{'spawn / fork':>14}")
    times = {}
    for notebook in notebooks:
        fork, spawn = times[notebook.stem] = seconds([notebook], "fork"), seconds([notebook], "spawn")
        print(f"  {notebook.stem:28}{fork:8.1f}{spawn:8.1f}{spawn / fork:13.2f}x")
    core = [t for stem, t in times.items() if stem[:2] in CORE]
    for name, rows in (("00-05", core if len(core) == len(CORE) else []), ("all", list(times.values()))):
        if len(rows) > 1:
            fork, spawn = sum(f for f, _ in rows), sum(s for _, s in rows)
            print(f"  {name:28}{fork:8.1f}{spawn:8.1f}{spawn / fork:13.2f}x")
    core = [n for n in notebooks if n.stem[:2] in CORE]
    if len(core) == len(CORE):
        for label, options in (("two workers", ()), ("one process, -n0", ("-n0",))):
            fork, spawn = seconds(core, "fork", *options), seconds(core, "spawn", *options)
            print(f"  {'00-05 in one pytest command':28}{fork:8.1f}{spawn:8.1f}{spawn / fork:13.2f}x   ({label})")


if __name__ == "__main__":
    main()
