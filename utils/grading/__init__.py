"""Grading a class that may cheat: `python -m utils.grade` (utils.grading.command).

    command     the command: submissions found, graded in parallel, rows to a CSV (and Gradescope)
    submission  a submission read against the course: its notebook, its answers, what they may run
    sandbox     one submission's checking process, in bubblewrap, bounded in time and memory
    runner      the checking process itself: runs the cells it is sent, reports how each ended

Why a verdict cannot be forged. Whatever shares a process with the student's code can be patched by it (print,
builtins, the check's globals, IPython's hooks, the verdict's own reporting), so the verdict is decided in a
process where no line of the student's runs: the checking process (runner). It runs the solution notebook's
cells, as the instructor has them, with three rules:

- An answer only defines. The student's lines are taken from their regions and put back into the solution's
  cell; the grader parses that cell (without running it) and refuses it unless it differs from the solution's
  only inside the functions that hold the regions (submission.answer_outside_functions): defining them runs none
  of the student's lines. Those functions are then guarded: called in the checking process (a check may call a
  constructor there, to see it refuse bad input, or divide gradients in place), they run in a fork of it, and
  only data comes back: what they returned or raised, the new values of the tensors they were given, the plain
  attributes they set.
- The student's code runs in the ranks. Every check starts ranks (forks of the checking process) that call the
  student's functions and report what they computed; the check compares in the checking process. What a rank
  reports is read as data only (runner.safe_load: tensors, containers, the course's classes; never a function or
  a callable of the rank's choosing), the checking process is not dumpable (a rank cannot ptrace it or write its
  memory), and the pipes that carry cells in and verdicts out are closed in every fork: a rank has no way to
  send the grader a verdict. An exception a check raises in the checking process is the verdict.
- The reference follows. Right after an exercise's checks, the solution's own cell runs again, so the later
  exercises' checks call the reference, not the student's earlier function: each exercise is graded on its own
  (a row says when its checks called a reference because the student's own earlier exercise did not pass). The
  reference reaches the checking process only then: a rank of an exercise cannot find its reference in the
  memory it inherits, and solutions/ is not in the sandbox at all.

The limits. The values a student's function computed are compared here; what a rank records about *how* it computed
them is measured in the process that runs the student's code, and that code can fake it: the communication calls
and the bytes handed to them (utils.intercept, utils.counting: installed before the student's code runs, but a
Python wrapper that code can remove, bypass by calling the process group directly, or whose log it can edit through
the frames or the garbage collector before the rank reports), the blocks 09's blockwise attention computed, the
layer calls and the bytes autograd saved in 06's recompute, the backward calls autograd saw in 11's B and W, the
memory a MemoryTracker saw. A pipe for that log would not help: the student's code holds every descriptor of its
process. What the kernel counts for a whole process (bytes written to its sockets, /proc/<pid>/io) a rank cannot
lower, but it can hand the work to a process it forks, and no check's verdict needs it today. So a student who
computes the right values can get credit for an exercise whose point is the method (a ring built on
dist.all_reduce, a recompute that saves every activation, blocks the mask hides computed anyway) by forging these
counts: that exercise's only, never another's or another student's, and only with code written to forge them,
which a reader of the submission sees. Three checks once called the student's code in the checking process itself
(an autograd Function run in one process: 06's recompute, 09's blockwise attention, 11's B and W): they now run it
in a rank of its own, which returns tensors and counts, and compare here like the rest. Only a few cells after a
check (demos that call an autograd Function in their own process: submission.DEMOS_IN_A_FORK) run in a fork of the
checking process, whose outcome the student's code could forge: that gains nothing, since the exercise passes only
if its check cell, run here, passes too.

Isolation (sandbox): each run is a bubblewrap sandbox with the course's utils/ read-only, no solutions/ and no
other student's file or grade, a private /tmp, a working folder of its own, no capabilities, loopback-only
network, a PID namespace that dies with the run, and time and memory limits. Without bwrap, grading runs
unsandboxed, after a warning naming what is not isolated.
"""
