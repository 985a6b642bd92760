"""A submission read against the course: which notebook it is, the student's answers, and what they may run.

    assignments()                          the course's notebooks, each with its exercises
    identify(nb)                           the assignment a notebook is a copy of (from its cells), or None
    read_answers(nb, assignment)           each exercise's answers, or why they cannot be read
    own_answer(answer, exercise, source)   the solution's cell with the student's answers in its regions, and the
                                           functions that hold them; or why it is not checked
    answer_outside_functions(graded, ...)  what a graded cell would run outside those functions (refused)

An exercise is a solution cell with regions (`### BEGIN SOLUTION` ... `### END SOLUTION`); its checks are the
code cells after it, up to the next exercise (the timing cells left out: they measure, they do not check; the
cells that fail on purpose are left out of the graded run, as of the torchrun script).
Only the answers come from a submission: the lines between the student copy's lines around each region (the
`# TODO:` line above, the code below). Every other cell comes from solutions/.
"""
import ast
import dataclasses
import difflib
import functools
import re

from utils.notebooks import BEGIN, ROOT, SKIP_IN_SCRIPT, TIMING, read, split_solutions, student_notebook

SKIPPED = {TIMING, SKIP_IN_SCRIPT}  # cells a graded run leaves out
# Exercises with cells after their check (demos, measurements) that call the student's functions in the very process
# that runs them (an autograd Function run in one process): those cells run in a fork of the checking process
# (utils.grading.runner.run_in_fork), whose outcome the student's code could forge. That gains nothing: the
# exercise passes only if its check cell (the one calling a check_ function, which runs the student's code in ranks
# and compares in the checking process) passes too, and a fork's definitions stay in the fork.
DEMOS_IN_A_FORK = {"06_mixed_precision": {"Recompute"}, "09_context_parallel": {"blockwise_attention"}}
MATCH = 0.5  # the share of a course cell's (or notebook's) lines a submission must have to be its copy


@dataclasses.dataclass
class Exercise:
    name: str        # the functions (or classes) its regions sit in
    cell: int        # its cell in the solution notebook
    checks: list     # the indexes of its check cells
    points: float
    stubs: list      # the student copy's NotImplementedError line of each region


@dataclasses.dataclass
class Assignment:
    name: str
    solution: object  # the solution notebook
    student: object   # its student copy
    exercises: list

    @functools.cached_property
    def lines(self):
        return lines_of(self.student.cells)


def lines_of(cells):
    return {line.strip() for cell in cells for line in cell.source.splitlines() if line.strip()}


def is_code(cell):
    return cell.cell_type == "code"


def exercises_of(solution):
    at = [i for i, cell in enumerate(solution.cells) if is_code(cell) and split_solutions(cell.source)[1]]
    exercises = []
    for k, i in enumerate(at):
        end = at[k + 1] if k + 1 < len(at) else len(solution.cells)
        checks = [j for j in range(i + 1, end)
                  if is_code(solution.cells[j]) and not SKIPPED & set(solution.cells[j].metadata.get("tags", []))]
        stubs = [stub for stub, _ in split_solutions(solution.cells[i].source)[1]]
        names = dict.fromkeys(stub.split('NotImplementedError("')[1].split(":")[0].split(".")[0] for stub in stubs)
        points = next((solution.cells[j].metadata["nbgrader"]["points"] for j in [i, *checks]
                       if "points" in solution.cells[j].metadata.get("nbgrader", {})), 1)
        exercises.append(Exercise(", ".join(names), i, checks, points, stubs))
    return exercises


@functools.cache
def assignments(root=ROOT):
    found = {}
    for path in sorted((root / "solutions").glob("*.ipynb")):
        solution = read(path)
        found[path.stem] = Assignment(path.stem, solution, student_notebook(solution), exercises_of(solution))
    return found


def identify(nb, root=ROOT):
    """The assignment whose student copy shares the most of its lines with nb (at least MATCH of them), or None."""
    lines = lines_of(nb.cells)
    share = {name: len(a.lines & lines) / len(a.lines) for name, a in assignments(root).items()}
    best = max(share, key=share.get)
    return assignments(root)[best] if share[best] >= MATCH else None


def answer_spans(template, stubs, lines):
    """Where each region's answer sits in a submitted cell's `lines`: [(first template line replaced, last + 1,
    first submitted line, last + 1)], one per region, matching the template (the student copy's cell) line by line
    around each stub. Raises ValueError naming what does not match."""
    stub_at = [i for i, line in enumerate(template) if line in stubs]
    matcher = difflib.SequenceMatcher(None, [t.rstrip() for t in template], [u.rstrip() for u in lines],
                                      autojunk=False)
    found = {a + i: b + i for a, b, n in matcher.get_matching_blocks() for i in range(n)}
    spans = []
    for k, at in enumerate(stub_at):
        low = stub_at[k - 1] if k else -1
        high = stub_at[k + 1] if k + 1 < len(stub_at) else len(template)
        before = max((t for t in range(low + 1, at) if t in found), default=None)
        after = min((t for t in range(at + 1, high) if t in found), default=None)
        if before is None:
            if k or any(template[:at]):
                raise ValueError(f"the lines above {stub_name(template[at])} are not there")
            before, ub = -1, -1
        else:
            ub = found[before]
        if after is None:
            if k + 1 < len(stub_at) or any(t.strip() for t in template[at + 1:]):
                raise ValueError(f"the lines below {stub_name(template[at])} are not there")
            after, ua = len(template), len(lines)
        else:
            ua = found[after]
        for t in [*range(before + 1, at), *range(at + 1, after)]:  # edited by the student: a comment at most
            if template[t].strip() and not template[t].lstrip().startswith("#"):
                raise ValueError(f"the code around {stub_name(template[at])} differs: {template[t].strip()!r}")
        spans.append((before + 1, after, ub + 1, ua))
    return spans


def stub_name(stub):
    return stub.split('NotImplementedError("')[1].split(":")[0]


def read_answers(nb, assignment):
    """{exercise: (the answer's cell source, graded: the solution's cell with the answers in its regions) or an
    error message}, and the check cells the submission edited or deleted, as {exercise: message}."""
    code = [cell.source for cell in nb.cells if is_code(cell)]
    answers, tampered, start = {}, {}, 0
    for exercise in assignment.exercises:
        template = assignment.student.cells[exercise.cell].source.splitlines()
        best, best_share = None, MATCH
        for i in range(start, len(code)):  # the cell most like the template, after the last exercise's
            matcher = difflib.SequenceMatcher(None, template, code[i].splitlines(), autojunk=False)
            share = sum(n for _, _, n in matcher.get_matching_blocks()) / len(template)
            if share >= best_share:
                best, best_share = i, share
        if best is None:
            answers[exercise.name] = "its cell is not in the submission (another version of the course?)"
            continue
        start = best + 1
        lines = code[best].splitlines()
        try:
            spans = answer_spans(template, exercise.stubs, lines)
        except ValueError as e:
            answers[exercise.name] = f"its answer could not be read ({e}): another version of the course?"
            continue
        graded, last = [], 0
        for t0, t1, u0, u1 in spans:
            graded += template[last:t0] + lines[u0:u1]
            last = t1
        answered = [line for t0, t1, u0, u1 in spans for line in lines[u0:u1]]
        answers[exercise.name] = ("\n".join(answered), "\n".join(graded + template[last:]))
        missing = [j for j in exercise.checks if assignment.solution.cells[j].source.strip() not in
                   {source.strip() for source in code}]
        if missing:
            tampered[exercise.name] = f"check cell {missing[0]} was edited or deleted in the submission"
    return answers, tampered


def in_a_fork(assignment, exercise, source):
    """Whether the check cell `source` of `exercise` runs in a fork of the checking process (DEMOS_IN_A_FORK)."""
    return exercise.name in DEMOS_IN_A_FORK.get(assignment, ()) and not re.search(r"\bcheck_\w+\(", source)


def attempted(answer, exercise):
    """False if the answer is the student copy's stubs, comments and blank lines."""
    kept = [line.strip() for line in answer.splitlines() if line.strip() and not line.strip().startswith("#")]
    return kept != [stub.strip() for stub in exercise.stubs]


RISKY_CALLS = {"setattr", "delattr", "globals", "vars", "exec", "eval", "compile", "__import__"}


def patches(source, protected, modules):
    """What a cell does to the notebook around it: the protected names it binds at the top level (or declares
    global), the attributes of `modules` (or of what it imports) it sets or deletes, the risky builtins it calls."""
    try:
        tree = ast.parse(source)
    except SyntaxError:
        return set()  # the run says so
    found, imported = set(), set(modules)
    for node in ast.walk(tree):
        if isinstance(node, (ast.Import, ast.ImportFrom)):
            imported |= {(a.asname or a.name).split(".")[0] for a in node.names}
    for node in tree.body:
        targets = node.targets if isinstance(node, ast.Assign) else [getattr(node, "target", None)]
        names = {t.id for t in targets if isinstance(t, ast.Name)}
        if isinstance(node, (ast.FunctionDef, ast.AsyncFunctionDef, ast.ClassDef)):
            names.add(node.name)
        found |= {f"rebinds {name}" for name in names & protected}
    for node in ast.walk(tree):
        if isinstance(node, ast.Global):
            found |= {f"declares {name} global" for name in set(node.names) & protected}
        targets = getattr(node, "targets", None) or [getattr(node, "target", None)]
        for target in targets:
            root = target
            while isinstance(root, (ast.Attribute, ast.Subscript)):
                root = root.value
            if isinstance(target, (ast.Attribute, ast.Subscript)) and isinstance(root, ast.Name) and (
                    root.id in imported):
                found.add(f"sets {ast.unparse(target)}")
        if isinstance(node, ast.Call) and isinstance(node.func, ast.Name) and node.func.id in RISKY_CALLS:
            found.add(f"calls {node.func.id}()")
        if isinstance(node, ast.Attribute) and node.attr == "modules" and ast.unparse(node.value) == "sys":
            found.add("uses sys.modules")
    return found


def protected_names(solution, but):
    """The names the solution notebook binds at the top level of its cells, except cell `but`; and those its
    imports bind (modules, whose attributes nobody should set)."""
    names, modules = set(), set()
    for i, cell in enumerate(solution.cells):
        if is_code(cell) and i != but:
            for node in ast.parse(cell.source).body:
                if isinstance(node, (ast.Import, ast.ImportFrom)):
                    bound = {(a.asname or a.name).split(".")[0] for a in node.names}
                    names |= bound
                    modules |= bound
                elif isinstance(node, (ast.FunctionDef, ast.AsyncFunctionDef, ast.ClassDef)):
                    names.add(node.name)
                elif isinstance(node, ast.Assign):
                    names |= {t.id for t in node.targets if isinstance(t, ast.Name)}
    return names, modules


def own_answer(answer, exercise, solution_source):
    """(the graded cell, the functions that hold the student's lines) if the student's answer is to be checked;
    else why not: None if not attempted or unreadable, a message if it runs code outside its functions."""
    if not isinstance(answer, tuple) or not attempted(answer[0], exercise):
        return None
    outside = answer_outside_functions(answer[1], solution_source)
    if outside:
        return f"tampering: {outside}"
    return answer[1], functions_with_answers(solution_source)[0]


def defined_names(source):
    """The names a cell binds at its top level (its functions, classes and assignments)."""
    names = set()
    for node in ast.parse(source).body:
        if isinstance(node, (ast.FunctionDef, ast.AsyncFunctionDef, ast.ClassDef)):
            names.add(node.name)
        elif isinstance(node, ast.Assign):
            names |= {t.id for t in node.targets if isinstance(t, ast.Name)}
    return names


def functions_with_answers(solution_source):
    """The functions whose bodies hold the solution cell's regions: "name" at the top level, "Class.name" in a
    class; and whether every region lies in one (an answer anywhere else would run when its cell is defined)."""
    tree = ast.parse(solution_source)
    regions = [n for n, line in enumerate(solution_source.splitlines(), 1) if line.strip() == BEGIN]
    found, inside = [], set()
    for node in tree.body:
        members = [(f"{node.name}.", m) for m in node.body] if isinstance(node, ast.ClassDef) else [("", node)]
        for prefix, member in members:
            if isinstance(member, (ast.FunctionDef, ast.AsyncFunctionDef)):
                held = {n for n in regions if member.lineno < n <= member.end_lineno}
                if held:
                    found.append(prefix + member.name)
                    inside |= held
    return found, inside == set(regions)


def skeleton(source, functions):
    """The cell's syntax tree, dumped, with the bodies of `functions` left out: what runs when the cell runs."""
    tree = ast.parse(source)
    for node in tree.body:
        members = [(f"{node.name}.", m) for m in node.body] if isinstance(node, ast.ClassDef) else [("", node)]
        for prefix, member in members:
            if isinstance(member, (ast.FunctionDef, ast.AsyncFunctionDef)) and prefix + member.name in functions:
                member.body = [ast.Pass()]
    return ast.dump(tree)


def answer_outside_functions(graded, solution_source):
    """None if the graded cell differs from the solution's only inside the functions that hold the answers; else
    what runs outside them (a line that left its function would run in the checking process)."""
    functions, contained = functions_with_answers(solution_source)
    if not contained:
        return "an answer outside any function: the grader cannot run it apart from the checks"
    try:
        if skeleton(graded, functions) == skeleton(solution_source, functions):
            return None
    except SyntaxError:
        return None  # the run says so: its cell fails
    return f"code outside {', '.join(functions)}: an answer goes inside the function it completes"
