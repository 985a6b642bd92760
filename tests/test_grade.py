"""The grading command (utils.grade): a class of submissions, each made from the solution notebook (its answers
with the markers taken out, as a student who completed the student copy would hand in) or the shipped student
copy, with one edit each; every one gets its verdict, within the time limit, and leaves no process behind."""
import csv
import json
import os
import re
import tempfile
import time

import pytest
from test_checks_setup import MISTAKES

from utils.grading import command as grade
from utils.notebooks import BEGIN, END, ROOT

TIMEOUT = 30  # seconds per submission: the loops and hangs below end here (a loaded machine needs 15 to import torch)


def handed_in(name, replace=None, edit=None):
    """The solution notebook's JSON as a student hands it in: answers in place, no markers, no outputs; with
    `replace` (each old text once) and edit(cells) applied."""
    nb = json.loads((ROOT / "solutions" / f"{name}.ipynb").read_text())
    for cell in nb["cells"]:
        if cell["cell_type"] == "code":
            lines = "".join(cell["source"]).splitlines(keepends=True)
            cell["source"] = "".join(line for line in lines if line.strip() not in (BEGIN, END))
            cell["outputs"], cell["execution_count"] = [], None
    for old, new in (replace or {}).items():
        assert sum(cell["source"].count(old) for cell in nb["cells"] if cell["cell_type"] == "code") == 1, old
        for cell in nb["cells"]:
            cell["source"] = "".join(cell["source"]).replace(old, new)
    if edit:
        edit(nb["cells"])
    return json.dumps(nb)


def cell_with(cells, text):
    return next(c for c in cells if text in "".join(c["source"]))


def write_class(folder, submissions):
    """submissions: {student: (file name, text)}."""
    for student, (filename, text) in submissions.items():
        (folder / student).mkdir(parents=True)
        (folder / student / filename).write_text(text)


def run_grader(tmp_path, monkeypatch, *args):
    """python -m utils.grade, in this process, its temporary folders (each slot's working folder) under tmp_path;
    returns {student: [rows]}, the wall time, and the processes whose environment names that folder."""
    runs = tmp_path / "runs"
    runs.mkdir()
    monkeypatch.setattr(tempfile, "tempdir", str(runs))
    start = time.monotonic()
    assert grade.main([str(tmp_path / "submitted"), "--out", str(tmp_path / "grades.csv"), "--jobs", "2",
                       *args]) == 0
    seconds = time.monotonic() - start
    rows = {}
    with open(tmp_path / "grades.csv") as f:
        for row in csv.DictReader(f):
            rows.setdefault(row["student"], []).append(row)
    return rows, seconds, left_behind(str(runs))


def left_behind(marker):
    found = []
    for entry in os.scandir("/proc"):
        try:
            if entry.name.isdigit() and f"GRADING_SLOT={marker}".encode() in open(f"/proc/{entry.name}/environ",
                                                                                    "rb").read():
                found.append(int(entry.name))
        except OSError:
            pass
    return found


def only(rows):
    assert len(rows) == 1, rows
    return rows[0]["verdict"], rows[0]["message"]


def test_bad_input_and_unstarted_copies_are_rows_not_crashes(tmp_path, monkeypatch):
    """Graded without a kernel: nothing of theirs could run."""
    def other_version(cells):
        cell = cell_with(cells, "def average_over_ranks(tensor):")
        cell["source"] = "def average(tensor, group):\n    # TODO: the mean over the group.\n    pass\n"
    write_class(tmp_path / "submitted", {
        "bob": ("00_setup.ipynb", (ROOT / "notebooks" / "00_setup.ipynb").read_text()),
        "judy": ("00_setup.ipynb", '{"cells": [ '),
        "mallory": ("notes.ipynb", json.dumps({"cells": [{"cell_type": "code", "source": "print(1)", "metadata": {},
                                                           "outputs": [], "execution_count": None}],
                                               "metadata": {}, "nbformat": 4, "nbformat_minor": 5})),
        "oscar": ("00_setup.ipynb", handed_in("00_setup", edit=other_version)),
        "trent": ("00_setup.ipynb", "[1, 2]"),
    })
    rows, _, _ = run_grader(tmp_path, monkeypatch, "--timeout", str(TIMEOUT))
    assert only(rows["bob"]) == ("not attempted", "average_over_ranks: your code goes here")
    assert only(rows["judy"])[0] == "error" and "invalid JSON" in only(rows["judy"])[1]
    assert only(rows["mallory"]) == ("error", "a notebook of no course assignment")
    assert only(rows["oscar"])[0] == "error" and "another version of the course" in only(rows["oscar"])[1]
    assert only(rows["trent"])[0] == "error" and "not a notebook" in only(rows["trent"])[1]


def test_a_flat_folder_of_submissions_is_graded_student_by_student(tmp_path, capsys):
    """Several submissions of one notebook in one folder (an LMS download): each its own student, by file name; a
    folder holding one student's different notebooks keeps the folder's name."""
    flat, alice = tmp_path / "submitted", tmp_path / "submitted" / "alice"
    alice.mkdir(parents=True)
    for name in ("bob.ipynb", "carol.ipynb"):
        (flat / name).write_text(handed_in("00_setup"))
    (alice / "00_setup.ipynb").write_text(handed_in("00_setup"))
    (alice / "01_collectives.ipynb").write_text(handed_in("01_collectives"))
    students = sorted(student for student, _ in grade.told_apart(grade.collect([flat])))
    assert students == ["alice", "alice", "submitted/bob", "submitted/carol"]
    assert "2 submissions of 00_setup in folder 'submitted'" in capsys.readouterr().err


@pytest.mark.slow  # 17 s of kernels: the default run keeps the grader's refusals and unstarted copies
def test_answers_are_graded_by_the_instructors_checks(tmp_path, monkeypatch):
    """Right, wrong with the check's own hint, a renamed file, a check redefined by the answer, a check cell
    deleted; and the Gradescope file."""
    no_division, hint = MISTAKES["no division"]
    redefined = "    tensor /= dist.get_world_size()\n"

    def delete_check(cells):
        cells.remove(cell_with(cells, "check_average_over_ranks(average_over_ranks, WORLD_SIZE)"))
    write_class(tmp_path / "submitted", {
        "alice": ("00_setup.ipynb", handed_in("00_setup")),
        "carol": ("00_setup.ipynb", handed_in("00_setup", replace=no_division)),
        "grace": ("00_setup.ipynb", handed_in("00_setup", replace={
            redefined: redefined + "\n\ndef check_average_over_ranks(*args):\n    print('correct')\n"})),
        "heidi": ("00_setup.ipynb", handed_in("00_setup", edit=delete_check)),
        "ivan": ("homework (1).ipynb", handed_in("00_setup")),
    })
    rows, _, left = run_grader(tmp_path, monkeypatch, "--timeout", "120", "--gradescope", str(tmp_path / "gs"))
    assert only(rows["alice"]) == ("passed", "")
    assert rows["alice"][0]["points"] == rows["alice"][0]["max_points"] == "1"
    verdict, message = only(rows["carol"])
    assert verdict == "failed" and re.search(hint.split(".*")[0], message)
    verdict, message = only(rows["grace"])
    assert verdict == "error" and "tampering" in message and "rebinds check_average_over_ranks" in message
    verdict, message = only(rows["heidi"])
    assert verdict == "error" and "tampering" in message and "edited or deleted" in message
    assert only(rows["ivan"]) == ("passed", "") and rows["ivan"][0]["notebook"] == "00_setup"
    results = json.loads((tmp_path / "gs" / "carol" / "results.json").read_text())
    assert results["score"] == 0 and results["tests"][0]["max_score"] == 1
    assert results["tests"][0]["output"].startswith("failed: ")
    assert not left


@pytest.mark.slow  # 25 s, most of it waiting out the time limit: the default run stays within its 6 minutes
def test_loops_hangs_killed_kernels_and_memory_hogs_are_stopped_and_leave_nothing_behind(tmp_path, monkeypatch):
    divide = "    tensor /= dist.get_world_size()\n"
    write_class(tmp_path / "submitted", {
        "dave": ("00_setup.ipynb", handed_in("00_setup", replace={divide: divide + "    while True:\n        pass\n"})),
        "erin": ("00_setup.ipynb", handed_in("00_setup", replace={
            divide: divide + "    if dist.get_rank() == 0:\n        dist.barrier()\n    time.sleep(600)\n"})),
        "frank": ("00_setup.ipynb", handed_in("00_setup", replace={divide: divide + "    os.kill(os.getppid(), 9)\n"})),
        "peggy": ("00_setup.ipynb", handed_in("00_setup", replace={
            divide: divide + "    hog = [torch.ones(2**27) for _ in range(100)]\n"})),  # 512 MB each, in each rank
    })
    rows, seconds, left = run_grader(tmp_path, monkeypatch, "--timeout", str(TIMEOUT), "--memory", "1.5")
    assert only(rows["dave"])[0] == "timed out" and only(rows["erin"])[0] == "timed out"
    assert only(rows["frank"]) == ("error", "the checking process died")  # a rank killed its parent
    assert only(rows["peggy"]) == ("error", "over the memory limit of 1.5 GB")
    assert seconds < 2 * TIMEOUT + 60, f"{seconds:.0f} s"
    assert not left, f"left behind: {left}"


def test_bad_arguments_are_refused_before_anything_runs(tmp_path):
    for args in (["--shard", "3/2"], ["--shard", "x"], ["--params", "WORLD_SIZE ="], ["--jobs", "0"]):
        with pytest.raises(SystemExit):
            grade.main([str(tmp_path), *args])
    assert grade.shard(list(range(7)), "2/3") == [1, 4]


@pytest.mark.slow
@pytest.mark.timeout(900)
def test_a_class_of_05_with_hidden_parameters(tmp_path, monkeypatch):
    """The multi-process-heavy notebook, at a hidden world size of 2 (05's batch of 8 does not split on 3): right
    answers pass at both world sizes; a wrong one fails with its hint; an answer right only at 4 ranks fails; the
    shipped copy is not attempted."""
    rs = "    dist.reduce_scatter_single(shard, flat)\n"
    scatter = rs + "    return shard / world_size\n"
    write_class(tmp_path / "submitted", {
        "alice": ("05_fsdp.ipynb", handed_in("05_fsdp")),
        "bob": ("05_fsdp.ipynb", (ROOT / "notebooks" / "05_fsdp.ipynb").read_text()),
        "carol": ("05_fsdp.ipynb", handed_in("05_fsdp", replace={scatter: rs + "    return shard\n"})),
        "dan": ("05_fsdp.ipynb", handed_in("05_fsdp", replace={scatter: rs + "    return shard / 4\n"})),
    })
    rows, _, left = run_grader(tmp_path, monkeypatch, "--timeout", "600", "--params", "WORLD_SIZE = 2")
    assert {r["verdict"] for r in rows["alice"]} == {"passed"}, rows["alice"]
    assert {r["verdict"] for r in rows["bob"]} == {"not attempted"}
    carol = {r["exercise"]: r for r in rows["carol"]}
    assert carol["gather_parameters, Zero1AdamW"]["verdict"] == "passed"
    assert carol["reduce_scatter_gradient, Zero2AdamW"]["verdict"] == "failed"
    dan = {r["exercise"]: r for r in rows["dan"]}["reduce_scatter_gradient, Zero2AdamW"]
    # right at 4 ranks only: 05's own checks also run on 3 ranks, so it fails at the notebook's values already
    assert dan["verdict"] == "failed" and "on 3 ranks" in dan["message"], dan
    assert not left
