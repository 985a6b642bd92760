"""Gradescope: results in its autograder format, and the autograder bundle of one notebook.

    results(rows)                   the results.json of one student's rows
    bundle(name, out, arguments)    the zip Gradescope's "autograder" upload takes

The bundle holds setup.sh (Gradescope runs it once, building its image: bubblewrap, a virtual environment, the
course's pinned requirements) and run_autograder (run for each submission: grades /autograder/submission into
/autograder/results/results.json with the instructor's hidden arguments), and the course's files the grader needs:
utils/, requirements.txt, pyproject.toml and the one solution notebook. The solution is in the image, outside
the sandbox: where Gradescope's container cannot run bwrap, the grader warns (in the autograder's log) that a
submission could read it.
"""
import json
import shlex
import zipfile

from utils.notebooks import ROOT

SETUP = """#!/usr/bin/env bash
# Gradescope runs this once, as root, building the autograder's image.
set -euo pipefail
apt-get update -qq
apt-get install -y -qq python3 python3-venv python3-pip bubblewrap
python3 -m venv /autograder/venv
cd /autograder/source/course
/autograder/venv/bin/pip install --quiet -r requirements.txt
"""

RUN = """#!/usr/bin/env bash
# Gradescope runs this for each submission: its files are in $AUTOGRADER/submission.
set -uo pipefail
AUTOGRADER="${{AUTOGRADER:-/autograder}}"
PYTHON="${{PYTHON:-$AUTOGRADER/venv/bin/python}}"
COURSE="$(cd "$(dirname "$0")" && pwd)/course"
[ -d "$COURSE" ] || COURSE="$AUTOGRADER/source/course"
mkdir -p "$AUTOGRADER/results"
cd "$COURSE"
PYTHONPATH="$COURSE" "$PYTHON" -m utils.grade "$AUTOGRADER/submission" --jobs 1 \\
    --out "$AUTOGRADER/results/grades.csv" --gradescope-results "$AUTOGRADER/results/results.json" {arguments}
"""


def results(rows):
    """Gradescope's results.json (a dict) for one student's rows."""
    tests = [dict(name=f"{r['notebook']}: {r['exercise']}" if r["exercise"] else r["notebook"],
                  score=r["points"], max_score=r["max_points"],
                  output=r["verdict"] + (f": {r['message']}" if r["message"] else "")) for r in rows]
    if not tests:
        return dict(score=0, output="no notebook of the course was found in the submission", tests=[])
    return dict(score=sum(t["score"] for t in tests), tests=tests)


def write_results(rows, path):
    with open(path, "w") as f:
        json.dump(results(rows), f, indent=2)
        f.write("\n")


def bundle(name, out, arguments):
    """Write the autograder zip of notebook `name` (e.g. "05_fsdp") to `out`; `arguments`: the grading command's
    hidden arguments (a list: --params, --timeout, --memory)."""
    with zipfile.ZipFile(out, "w", zipfile.ZIP_DEFLATED) as z:
        for script, text in (("setup.sh", SETUP), ("run_autograder", RUN.format(
                arguments=" ".join(map(shlex.quote, arguments))))):
            info = zipfile.ZipInfo(script)
            info.external_attr = 0o100755 << 16  # executable: Gradescope runs them
            z.writestr(info, text)
        for path in [*sorted((ROOT / "utils").rglob("*.py")), ROOT / "requirements.txt", ROOT / "pyproject.toml",
                     ROOT / "solutions" / f"{name}.ipynb"]:
            z.write(path, f"course/{path.relative_to(ROOT)}")
