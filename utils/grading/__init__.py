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

What a rank measures (the inventory). These verdicts depend on a count taken in the process that runs the
student's code, not only on the values it computed:

    00 check_average_over_ranks        calls (intercept: one all_reduce, none unwaited)
    01 check_exchange                  calls and bytes handed to send (intercept; blocking order)
    01 check_ring, check_pipelined_ring   no collective called, bytes handed to isend, segments in flight
    02 check_micro_batches, check_overlapped_sync, check_bucketed_sync, check_matches_pytorch_ddp
                                       all_reduce calls, their sizes, start and wait times (intercept)
    03 check_all_gather_forward, check_parallel_regions, check_parallel_linear, check_tensor_parallel_mlp
                                       collective calls per forward and backward (record_communication)
    04 check_hand_offs, check_forward_backward   send/recv calls, peers and bytes (intercept)
    04, 11 check_naive_step, check_gpipe_step, check_one_f_one_b_step, check_interleaved_step, check_zb_h1_step,
       check_past_1f1b                 the recorded order of forwards, backwards and hand-offs, activations alive
                                       (autograd hooks and intercept in the rank)
    11 check_backward_split            backward calls autograd saw in B and W
    05 check_zero1, check_zero2, check_fsdp, check_memory, check_prefetch
                                       collective calls and sizes, bytes held at the peak (MemoryTracker)
    06 check_reduce_dtype, check_mixed_precision_fsdp   collective dtypes and sizes (intercept, MemoryTracker)
    06 check_recompute                 layer calls in forward and backward, bytes autograd saved
    07 check_redistribute, check_data_parallel, check_reshard, check_units
                                       collectives (intercept, functional collectives), gathered bytes alive
    09 check_blockwise_attention       score blocks computed (traced_blocks)
    09 check_ring_attention(_backward), check_zigzag   send/recv calls, peers, bytes, blocks computed
    09 check_sequence_parallel         collective calls and bytes, bytes saved for backward
    10 check_expert_data_parallel      collectives and groups used (intercept)
    12 check_fsdp_tensor_parallel, check_pipeline_3d, check_context_parallel_nd
                                       calls per group, peers, bytes held (communication_by_group, MemoryTracker)

Compute counts, one by one. Of the counts above, these say how the student's code computed (not what it sent).
For each: the count, the wrong answers it exists to catch, and whether the values the check compares show them.

    06 check_recompute        layer calls in forward and in backward (forward hooks), bytes autograd saved
                              (saved-tensor hooks). Catches no recomputation at all (a plain forward: no call in
                              backward, every activation saved), a block run once more in forward or recomputed
                              twice, the block's output kept as well. Values: the gradients are bit for bit the
                              same for all of them; so the check also doubles every weight between forward and
                              backward (in place, unseen by autograd), where a backward that recomputes meets the
                              new weights and one that kept the forward's activations the old: values that show
                              whether backward recomputes (not what forward saved, nor how often a layer ran).
    09 check_blockwise_attention   ra.block_attention's calls (traced): a block whose every key comes after every
                              query computed, a block larger than block_size squared. Values: the same (a hidden
                              block's out is 0 and its lse -inf: merged, it changes nothing).
    09 check_ring_attention(_backward), check_zigzag   blocks computed per rank and step (traced): a hidden block
                              computed, a visible one twice. Values: the same (a visible block missed does change
                              them). Zigzag's balance is not a count: it is judged from the positions
                              zigzag_positions returns, read here as data.
    11 check_backward_split   the backward calls autograd saw (hooks on the piece's input): a W that reaches the
                              input again (a full backward, or autograd.grad with the input among its inputs).
                              Values: the weights' gradients are the same (a full backward's x.grad is a value, but
                              one the rank's own code can clear).
    04, 11, 12 schedules      the recorded order of forwards and backwards and the activations alive at once
       (check_gpipe_step, check_one_f_one_b_step, check_interleaved_step, check_zb_h1_step, check_past_1f1b,
       check_pipeline_3d): GPipe's order passed off as 1F1B, the naive step as GPipe. Values: the same in the
                              course's model, whatever the order; so 04's GPipe and 1F1B and 11's interleaved and
                              ZB-H1 checks run one more step per micro-batch count with every layer chained to a
                              running state of its rank (checks.pipeline.chain_layers: each forward and each backward
                              of a layer, B and W each, scales its result by 1 + the state and sets the state from
                              that result), and compare each rank's gradients with a one-process replay of the
                              schedule's table (chained_reference): values that show each rank's order, since a
                              computation's scale is known only once the one its table puts before it has run (not
                              the activations alive, nor whether a send was an isend). 12's check_pipeline_3d
                              chains each stage's layers likewise for one more first step on its (2, 2, 1) mesh
                              (tensor parallel 1: each data rank's 1F1B replayed in one process,
                              chained_3d_gradients; not under torchrun, where that mesh does not run).
    05 check_memory, check_fsdp, check_prefetch, 06 check_mixed_precision_fsdp, 07 check_reshard, check_units,
       12 check_fsdp_tensor_parallel   bytes held at the peak by group, gathered units alive (MemoryTracker):
                              gathered weights never freed, a whole optimizer state kept, a prefetch too far ahead.
                              Values: the same; so 05's check_fsdp, 06's check_mixed_precision_fsdp and 07's
                              check_reshard also double every shard between step 0's forward and backward (in place,
                              unseen by autograd), where a backward that gathers the weights again meets the new ones
                              and one that kept the forward's (or a copy) the old: the inputs' gradients, and through
                              them the earlier layers' weight gradients, show whether backward gathered again (not
                              whether forward freed). 06's gathers in bf16 and is compared with the cast reference run
                              with its bf16 copy doubled so: a power of two commutes with the casts (bit for bit).
                              07's check_units cannot: FlatUnit gathers once per step and backward rightly uses what
                              forward gathered (autograd saves the views), so doubled shards leave an honest unit's
                              gradients those of the plain step too.
    09 check_sequence_parallel   bytes the norms save per rank (1/N of tensor parallel's): the norms run on the
                              gathered sequence. Values: the same.

The limits, and what is taken outside. The values a student's function computed are compared here; the counts
above are measured where the student's code runs, and that code can fake them: the communication calls and the
bytes handed to them (utils.intercept, utils.counting: a Python wrapper that code can remove, bypass by calling
the process group directly, or whose log it can edit through the frames or the garbage collector before the rank
reports), and every compute count. A pipe for that log would not help: the student's code holds every descriptor
of its process. Two measures are out of its reach, and two more were tried:

- The wire. What the kernel counts for the sandbox's network namespace a rank cannot lower, forks and sockets of
  its own included: the checking process reads it around every cell (utils.grading.wire), and an exercise whose
  check cells sent clearly more TCP segments than the solution's run of the same cells gets no credit. That
  catches communication a forged log hides (a ring built on dist.all_reduce, extra messages, a fork that talks);
  it cannot see a count moved from one call to another of the same size, nor any compute count.
- Values that show the method. 06's recompute doubles every weight between forward and backward: only a backward
  that recomputes meets the doubled weights, so a plain forward with forged counts gets the gradients wrong
  (tests/test_grading_compute_counts.py: the counters patched, their records edited through the garbage
  collector; an honest recompute, a slow one, one written another way, still pass). 04's, 11's and 12's schedules
  run one step with every layer chained to a running state of its rank that each forward and backward reads and sets
  from its result (see the inventory): the gradients then show each rank's order of computations, so GPipe's order
  (or the naive step) with its record edited to read as 1F1B (04's, 12's 3-D), GPipe, ZB-H1 or interleaved gets no
  credit; the same order written another way, or rounding otherwise, passes (tests/test_grading_compute_counts.py).
  The state is the rank's, and code can set it; but what to set it to is a value of the computation the table runs
  before, which needs that computation, and the hand-offs it waits for, to have run first: the table's order. What is
  left is the gap of forged messages: a rank can compute every rank's share itself (the model and the data are
  deterministic, and chained_reference is in utils/), send nothing and forge its calls; the wire counts fewer segments
  then, not more, which it does not catch. 05's FSDP, 06's mixed-precision FSDP and 07's reshard_after_forward double
  every shard between forward and backward, as 06's recompute its weights: one that kept the weights gathered in
  forward, a copy of them or the gathered weights with the bytes held and the calls edited, gets the gradients wrong
  (the same test file).
- Memory and CPU time from outside were tried and are not used. The sandbox's cgroup (memory.peak, cpu.stat would
  count every process a submission forks): bwrap has no option for it (0.8 has a cgroup namespace only), so the
  grader would create the cgroup and move the sandbox in; where the course is tested cgroup v2 is mounted with no
  controller (memory is a v1 hierarchy the host's own agent manages), and a Gradescope container's cgroups are
  not the grader's to create either. The rank's peak resident memory (VmHWM, wait4's ru_maxrss, read by its
  parent): the rank can lower it (writing 5 to /proc/self/clear_refs resets it: a 300 MB peak read back by wait4
  as 10 MB), a fork's memory is not the rank's, and at the checks' sizes (06: a batch of 24 rows of 16 features,
  4 layers, kilobytes of activations, against the 218 MB that importing torch takes) it cannot tell a recompute
  that saves everything from one that saves nothing.
  CPU time: the wrong methods cost almost nothing more (a hidden block costs ra.block_attention no score at all,
  it skips hidden pieces itself; 11's W reaching the input again costs one small matmul per layer, less than
  Python's overhead), and honest answers spread wider than that, so a limit on it would fail a slow honest answer
  before it caught a forger.

So these compute counts can still be forged, and what a forger gains is credit for that one exercise, never another's
or another student's, with code written to forge them, which a reader of the submission sees (the tests that show
each gap are xfail, strict, in tests/test_grading_compute_counts.py, so that a fix shows):

    06 check_recompute        what forward saved and how often a layer ran: a recompute that also keeps the block's
                              output, or runs the block once more in forward (backward must recompute: values). No
                              value shows either: the kept output is memory no later value reads (the doubled weights
                              make backward use the recomputed one), and a second forward computes the same numbers.
                              A layer with a side effect would count its runs (a running state each forward advances,
                              as the schedules' chain), but the state's right value after an extra forward is the one
                              before it, which the rank's code can save and put back as it edits a record (unlike the
                              schedules', which needs the values the table's order computes; only an effect outside
                              the rank, on the wire, could not be put back, and this check runs in one process); and
                              torch.utils.checkpoint advances such a state in another order than a recompute's
                              backward (it recomputes at the first saved tensor unpacked, after the chain's own
                              backward: measured, not bit for bit), so its reference would be one more replay. Not
                              built.
    09 check_blockwise_attention, check_ring_attention(_backward), check_zigzag   the hidden blocks: an answer
                              without the skip (ra.visible), or one computing a block twice, passes with its record
                              forged (the three forgers of the tests: the tracer bypassed through its closure, its
                              record edited through the garbage collector, the hidden blocks computed in a forked
                              child); so does plain attention computed whole by the student's own code, with calls
                              made up. No score more is computed by the first: ra.block_attention computes none of
                              a hidden block. Nor can a value show it: ra.block_attention reads nothing of a hidden
                              pair of pieces (its out 0 and lse -inf come from the positions alone), so no key or
                              value poisoned there changes a result (and every key block is visible to the later
                              queries); a block computed twice and merged once repeats the same numbers.
    11 check_backward_split   a W that reaches the input again (a full backward), its record edited: the split's
                              saving of the input's second gradient. No value: the weights' gradients are the same,
                              and the input's second gradient lands in x.grad, which the rank's code can clear.
    04, 11 schedules          the activations alive (a run in the table's order that keeps every micro-batch's
                              graph, its peak edited: the xfail test), and an isend that was a send (both read from
                              the rank's record; the chained run shows the order only). No value: when a graph is
                              freed changes no number computed, and a send hands over the same bytes as an isend.
    12 check_pipeline_3d      the activations alive likewise (its record's order is the only measure of them).
    05, 06, 07, 12 memory     bytes held (MemoryTracker), 09's bytes the norms save: FSDP that never frees its
                              gathered weights (05's check_fsdp, 06's check_mixed_precision_fsdp, 07's check_reshard:
                              only if it also gathers them again in backward and uses those, or watches its shard for
                              the check's doubling), a whole optimizer state, a prefetch too far ahead. 07's
                              check_units: a FlatUnit that leaves its views on the module past forward, or keeps its
                              shard as a view of the whole flat buffer, holds a whole unit longer and computes the
                              same values (its one gather per step is rightly kept for backward, so no doubling can
                              show it). 12's gathering and freeing are the library's (nd.FlatShards): no student code
                              to show. No value shows bytes held: a tensor kept alive changes no number computed.

Three checks once called the student's code in the checking process itself (an autograd Function run in one
process: 06's recompute, 09's blockwise attention, 11's B and W): they now run it in a rank of its own, which
returns tensors and counts, and compare here like the rest. Only a few cells after a check (demos that call an
autograd Function in their own process: submission.DEMOS_IN_A_FORK) run in a fork of the checking process, whose
outcome the student's code could forge: that gains nothing, since the exercise passes only if its check cell, run
here, passes too.

Isolation (sandbox): each run is a bubblewrap sandbox with the course's utils/ read-only, no solutions/ and no
other student's file or grade, a private /tmp, a working folder of its own, no capabilities, loopback-only
network, a PID namespace that dies with the run, and time and memory limits. Without bwrap, grading runs
unsandboxed, after a warning naming what is not isolated.
"""
