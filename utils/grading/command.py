"""Grade a class: each submission run sandboxed and bounded, a verdict per exercise, to a CSV (and Gradescope).

    python -m utils.grade submitted/ --out grades.csv
    python -m utils.grade submitted/*/05_fsdp.ipynb --out grades.csv --params "WORLD_SIZE = 3" --gradescope gs/
    python -m utils.grade --gradescope-bundle 05 autograder.zip --params "WORLD_SIZE = 2"

A submission is a student's copy of a course notebook with the exercises filled in; its student is the folder it
sits in (submitted/alice/05_fsdp.ipynb), or "folder/file name" when a folder holds several submissions of one
notebook (a flat download: submitted/alice.ipynb, submitted/bob.ipynb); which notebook it is comes from its cells
(utils.grading.submission). Folders are searched for .ipynb files. Only the answers come from the submission:
they are put in the solution notebook's regions, and that notebook runs, its check cells and the library as the
instructor has them, in a checking process of its own (utils.grading.sandbox: bubblewrap, a time and a memory
limit, no process left behind) that runs no line of the student's: the package's docstring says why.

A verdict per exercise, from its check cells: passed; failed (the check's AssertionError: the message is its
hint's first line); not attempted (the NotImplementedError left in); error (any other exception, a checking
process that died or ran out of memory, tampering, input that is not a course notebook); timed out. After an
exercise's checks the solution's own answer takes its place, so a later exercise is graded with the reference of
an earlier one (its row says so when the student's own did not pass). An answer with code outside the functions
it completes, one that rebinds the notebook's names or sets attributes of the modules it imported, or a check
cell edited or deleted in the submission, cannot pass: the message says what it did. --params runs the notebook
again with assignments added to its parameters cell: an exercise passes only if it passes at every value.
"""
import argparse
import collections
import concurrent.futures
import csv
import json
import os
import re
import sys
import tempfile
import threading
import time
import warnings
from pathlib import Path

from utils.grading import gradescope as gradescope_format
from utils.grading import submission
from utils.grading import sandbox, wire
from utils.grading.sandbox import Slot, Stopped

COLUMNS = ["student", "notebook", "exercise", "verdict", "points", "max_points", "message"]
TIMEOUT_FACTOR, TIMEOUT_FLOOR = 4, 60  # the default time limit: the solution's own run time, times this, at least
MEMORY_GB = 4.0


def collect(paths):
    """(student, path) of each submission: the files given, and the .ipynb files in the folders given."""
    found = []
    for path in map(Path, paths):
        files = sorted(p for p in path.rglob("*.ipynb") if ".ipynb_checkpoints" not in p.parts) \
            if path.is_dir() else [path]
        found += [(f.resolve().parent.name, f) for f in files]
    return found


def told_apart(found):
    """`found` with a folder's several submissions of one notebook told apart (a flat download, every student's
    file in one folder): each one's student is "folder/file name" instead of the folder, and a note says so."""
    def name(path):
        a = assignment_of(path)
        return a.name if a else Path(path).name

    which = [(student, name(path)) for student, path in found]
    count = collections.Counter(which)
    apart = [(f"{student}/{Path(path).stem}", path) if count[key] > 1 else (student, path)
             for (student, path), key in zip(found, which)]
    for (student, name), n in count.items():
        if n > 1:
            print(f"{n} submissions of {name} in folder {student!r}: each graded as the student "
                  f"'{student}/<file name>' (one folder per student names them by folder)", file=sys.stderr)
    return apart


def assignment_of(path):
    """The course assignment the notebook at path is a copy of, or None (not a notebook, or of no assignment)."""
    nb = read_notebook(path)
    return None if isinstance(nb, str) else submission.identify(nb)


def read_notebook(path):
    """The notebook at path, or a message saying why it is not one."""
    import nbformat
    try:
        text = Path(path).read_text()
    except (OSError, UnicodeDecodeError) as e:
        return f"cannot be read: {e}"
    try:
        data = json.loads(text)
    except json.JSONDecodeError as e:
        return f"not a notebook: invalid JSON ({e})"
    try:
        with warnings.catch_warnings():  # a cell without an id, say: the student's file, not the grader's problem
            warnings.simplefilter("ignore")
            return nbformat.reads(json.dumps(data), as_version=4)
    except Exception as e:  # nbformat's own errors: not a notebook, or a version it does not know
        return f"not a notebook: {str(e).splitlines()[0]}"


def verdict_of(error, exercise):
    """(verdict, message) of an exercise whose answer or check cell ended with error [exception name, message]."""
    name, text = error
    hint = (text.strip().splitlines() or [""])[0]
    if name == "AssertionError":
        return "failed", hint
    if name == "TimeoutError":  # the check's own limit on its ranks (a loop, a hang) came before the run's
        return "timed out", hint
    left = [stub_text for stub in exercise.stubs if (stub_text := stub.split('("')[-1].rstrip('")')) in text]
    if left:  # a stub left in, raised here or in a rank
        return "not attempted", left[0]
    return "error", f"{name}: {hint}"


STOPPED = {"timed out": "timed out", "out of memory": "error", "died": "error"}


def run_once(assignment, answers, params, seconds, memory_bytes):
    """{exercise: (verdict, message)} for one run of the solution notebook in a slot (utils.grading.sandbox), its
    answers replaced: each exercise's by the student's if attempted (and defining functions only), checked, then
    the solution's again (the reference, which the later exercises' checks call); the answers refused, and
    {exercise: TCP segments its answer's cells sent} (utils.grading.wire; None outside the sandbox)."""
    at = {e.cell: e for e in assignment.exercises}
    owner = {j: e for e in assignment.exercises for j in [e.cell, *e.checks]}
    last = {(e.checks or [e.cell])[-1]: e for e in assignment.exercises}
    verdicts, own, sent = {}, {}, {}
    why = {"timed out": f"over the time limit of {seconds:g} s",
           "out of memory": f"over the memory limit of {(memory_bytes or 0) / 2**30:g} GB",
           "died": "the checking process died"}
    with tempfile.TemporaryDirectory(prefix="grade-") as workdir:
        slot = Slot(workdir, seconds, memory_bytes, assignment.name)
        running = None
        try:
            for i, cell in enumerate(assignment.solution.cells):
                tags = set(cell.metadata.get("tags", []))
                if not submission.is_code(cell) or submission.SKIPPED & tags:
                    continue
                source = cell.source + ("\n" + params if "parameters" in tags and params else "")
                exercise = running = owner.get(i)
                if i in at:
                    own[exercise.name] = submission.own_answer(answers[exercise.name], exercise, source)
                if exercise and isinstance(own[exercise.name], tuple):
                    graded, functions = own[exercise.name]
                    error = slot.run(i, graded if i in at else source, functions if i in at else (),
                                     fork=i not in at and submission.in_a_fork(assignment.name, exercise, source))
                    if error and exercise.name not in verdicts:
                        verdicts[exercise.name] = verdict_of(error, exercise)
                    sent[exercise.name] = wire.added(sent.get(exercise.name), slot.wire.get(i))
                else:
                    error = slot.run(i, source)
                    if error and exercise is None:  # before the first exercise: the parameters, say
                        failed = f"the notebook failed before this exercise: {error[0]}: " + (
                            error[1].splitlines() or [""])[0]
                        return {e.name: ("error", failed) for e in assignment.exercises}, {}
                if i in last:
                    verdicts.setdefault(exercise.name, ("passed", ""))
                    if isinstance(own[exercise.name], tuple):  # the reference, for the later exercises
                        slot.run(i, assignment.solution.cells[exercise.cell].source)
        except Stopped as e:
            for ex in assignment.exercises:
                if ex.name in verdicts:
                    continue
                if ex is running:
                    verdicts[ex.name] = STOPPED[e.args[0]], why[e.args[0]]
                else:
                    verdicts[ex.name] = STOPPED[e.args[0]], f"not reached: {why[e.args[0]]} before it"
        finally:
            slot.close()
    return verdicts, {name: why for name, why in own.items() if isinstance(why, str)}, sent


def grade(student, path, params=(), seconds=600.0, memory_bytes=None):
    """The CSV rows (dicts) of one submission."""
    nb = read_notebook(path)
    assignment = submission.identify(nb) if not isinstance(nb, str) else None
    if assignment is None:
        message = nb if isinstance(nb, str) else "a notebook of no course assignment"
        return [dict(student=student, notebook=Path(path).name, exercise="", verdict="error", points=0,
                     max_points=0, message=message)]
    answers, tampered = submission.read_answers(nb, assignment)
    for exercise in assignment.exercises:  # an answer that patches what is around it: said by name
        answer = answers[exercise.name]
        if isinstance(answer, tuple):
            names, modules = submission.protected_names(assignment.solution, exercise.cell)
            found = submission.patches(answer[1], names, modules) - submission.patches(
                assignment.solution.cells[exercise.cell].source, names, modules)
            if found:
                tampered.setdefault(exercise.name, f"the answer {', '.join(sorted(found))}")
    attempted = {e.name: isinstance(answers[e.name], tuple) and submission.attempted(answers[e.name][0], e)
                 for e in assignment.exercises}
    runs = []
    if any(attempted.values()):  # the shipped copy, or one not started, needs no sandbox
        runs = [(p, *run_once(assignment, answers, p, seconds, memory_bytes)) for p in [None, *params]]
    rows = []
    for exercise in assignment.exercises:
        answer = answers[exercise.name]
        if isinstance(answer, str):
            verdict, message = "error", answer
        elif not attempted[exercise.name]:
            verdict, message = "not attempted", exercise.stubs[0].strip().split('("')[1].rstrip('")')
        else:
            verdict, message = "passed", ""
            for p, verdicts, refused, sent in runs:
                if exercise.name in refused:
                    verdict, message = "error", refused[exercise.name]
                    break
                if verdicts[exercise.name][0] == "passed" and sent.get(exercise.name) is not None:
                    more = wire.too_much(sent[exercise.name], reference_run(assignment, p)[1].get(exercise.name))
                    verdicts[exercise.name] = ("failed", more) if more else verdicts[exercise.name]
                if verdicts[exercise.name][0] != "passed":
                    verdict, message = verdicts[exercise.name]
                    message = f"with {p}: {message}" if p else message
                    break
        if exercise.name in tampered and verdict != "not attempted":
            verdict, message = "error", f"tampering: {tampered[exercise.name]}"
        rows.append(dict(student=student, notebook=assignment.name, exercise=exercise.name, verdict=verdict,
                         points=exercise.points if verdict == "passed" else 0, max_points=exercise.points,
                         message=message))
    return with_references_named(rows, assignment)


def with_references_named(rows, assignment):
    """Each row of an exercise whose cells use what an earlier exercise the student did not pass defines says that
    the reference was used instead (the earlier row has the student's own verdict)."""
    verdict = {row["exercise"]: row["verdict"] for row in rows}
    for k, exercise in enumerate(assignment.exercises):
        text = "\n".join(assignment.solution.cells[j].source for j in [exercise.cell, *exercise.checks])
        used = [e for e in assignment.exercises[:k] if verdict[e.name] != "passed" and any(
            re.search(rf"\b{re.escape(name)}\b", text)
            for name in submission.defined_names(assignment.solution.cells[e.cell].source))]
        if used and rows[k]["verdict"] != "not attempted":
            note = "; ".join(f"checked with the reference {e.name} (yours: {verdict[e.name]})" for e in used)
            rows[k]["message"] = f"{rows[k]['message']} ({note})" if rows[k]["message"] else note
    return rows


_references, _reference_lock = {}, threading.Lock()


def reference_run(assignment, params=None):
    """(seconds, {exercise: TCP segments its cells sent}) of the solution's own answers graded, in a slot like a
    student's: run once per assignment and parameters, in a sandbox no student code ran in."""
    with _reference_lock:
        if (assignment.name, params) not in _references:
            answers = {}
            for e in assignment.exercises:
                source = assignment.solution.cells[e.cell].source
                answers[e.name] = (source, source)
            start = time.monotonic()
            _, _, sent = run_once(assignment, answers, params, 3600, None)
            _references[assignment.name, params] = time.monotonic() - start, sent
        return _references[assignment.name, params]


def solution_seconds(assignment):
    """How long the solution's own answers take to grade: what the default time limit multiplies."""
    return reference_run(assignment)[0]


def gradescope(rows, folder):
    """One results.json per student, in Gradescope's autograder format."""
    by_student = collections.defaultdict(list)
    for row in rows:
        by_student[row["student"]].append(row)
    for student, mine in by_student.items():
        out = Path(folder) / student / "results.json"
        out.parent.mkdir(parents=True, exist_ok=True)
        gradescope_format.write_results(mine, out)


def summary(rows, hints=3):
    """Per exercise: how many passed, and the most common messages of those that did not."""
    lines, by_exercise = [], collections.defaultdict(list)
    for row in rows:
        by_exercise[(row["notebook"], row["exercise"])].append(row)
    for (notebook, exercise), mine in by_exercise.items():
        passed = sum(r["verdict"] == "passed" for r in mine)
        lines.append(f"{notebook} {exercise or '(not graded)'}: {passed}/{len(mine)} passed")
        common = collections.Counter(f"{r['verdict']}: {r['message']}" if r["message"] else r["verdict"]
                                     for r in mine if r["verdict"] != "passed")
        lines += [f"    {count} x {message}" for message, count in common.most_common(hints)]
    return "\n".join(lines)


def shard(items, spec):
    """Every N-th item from the K-th (spec "K/N", K from 1 to N)."""
    try:
        k, n = map(int, spec.split("/"))
    except ValueError:
        raise ValueError(f"--shard takes K/N, e.g. 1/4: got {spec!r}") from None
    if not 1 <= k <= n:
        raise ValueError(f"--shard K/N needs 1 <= K <= N: got {spec!r}")
    return items[k - 1::n]


def bundle(parser, args):
    """--gradescope-bundle NN ZIP: the autograder of notebook NN, its hidden arguments baked in."""
    name, out = args.gradescope_bundle
    matches = [a for a in submission.assignments() if a == name or a.split("_")[0] == name]
    if len(matches) != 1:
        parser.error(f"--gradescope-bundle: no single notebook {name!r} (one of {', '.join(submission.assignments())})")
    seconds = args.timeout
    if seconds is None:  # the autograder's time limit, from the solution's run here
        print(f"timing the solution of {matches[0]}...", file=sys.stderr)
        seconds = max(TIMEOUT_FLOOR, TIMEOUT_FACTOR * solution_seconds(submission.assignments()[matches[0]]))
    arguments = ["--timeout", f"{seconds:g}", "--memory", f"{args.memory:g}"]
    for p in args.params:
        arguments += ["--params", p]
    gradescope_format.bundle(matches[0], out, arguments)
    print(f"wrote {out}: Gradescope's autograder for {matches[0]} ({' '.join(arguments)})")
    return 0


def main(argv=None):
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("submissions", nargs="*", metavar="SUBMISSION", help="notebooks, or folders to search")
    parser.add_argument("--out", default="grades.csv", help="the CSV to write (default: grades.csv)")
    parser.add_argument("--timeout", type=float, help="seconds per submission and run (default: "
                        f"{TIMEOUT_FACTOR}x the solution's own run time, at least {TIMEOUT_FLOOR})")
    parser.add_argument("--memory", type=float, default=MEMORY_GB,
                        help=f"GB of resident memory per submission, its ranks included (default: {MEMORY_GB:g})")
    parser.add_argument("--jobs", type=int, default=os.cpu_count(), help="submissions run at once (default: cores)")
    parser.add_argument("--params", action="append", default=[], metavar="ASSIGNMENTS",
                        help='e.g. "WORLD_SIZE = 3": run again with these parameters (repeatable)')
    parser.add_argument("--gradescope", metavar="DIR", help="also write DIR/<student>/results.json")
    parser.add_argument("--gradescope-results", metavar="FILE", help="also write every row into one results.json "
                        "(the autograder's, grading one submission)")
    parser.add_argument("--gradescope-bundle", nargs=2, metavar=("NN", "ZIP"), help="write Gradescope's autograder "
                        "zip for notebook NN, with these --params, --timeout and --memory, and grade nothing")
    parser.add_argument("--shard", default="1/1", metavar="K/N", help="grade every N-th submission from the K-th")
    args = parser.parse_args(argv)
    if not args.submissions and not args.gradescope_bundle:
        parser.error("the following arguments are required: SUBMISSION")
    if args.jobs < 1 or (args.timeout is not None and args.timeout <= 0) or args.memory <= 0:
        parser.error("--jobs, --timeout and --memory must be positive")
    for p in args.params:
        try:
            compile(p, "--params", "exec")
        except SyntaxError as e:
            parser.error(f"--params {p!r} is not Python: {e.msg}")
    if args.gradescope_bundle:
        return bundle(parser, args)
    try:
        todo = shard(told_apart(collect(args.submissions)), args.shard)
    except ValueError as e:
        parser.error(str(e))

    if not sandbox.bwrap():
        print(f"warning: {sandbox.WARNING}", file=sys.stderr)
    timeouts = {}
    if args.timeout is None:  # the solution of each notebook graded, once, for its time limit
        for _, path in todo:
            a = assignment_of(path)
            if a and a.name not in timeouts:
                print(f"timing the solution of {a.name}...", file=sys.stderr)
                timeouts[a.name] = max(TIMEOUT_FLOOR, TIMEOUT_FACTOR * solution_seconds(a))

    def one(item):
        student, path = item
        a = assignment_of(path)
        seconds = args.timeout or timeouts.get(a.name if a else None, TIMEOUT_FLOOR)
        try:
            return grade(student, path, args.params, seconds, int(args.memory * 2**30))
        except Exception as e:  # the grader's own failure on this one: the class is still graded
            return [dict(student=student, notebook=Path(path).name, exercise="", verdict="error", points=0,
                         max_points=0, message=f"the grader failed: {type(e).__name__}: {e}")]

    rows, start = [], time.monotonic()
    with concurrent.futures.ThreadPoolExecutor(args.jobs) as pool:
        for done, result in enumerate(pool.map(one, todo), 1):
            rows += result
            print(f"\rgraded {done}/{len(todo)} in {time.monotonic() - start:.0f} s: {todo[done - 1][0]}/"
                  f"{Path(todo[done - 1][1]).name}", end="\033[K", file=sys.stderr)
    print(file=sys.stderr)
    with open(args.out, "w", newline="") as f:
        writer = csv.DictWriter(f, COLUMNS)
        writer.writeheader()
        writer.writerows(rows)
    if args.gradescope:
        gradescope(rows, args.gradescope)
    if args.gradescope_results:
        gradescope_format.write_results(rows, args.gradescope_results)
    print(summary(rows))
    return 0


if __name__ == "__main__":
    sys.exit(main())
