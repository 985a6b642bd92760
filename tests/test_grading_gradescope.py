"""The Gradescope autograder bundle, run as Gradescope runs it: unzipped into source/, a submission in submission/,
run_autograder writing results/results.json (setup.sh, which installs packages, is not run: this venv has them)."""
import json
import os
import subprocess
import sys
import zipfile

import pytest
from test_grade import handed_in

from utils.grading import command


def test_a_bundle_of_no_notebook_is_refused(tmp_path):
    with pytest.raises(SystemExit):
        command.main(["--gradescope-bundle", "99", str(tmp_path / "out.zip")])
    with pytest.raises(SystemExit):
        command.main([])  # no submission, no bundle


@pytest.mark.slow  # one run of notebook 00 in the autograder: about 15 s
def test_the_autograder_grades_a_submission_as_gradescope_lays_it_out(tmp_path):
    out = tmp_path / "autograder.zip"
    assert command.main(["--gradescope-bundle", "00", str(out), "--timeout", "120", "--params", "WORLD_SIZE = 2"]) == 0
    root = tmp_path / "autograder"
    with zipfile.ZipFile(out) as z:
        names = set(z.namelist())
        assert {"setup.sh", "run_autograder", "course/requirements.txt", "course/solutions/00_setup.ipynb"} <= names
        assert not [n for n in names if n.startswith("course/solutions/") and "00_setup" not in n]
        z.extractall(root / "source")
        for name in ("setup.sh", "run_autograder"):
            os.chmod(root / "source" / name, z.getinfo(name).external_attr >> 16)
    run = (root / "source" / "run_autograder").read_text()
    assert "--params 'WORLD_SIZE = 2'" in run and "--timeout 120" in run
    for student, text, score in (("alice", handed_in("00_setup"), 1),
                                 ("carol", handed_in("00_setup", replace={"    tensor /= dist.get_world_size()\n": ""}),
                                  0)):
        (root / "submission").mkdir(exist_ok=True)
        (root / "submission" / "homework.ipynb").write_text(text)
        env = {k: v for k, v in os.environ.items() if k != "PYTHONPATH"}
        subprocess.run([str(root / "source" / "run_autograder")], env={**env, "AUTOGRADER": str(root),
                                                                       "PYTHON": sys.executable},
                       check=True, capture_output=True, timeout=600)
        results = json.loads((root / "results" / "results.json").read_text())
        assert results["score"] == score, (student, results)
        assert results["tests"][0]["name"] == "00_setup: average_over_ranks"
