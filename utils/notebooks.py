"""The student notebooks are generated from the solutions; a notebook also exports as a script.

    python -m utils.notebooks              write notebooks/NN_*.ipynb from solutions/NN_*.ipynb
    python -m utils.notebooks --check      exit 1, naming the notebook, when notebooks/ is stale
    python -m utils.notebooks --script solutions/00_setup.ipynb
                                           write build/00_setup.py, to run under torchrun

    solution("02_data_parallel").average_gradients       the solution's own code, for the tests
    retry_kernel_start(start)                            a kernel start that lost its port race, tried again
    first_error(cell)                                    an executed cell's error, unless it fails on purpose

In a solution, an exercise's answer sits between `### BEGIN SOLUTION` and `### END SOLUTION`
(nbgrader's markers). The student copy replaces each region by `raise NotImplementedError(...)`
at the region's indentation and drops every output; everything else is kept as it is.
"""
import argparse
import ast
import copy
import functools
import json
import linecache
import re
import sys
import types
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
BEGIN, END = "### BEGIN SOLUTION", "### END SOLUTION"
DEF = re.compile(r"^(\s*)(?:def|class) (\w+)\b")
# Cells that demonstrate an error: in a script the first one would end the run.
SKIP_IN_SCRIPT = "raises-exception"
TIMING = "nbval-ignore-output"  # the timing cells (their outputs differ run to run)


def split_solutions(source, where="cell"):
    """A cell's source cut at its solution regions: (outside, regions), where outside[k] are the lines before
    region k (outside[-1] those after the last) and regions[k] is (the student copy's stub line, the answer's
    lines between the markers). The stub is a NotImplementedError naming the function (or method, or nested
    function) the region sits in."""
    outside, regions, inside, scopes = [[]], [], False, []  # scopes: (indentation, name) of the defs and classes above
    for line in source.splitlines():
        marker = line.strip()
        if marker.startswith(BEGIN):
            if inside:
                raise ValueError(f"{where}: '{BEGIN}' inside another solution region")
            inside = True
            indent = line[: len(line) - len(line.lstrip())]
            exercise = ".".join(name for depth, name in scopes if depth < len(indent)) or "exercise"
            regions.append((f'{indent}raise NotImplementedError("{exercise}: your code goes here")', []))
        elif marker.startswith(END):
            if not inside:
                raise ValueError(f"{where}: '{END}' without '{BEGIN}'")
            inside = False
            outside.append([])
        elif inside:
            regions[-1][1].append(line)
        else:
            outside[-1].append(line)
            if m := DEF.match(line):
                scopes = [(depth, name) for depth, name in scopes if depth < len(m[1])] + [(len(m[1]), m[2])]
    if inside:
        raise ValueError(f"{where}: '{BEGIN}' is never closed by '{END}'")
    return outside, regions


def join_regions(outside, answers):
    """The inverse of split_solutions: the lines outside, with answers[k] (a list of lines) in region k."""
    lines = list(outside[0])
    for answer, after in zip(answers, outside[1:]):
        lines += answer + after
    return "\n".join(lines)


def strip_solutions(source, where="cell"):
    """Replace each solution region of a cell's source by a NotImplementedError naming the function it sits in."""
    outside, regions = split_solutions(source, where)
    return join_regions(outside, [[stub] for stub, _ in regions])


def student_notebook(solution, name="notebook"):
    """The student's copy of a solution notebook: answers replaced, outputs and counts cleared."""
    nb = copy.deepcopy(solution)
    for i, cell in enumerate(nb.cells):
        cell.metadata.pop("execution", None)
        if cell.cell_type == "code":
            cell.source = strip_solutions(cell.source, where=f"{name}, cell {i}")
            cell.outputs, cell.execution_count = [], None
    return nb


def read(path):
    """A notebook file as nbformat's node. (nbformat is imported here, not at the top: a kernel that only calls
    solution() should not pay for it, 1.5 s with the IRI grammar jsonschema builds on import.)"""
    import nbformat
    return nbformat.read(path, as_version=4)


def render(nb):
    import nbformat
    return nbformat.writes(nb) + "\n"


def expected_notebooks(root=ROOT):
    """{path of a student notebook: the text it should have}, from root/solutions."""
    return {root / "notebooks" / path.name:
            render(student_notebook(read(path), name=str(path.relative_to(root))))
            for path in sorted((root / "solutions").glob("*.ipynb"))}


def stale_notebooks(root=ROOT):
    """Student notebooks that are missing, out of date, or have no solution."""
    expected = expected_notebooks(root)
    stale = [p for p, text in expected.items() if not p.exists() or p.read_text() != text]
    stale += [p for p in sorted((root / "notebooks").glob("*.ipynb")) if p not in expected]
    return stale


def write_notebooks(root=ROOT):
    (root / "notebooks").mkdir(exist_ok=True)
    written = []
    for path, text in expected_notebooks(root).items():
        if not path.exists() or path.read_text() != text:
            path.write_text(text)
            written.append(path)
    return written


def script(nb, source_name, timing=True):
    """The notebook's code as plain Python, without the cells that demonstrate an error (and without the
    timing cells, if not `timing`)."""
    parts = [f"# Generated from {source_name} by `python -m utils.notebooks --script`.\n"
             f"# Run: torchrun --standalone --nproc_per_node=2 <this file>\n"]
    skip = {SKIP_IN_SCRIPT} | (set() if timing else {TIMING})
    for i, cell in enumerate(nb.cells):
        if cell.cell_type != "code" or skip & set(cell.metadata.get("tags", [])):
            continue
        if any(line.lstrip().startswith(("%", "!")) for line in cell.source.splitlines()):
            raise ValueError(f"{source_name}, cell {i}: IPython magics do not run as a script")
        parts.append(f"# %% cell {i}\n{cell.source}\n")
    return "\n".join(parts)


def first_error(cell):
    """A code cell's first error output (its ename, evalue, traceback), or None: None too for a cell tagged
    raises-exception (it fails on purpose)."""
    if SKIP_IN_SCRIPT in cell.metadata.get("tags", []):
        return None
    return next((o for o in cell.get("outputs", []) if o.output_type == "error"), None)


DEFINITIONS = (ast.Import, ast.ImportFrom, ast.FunctionDef, ast.ClassDef)


def solution(name, replace=None, root=ROOT):
    """A solution notebook's definitions as a module: its imports, functions and classes, and the
    assignments of its `parameters` cell; nothing that runs ranks or checks.

    The tests take the right answers from here, so that an exercise is written once. A wrong answer
    is a small edit of the right one: `replace={old: new}` edits the source first, and each `old` must
    occur exactly once in the notebook (a test whose edit no longer applies fails, naming it). Each
    call builds a new module: functions defined in it travel to the ranks by value."""
    path = root / "solutions" / f"{name}.ipynb"
    cells = [c for c in json.loads(path.read_text())["cells"] if c["cell_type"] == "code"]
    sources = ["".join(c["source"]) for c in cells]
    for old, new in (replace or {}).items():
        found = sum(source.count(old) for source in sources)
        if found != 1:
            raise ValueError(f"{path.name}: the text to replace occurs {found} times, not once: {old!r}")
        sources = [source.replace(old, new) for source in sources]
    module = types.ModuleType(f"solution_{name}")  # not in sys.modules: cloudpickle ships its functions by value
    for i, (cell, source) in enumerate(zip(cells, sources)):
        keep = "parameters" in cell["metadata"].get("tags", [])
        tree = ast.parse(source)
        tree.body = [node for node in tree.body if keep or isinstance(node, DEFINITIONS)]
        filename = f"<{path.name}, cell {i}>"
        linecache.cache[filename] = (len(source), None, source.splitlines(keepends=True), filename)
        exec(compile(tree, filename, "exec"), module.__dict__)
    return module


KERNEL_STARTS = 3
KERNEL_DIED = "died before replying"  # jupyter_client's RuntimeError: "Kernel died before replying to kernel_info"


def retry_kernel_start(start):
    """`start` (which starts a kernel and waits for its first reply), tried up to KERNEL_STARTS times if the kernel
    dies first. jupyter_client picks a kernel's five TCP ports by binding port 0 and closing the socket; until the
    kernel binds them, any process may take one (two pytest workers: the other's ranks, whose gloo connections take
    ephemeral ports), and the kernel dies with "Address already in use". A new start picks new ports."""
    @functools.wraps(start)
    def start_again_if_it_died(*args, **kwargs):
        for attempt in range(1, KERNEL_STARTS + 1):
            try:
                return start(*args, **kwargs)
            except RuntimeError as e:
                if KERNEL_DIED not in str(e) or attempt == KERNEL_STARTS:
                    raise
    return start_again_if_it_died


def main(argv=None):
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--check", action="store_true", help="exit 1 if notebooks/ is out of date")
    parser.add_argument("--script", metavar="NOTEBOOK", help="export NOTEBOOK as a Python script")
    parser.add_argument("-o", "--output", help="where --script writes (default: build/NAME.py)")
    parser.add_argument("--no-timing", action="store_true", help="with --script: leave out the timing cells")
    parser.add_argument("--root", type=Path, default=ROOT, help=argparse.SUPPRESS)  # for tests
    args = parser.parse_args(argv)
    root = args.root.resolve()
    if args.script:
        source = Path(args.script)
        out = Path(args.output) if args.output else root / "build" / (source.stem + ".py")
        out.parent.mkdir(parents=True, exist_ok=True)
        out.write_text(script(read(source), source.name, timing=not args.no_timing))
        print(out)
        return 0
    if args.check:
        stale = stale_notebooks(root)
        for path in stale:
            print(f"{path.relative_to(root)} is out of date: run `python -m utils.notebooks`")
        return 1 if stale else 0
    for path in write_notebooks(root):
        print(f"wrote {path.relative_to(root)}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
