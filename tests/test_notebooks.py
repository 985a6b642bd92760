"""The notebook pipeline: student copies generated from the solutions and kept in sync, student
copies that stop exactly at the exercises, and every solution running under torchrun and with the
spawn start method."""
import contextlib
import io
import os
import subprocess
import sys
import time
import types

import nbformat
import pytest
from nbclient import NotebookClient
from nbformat.v4 import new_code_cell, new_markdown_cell, new_notebook, new_output

from utils import notebooks
from utils.notebooks import retry_kernel_start

ROOT = notebooks.ROOT
SOLUTIONS = sorted((ROOT / "solutions").glob("*.ipynb"))
NAMES = [p.name for p in SOLUTIONS]

EXERCISE = '''def f(x):
    # TODO: return x doubled.
    ### BEGIN SOLUTION
    y = 2 * x
    return y
    ### END SOLUTION


print(f(2))'''


def test_solution_region_becomes_not_implemented_at_its_indentation():
    assert notebooks.strip_solutions(EXERCISE) == '''def f(x):
    # TODO: return x doubled.
    raise NotImplementedError("f: your code goes here")


print(f(2))'''


def test_several_regions_and_top_level_regions():
    source = "### BEGIN SOLUTION\na = 1\n### END SOLUTION\ndef g():\n  ### BEGIN SOLUTION\n  pass\n  ### END SOLUTION"
    assert notebooks.strip_solutions(source) == (
        'raise NotImplementedError("exercise: your code goes here")\ndef g():\n'
        '  raise NotImplementedError("g: your code goes here")')


def test_a_region_is_named_after_the_function_it_sits_in_not_the_last_def_above_it():
    source = ("class Opt:\n    def step(self):\n        ### BEGIN SOLUTION\n        pass\n        ### END SOLUTION\n"
              "def schedule():\n    def forward():\n        pass\n    ### BEGIN SOLUTION\n    forward()\n"
              "    ### END SOLUTION")
    stubs = [line.strip() for line in notebooks.strip_solutions(source).splitlines() if "raise" in line]
    assert stubs == ['raise NotImplementedError("Opt.step: your code goes here")',
                     'raise NotImplementedError("schedule: your code goes here")']


@pytest.mark.parametrize("source", [
    "### BEGIN SOLUTION\nx = 1",                                   # never closed
    "x = 1\n### END SOLUTION",                                     # closed, never opened
    "### BEGIN SOLUTION\n### BEGIN SOLUTION\n### END SOLUTION",    # nested
])
def test_unbalanced_markers_are_an_error_naming_the_cell(source):
    with pytest.raises(ValueError, match="cell 3"):
        notebooks.strip_solutions(source, where="cell 3")


def small_solution():
    cell = new_code_cell(EXERCISE, outputs=[new_output("stream", name="stdout", text="4\n")], execution_count=1)
    cell.metadata["tags"] = ["mytag"]
    cell.metadata["execution"] = {"iopub.status.busy": "2026-01-01"}
    return new_notebook(cells=[new_markdown_cell("# Title\n### BEGIN SOLUTION stays in markdown"), cell])


def test_student_copy_drops_answers_outputs_and_counts_and_keeps_the_rest():
    student = notebooks.student_notebook(small_solution())
    markdown, code = student.cells
    assert markdown.source == "# Title\n### BEGIN SOLUTION stays in markdown"
    assert "2 * x" not in code.source and "NotImplementedError" in code.source
    assert code.outputs == [] and code.execution_count is None
    assert code.metadata == {"tags": ["mytag"]}


def run_cli(root, *args):
    """`python -m utils.notebooks --root root args...`, in this process (a subprocess per call cost seconds)."""
    output = io.StringIO()
    with contextlib.redirect_stdout(output):
        returncode = notebooks.main(["--root", str(root), *args])
    return types.SimpleNamespace(returncode=returncode, stdout=output.getvalue())


def test_check_fails_and_names_the_notebook_until_regenerated(tmp_path):
    (tmp_path / "solutions").mkdir()
    nbformat.write(small_solution(), tmp_path / "solutions" / "07_demo.ipynb")
    missing = run_cli(tmp_path, "--check")
    assert missing.returncode == 1 and "notebooks/07_demo.ipynb" in missing.stdout
    assert run_cli(tmp_path).returncode == 0
    assert run_cli(tmp_path, "--check").returncode == 0

    edited = small_solution()
    edited.cells[0].source = "# A new title"
    nbformat.write(edited, tmp_path / "solutions" / "07_demo.ipynb")
    stale = run_cli(tmp_path, "--check")
    assert stale.returncode == 1 and "notebooks/07_demo.ipynb" in stale.stdout

    run_cli(tmp_path)
    (tmp_path / "notebooks" / "08_orphan.ipynb").write_text("{}")
    orphan = run_cli(tmp_path, "--check")
    assert orphan.returncode == 1 and "notebooks/08_orphan.ipynb" in orphan.stdout


def test_repository_notebooks_are_in_sync_with_the_solutions():
    assert SOLUTIONS, "no solution notebooks found"
    assert notebooks.stale_notebooks() == [], "run `python -m utils.notebooks`"


@pytest.mark.parametrize("name", NAMES)
def test_every_solution_has_a_parameters_cell_with_the_world_size_from_the_environment(name):
    """papermill, torchrun, the hidden-value runs of utils.grade and an instructor set a notebook's values there."""
    cells = [c for c in nbformat.read(ROOT / "solutions" / name, as_version=4).cells
             if "parameters" in c.metadata.get("tags", [])]
    assert len(cells) == 1, f"{name}: {len(cells)} cells tagged 'parameters', not 1"
    assert 'WORLD_SIZE = int(os.environ.get("WORLD_SIZE", ' in cells[0].source, f"{name}: no WORLD_SIZE in it"


def test_script_export_drops_error_demos_and_refuses_magics():
    nb = new_notebook(cells=[new_code_cell("a = 1"), new_code_cell("raise ValueError"), new_markdown_cell("x")])
    nb.cells[1].metadata["tags"] = ["raises-exception"]
    nb.cells.append(new_code_cell("timed = 1"))
    nb.cells[-1].metadata["tags"] = ["nbval-ignore-output"]
    text = notebooks.script(nb, "demo.ipynb")
    assert "a = 1" in text and "ValueError" not in text and "timed = 1" in text
    assert "timed = 1" not in notebooks.script(nb, "demo.ipynb", timing=False)
    with pytest.raises(ValueError, match="magic"):
        notebooks.script(new_notebook(cells=[new_code_cell("%time 1")]), "demo.ipynb")


TIMING = notebooks.TIMING  # the timing cells: they run in the strict run and in the torchrun runs


def execute(path, skip_timing=False, **env):
    """Run a notebook top to bottom in a fresh kernel (with `env` added to its environment);
    return it with its outputs. Errors do not stop the run: they are in the outputs."""
    nb = nbformat.read(path, as_version=4)
    if skip_timing:
        nb.cells = [c for c in nb.cells if TIMING not in c.metadata.get("tags", [])]
    saved = {k: os.environ.get(k) for k in env}
    os.environ.update(env)
    try:
        retry_kernel_start(NotebookClient(nb, timeout=300, kernel_name="python3", allow_errors=True,
                                          resources={"metadata": {"path": str(path.parent)}}).execute)()
    finally:
        for k, v in saved.items():
            os.environ.pop(k) if v is None else os.environ.__setitem__(k, v)
    return nb


def test_a_kernel_that_dies_at_its_start_is_started_again_and_nothing_else_is_retried():
    """Two workers: the other's ranks may take a port jupyter_client picked for a kernel before the kernel binds it."""
    calls = []

    def start(fail):
        calls.append(fail)
        if len(calls) <= fail:
            raise RuntimeError("Kernel died before replying to kernel_info")
        return "kernel"

    assert retry_kernel_start(start)(2) == "kernel" and len(calls) == 3
    calls.clear()
    with pytest.raises(RuntimeError, match="died"):
        retry_kernel_start(start)(3)
    assert len(calls) == 3
    calls.clear()

    def broken():
        calls.append(0)
        raise RuntimeError("No such kernel named python4")

    with pytest.raises(RuntimeError, match="python4"):
        retry_kernel_start(broken)()
    assert len(calls) == 1


def errors(nb):
    """(cell index, 'Name: message') of the cells that failed, except those meant to fail."""
    return [(i, f"{e.ename}: {e.evalue}") for i, cell in enumerate(nb.cells) if (e := notebooks.first_error(cell))]


# Every student copy run top to bottom takes 95 s of the default run's 6 minutes: notebook 00's stays in it (the
# mechanism), the others run under pytest -m slow, as every solution's spawn and torchrun runs do.
STUDENT_RUNS = [name if name.startswith("00") else pytest.param(name, marks=pytest.mark.slow) for name in NAMES]


@pytest.mark.timeout(900)  # notebook 12's layout search alone takes minutes on a busy machine
@pytest.mark.parametrize("name", STUDENT_RUNS)
def test_student_notebook_fails_only_at_the_exercises(name):
    """Run the student copy as a student would: the only errors are the exercises' NotImplementedError
    (surfacing in their check cells) and the cells that demonstrate an error on purpose. (Its timing cells are
    the solution's, run by the strict nbval run.)"""
    nb = execute(ROOT / "notebooks" / name, skip_timing=True)
    exercises = sum("NotImplementedError(" in c.source for c in nb.cells if c.cell_type == "code")
    failed = errors(nb)
    for i, text in failed:
        assert "NotImplementedError" in text, f"{name} cell {i} fails for another reason: {text[:300]}"
    assert len(failed) >= exercises > 0


@pytest.mark.slow
@pytest.mark.timeout(900)
@pytest.mark.parametrize("name", NAMES)
def test_solution_runs_with_the_spawn_start_method_on_two_ranks(name):
    """Every cell, every check, with WORLD_SIZE=2 instead of the stored run's value (no errors allowed), on the
    macOS path: every function the notebook sends to its ranks must survive pickling by value. The timing
    cells run too (they take 2 ranks whatever WORLD_SIZE is). Slow: it repeats the whole notebook, which would
    add two minutes to the default run."""
    failed = errors(execute(ROOT / "solutions" / name, SPAWN_START_METHOD="spawn", WORLD_SIZE="2"))
    assert not failed, f"{name}: {failed[0][1][:2000]}"


@pytest.mark.slow
@pytest.mark.parametrize("nproc", [2, 4])
@pytest.mark.parametrize("name", NAMES)
def test_solution_runs_as_a_script_under_torchrun(name, nproc, tmp_path):
    """Every cell as a script under torchrun, the timing cells included, on 2 ranks and on the notebook's default 4:
    in one process a rank meets every call's sizes (07's compiled step, timed at other sizes, once recompiled with
    symbolic shapes and failed on 2 ranks only). (tests/test_launch.py's torchrun test of spawn itself is slow
    too.)"""
    script = tmp_path / name.replace(".ipynb", ".py")
    assert notebooks.main(["--script", str(ROOT / "solutions" / name), "-o", str(script)]) == 0
    run = subprocess.run([sys.executable, "-m", "torch.distributed.run", "--standalone",
                          f"--nproc_per_node={nproc}", str(script)],  # TMPDIR: torchrun's log folder too
                         capture_output=True, text=True, timeout=300, cwd=tmp_path,
                         env={**os.environ, "TMPDIR": str(tmp_path)})
    assert run.returncode == 0, run.stdout[-3000:] + run.stderr[-3000:]


@pytest.mark.slow
@pytest.mark.timeout(900)  # minutes per notebook, more on a busy machine
@pytest.mark.parametrize("name", NAMES)
def test_solution_passes_strict_nbval_with_the_spawn_start_method(name):
    """The stored outputs, to the letter, with ranks started by spawn (minutes: marked slow). Every cell: `-m ''` (the
    default run's `-m 'not slow'` leaves out the cells tagged `slow`, compared only here, and the timing cells)."""
    run = subprocess.run([sys.executable, "-m", "pytest", "-q", "-m", "", f"solutions/{name}"],
                         capture_output=True, text=True, timeout=900, cwd=ROOT,
                         env={**os.environ, "SPAWN_START_METHOD": "spawn"})
    assert run.returncode == 0, run.stdout[-5000:]


def test_interrupting_the_kernel_stops_the_ranks_and_the_next_cell_works(tmp_path):
    """The stop button in Jupyter: the ranks of the interrupted cell must not outlive it."""
    from jupyter_client.manager import start_new_kernel

    manager, client = retry_kernel_start(start_new_kernel)(kernel_name="python3", cwd=str(tmp_path))
    try:
        stuck = (f"import os, time\nfrom utils.launch import spawn\n"
                 f"def stuck(rank, world_size):\n"
                 f"    open(os.path.join({str(tmp_path)!r}, f'{{os.getpid()}}.pid'), 'w').close()\n"
                 f"    time.sleep(60)\n"
                 f"spawn(stuck, 2)")
        msg_id = client.execute(stuck)
        for _ in range(200):
            if len(list(tmp_path.glob("*.pid"))) == 2:
                break
            time.sleep(0.05)
        pids = [int(p.stem) for p in tmp_path.glob("*.pid")]
        assert len(pids) == 2, "the ranks did not start"
        manager.interrupt_kernel()
        reply = client.get_shell_msg(timeout=30)
        while reply["parent_header"].get("msg_id") != msg_id:
            reply = client.get_shell_msg(timeout=30)
        assert reply["content"]["status"] == "error" and reply["content"]["ename"] == "KeyboardInterrupt"
        for pid in pids:
            with pytest.raises(ProcessLookupError):
                os.kill(pid, 0)
        for _ in range(5):  # ipykernel 7 aborts requests until it has handled a marker it posts after an error:
            # one sent right after the error's reply can arrive first and come back "aborted", never run
            reply = client.execute_interactive("assert spawn(lambda r, w: r * 10, 2) == [0, 10]", timeout=60)
            if reply["content"]["status"] != "aborted":
                break
            time.sleep(0.2)
        assert reply["content"]["status"] == "ok"
    finally:
        client.stop_channels()
        manager.shutdown_kernel(now=True)



@pytest.mark.parametrize("paths, workers", [(["tests/test_handouts.py"], 0),  # two workers: 6 s, in the slow run
                                            pytest.param(["tests/test_handouts.py", "tests/test_layout.py"], 2,
                                                         marks=pytest.mark.slow)])
def test_a_single_file_runs_in_this_process_and_several_on_two_workers(paths, workers):
    """utils.pytest_plugin's worker count must win over xdist's own (one per core), which pytest asks first unless
    told: a student checking one notebook would wait for two workers to start. (Files that import no torch: each
    worker imports what it collects.)"""
    run = subprocess.run([sys.executable, "-m", "pytest", "-k", "rule or a_cycle_is_found", *paths], cwd=ROOT,
                         capture_output=True, text=True, timeout=120)
    assert run.returncode == 0, run.stdout[-2000:]
    assert ("workers" not in run.stdout) if workers == 0 else (f"created: {workers}/{workers} workers" in run.stdout)
