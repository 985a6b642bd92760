"""Checks for notebook 09 (context parallel): the online-softmax merge, attention in blocks, ring attention's
forward and backward.

Every value is compared in float64 with plain attention over the whole sequence (utils.ring_attention's
reference, itself checked against torch's scaled_dot_product_attention). When a value is wrong, the check
computes what the usual mistakes would have produced on the same inputs and names the one that matches;
otherwise it says what differs and where. The ring's checks also look at how it ran (utils.intercept and a
traced block_attention): only sends and receives, every receive waited for, the next block's transfer in flight
while a block computes, no block computed that the causal mask hides entirely, and each rank's bytes.
"""
import contextlib

import torch

from utils import ring_attention as ra
from utils.checks import CHECK_TIMEOUT, TOLERANCE, close, confirmed, max_abs_diff, spawn_explaining_stalls
from utils.context_parallel import LEARNING_RATE, train_main, use_attention
from utils.intercept import COLLECTIVES, RECEIVES, SENDS, intercept
from utils.launch import RankError, apart, runnable_world_sizes, spawn
from utils.nd_parallel.communication import raised_in
from utils.transformer import (
    TransformerSizes,
    build_transformer,
    causal_self_attention,
    lm_loss,
    make_tokens,
    train_transformer_reference,
)

WORLD_SIZES = (2, 3, 4)


def _where(got, want, dim):
    """The positions (along `dim`) where got and want differ."""
    bad = ((got - want).abs() > TOLERANCE * max(1.0, want.abs().max().item())) | got.isnan()
    other = [d for d in range(got.dim()) if d != dim % got.dim()]
    rows = bad.any(dim=other) if other else bad
    return rows.nonzero().flatten().tolist()


# ---------------------------------------------------------------- the merge

BOTH_UNSEEN = "queries that see no key of either block"


def _same_attention(got, want):
    """close, where -inf (a query that sees no key) must be -inf too: out 0, lse -inf."""
    hidden = want == float("-inf")
    unseen_alike = bool((got[hidden] == float("-inf")).all())
    return unseen_alike and close(got.masked_fill(hidden, 0), want.masked_fill(hidden, 0))


def merge_cases():
    """(name, out_a, lse_a, out_b, lse_b, want_out, want_lse): two blocks of keys of one set of queries, merged."""
    cases = []
    for name, scale, mask_b in [("ordinary scores", 1.0, False), ("scores near 1000 (exp overflows)", 20.0, False),
                                ("a block no query sees", 1.0, True), (BOTH_UNSEEN, 1.0, True)]:
        q, k, v = ra.attention_inputs(2, 2, 5, 4, seed=11, scale=scale)
        k, v = k[..., :4, :], v[..., :4, :]
        q_positions, k_positions = torch.arange(5), torch.arange(4)
        # in the last case queries 0-2 see no key of the first block either (its keys are at 3-5): lse -inf twice
        shift, mask_a = (3, "causal") if name == BOTH_UNSEEN else (0, "none")
        a = ra.block_attention(q, k[..., :3, :], v[..., :3, :], q_positions, k_positions[:3] + shift, mask_a)
        if mask_b:  # the second block's keys come after every query: it contributes nothing
            b = ra.block_attention(q, k[..., 3:, :], v[..., 3:, :], q_positions, k_positions[3:] + 10, "causal")
            want = a
        else:
            b = ra.block_attention(q, k[..., 3:, :], v[..., 3:, :], q_positions, k_positions[3:], "none")
            want = ra.block_attention(q, k, v, q_positions, k_positions, "none")
        cases.append((name, *a, *b, *want))
    return cases


def _merge_mistakes(out_a, lse_a, out_b, lse_b):
    """What the usual wrong merges return: (out or lse candidate, which output, hint)."""
    lse = torch.logaddexp(lse_a, lse_b)
    wa, wb = torch.exp(lse_a - lse)[..., None], torch.exp(lse_b - lse)[..., None]
    return [
        ((out_a + out_b) / 2, "out", "the outputs are averaged: each block's weight is its share of the softmax's "
                                     "denominator, exp(lse_block - lse_merged), not 1/2"),
        (out_a + wb * out_b, "out", "the running output is not rescaled: its weight is exp(lse_running - "
                                    "lse_merged) too, since the denominator it was normalised by has grown"),
        (out_a * wb + out_b * wa, "out", "the weights are swapped: each output takes the weight of its own lse"),
        (out_a + out_b, "out", "the outputs are added: each is normalised by its own block's sum, so they need "
                               "weights exp(lse_block - lse_merged) that add up to 1"),
        (torch.maximum(lse_a, lse_b), "lse", "the merged lse is the running maximum: the log-sum-exp of both "
                                             "blocks is log(exp(lse_a) + exp(lse_b)), the max is only a shift that "
                                             "keeps exp from overflowing"),
        (lse_a, "lse", "the lse returned is the running one, not updated with the block's"),
        (lse_a + lse_b, "lse", "the lse's are added: the merged one is log(exp(lse_a) + exp(lse_b))"),
        (out_b, "out", "the block's out replaced the running one: combine the two, each weighted by exp(lse_block - "
                       "lse_merged)"),
        (out_a, "out", "the running out was returned unchanged: the block's out was never combined into it"),
        (torch.exp(lse_a)[..., None] * out_a + torch.exp(lse_b)[..., None] * out_b, "out",
         "the weights are exp(lse_block), not exp(lse_block - lse_merged): they must be each block's share of the "
         "merged denominator, adding up to 1 (and never exponentiate an lse itself: it overflows)"),
    ]


def check_merge(merge):
    """`merge(out, lse, block_out, block_lse) -> (out, lse)` of two blocks of keys equals attention over both."""
    for name, out_a, lse_a, out_b, lse_b, want_out, want_lse in merge_cases():
        got = merge(out_a.clone(), lse_a.clone(), out_b.clone(), lse_b.clone())
        if not (isinstance(got, tuple) and len(got) == 2):
            raise AssertionError(f"merge must return a pair (out, lse), got {type(got).__name__}")
        got_out, got_lse = got
        for value, want, what in [(got_out, want_out, "out"), (got_lse, want_lse, "lse")]:
            if not isinstance(value, torch.Tensor) or value.shape != want.shape:
                raise AssertionError(f"{name}: merge's {what} has shape {tuple(getattr(value, 'shape', ()))}, "
                                     f"expected {tuple(want.shape)} (out: (..., queries, head_dim), lse: "
                                     f"(..., queries))")
            if _same_attention(value, want):
                continue
            if value.isnan().any() or (value.isinf() & (want != float("-inf"))).any():
                raise AssertionError(
                    f"{name}: merge's {what} holds inf or NaN. " + (
                        "Exponentials of scores or lse's themselves overflow here: exponentiate differences "
                        "(exp(lse_block - lse_merged)), which are never above 0" if "1000" in name else
                        "A query that sees no key of either block has lse -inf on both sides: the merged lse is "
                        "-inf, so exp(lse - lse_merged) is exp(-inf + inf) = NaN; its weights must come out 0 "
                        "(out 0, lse -inf): subtract a finite shift, such as lse_merged clamped to the dtype's "
                        "lowest value, so that exp(-inf - finite) = 0" if name == BOTH_UNSEEN else
                        "A block no query sees has out 0 and lse -inf: its weight must come out 0, not NaN "
                        "(torch.logaddexp handles -inf; exp(-inf - finite) is 0)"))
            hint = confirmed(value, [(v, h) for v, which, h in _merge_mistakes(out_a, lse_a, out_b, lse_b)
                                      if which == what])
            raise AssertionError(f"{name}: merge's {what} differs from attention over both blocks by up to "
                                 f"{max_abs_diff(value, want):.3g}" + (f": {hint}" if hint else ""))
    print("merge: two blocks of keys merge into attention over both, also with scores near 1000, with a block no "
          "query sees, and with queries that see no key of either (out 0, lse -inf)")


# ---------------------------------------------------------------- attention in blocks, one process

@contextlib.contextmanager
def traced_blocks(calls, clock=lambda: None):
    """Within the block, ra.block_attention (and its backward) note each call's (kind, query positions, key
    positions, clock()) in `calls`."""
    forward, backward = ra.block_attention, ra.block_attention_backward

    def traced_forward(q, k, v, q_positions, k_positions, mask="causal"):
        calls.append(("forward", q_positions.tolist(), k_positions.tolist(), clock()))
        return forward(q, k, v, q_positions, k_positions, mask)

    def traced_backward(grad_out, q, k, v, out, lse, q_positions, k_positions, mask="causal"):
        calls.append(("backward", q_positions.tolist(), k_positions.tolist(), clock()))
        return backward(grad_out, q, k, v, out, lse, q_positions, k_positions, mask)

    ra.block_attention, ra.block_attention_backward = traced_forward, traced_backward
    try:
        yield calls
    finally:
        ra.block_attention, ra.block_attention_backward = forward, backward


def score_entries(calls, mask):
    """Score entries computed, and those of them in blocks the mask hides entirely."""
    total = sum(len(q) * len(k) for _, q, k, _ in calls)
    hidden = sum(len(q) * len(k) for _, q, k, _ in calls if not ra.visible(torch.tensor(q), torch.tensor(k), mask))
    return total, hidden


def _blockwise(q, k, v, block_size, mask, key_blocks, masked_positions, carried=False, lse_from=None):
    """Attention in blocks as a mistake computes it: `key_blocks(q_pos, k_pos)` says which blocks of keys a block of
    queries merges, `masked_positions(p)` which positions the mask is given; `carried`: the running (out, lse) not
    reset for each block of queries; `lse_from`: the running lse starts at this value (out at 0), not at the first
    block's."""
    positions, outs = torch.arange(q.shape[-2]), []
    out = lse = None
    for q_pos in positions.split(block_size):
        if not carried:
            out = lse = None
        if lse_from is not None:
            out, lse = torch.zeros_like(q[..., q_pos, :]), torch.full(q[..., q_pos, 0].shape, lse_from, dtype=q.dtype)
        for k_pos in positions.split(block_size):
            if key_blocks(q_pos, k_pos):
                block = ra.block_attention(q[..., q_pos, :], k[..., k_pos, :], v[..., k_pos, :],
                                           masked_positions(q_pos), masked_positions(k_pos), mask)
                out, lse = block if out is None else ra.merge_pieces(out, lse, *block)
        outs.append(out)
    return torch.cat(outs, dim=-2)


def _blockwise_mistakes(q, k, v, block_size, mask):
    unmasked = "the blocks were computed without the causal mask: pass the mask to block_attention"
    return [
        (ra.reference_attention(q, k, v, "none")[0], unmasked),
        (_blockwise(q, k, v, block_size, "none", lambda qp, kp: ra.visible(qp, kp, mask), lambda p: p), unmasked),
        (_blockwise(q, k, v, block_size, mask, lambda qp, kp: qp[0] == kp[0], lambda p: p),
         "each block of queries saw only its own block of keys: merge every block of keys it can see"),
        (_blockwise(q, k, v, block_size, mask, lambda qp, kp: ra.visible(qp, kp, mask), lambda p: p - p[0]),
         "the blocks were masked with positions counted from each block's start: a block's queries and keys keep "
         "their global positions (the mask compares them)"),
        (_blockwise(q, k, v, block_size, mask, lambda qp, kp: ra.visible(qp, kp, mask), lambda p: p, carried=True),
         CARRIED),
        (_blockwise(q, k, v, block_size, mask, lambda qp, kp: ra.visible(qp, kp, mask), lambda p: p, lse_from=0.0),
         "the running lse started at 0 (out at 0): that counts a score of 0 in every softmax, exp(0) = 1 more in "
         "its denominator; start from the first block's (out, lse), or from out 0 and lse -inf (a block no key of "
         "which is seen)"),
    ]


CARRIED = ("the running (out, lse) was not reset for each block of queries: a block of queries merged the blocks of "
           "keys of the blocks of queries before it too; start each block of queries afresh (out = lse = None)")


BLOCK_SIZES = (4, 5, 1, 12, 16)  # over 12 positions: dividing it, not, of 1, all of it, longer than it


def _blockwise_runs(rank, world_size, blockwise_attention, q, k, v):
    """In a rank of its own (the student's code runs nowhere else): per mask and block size, ("raised", the
    RuntimeError's message) or ("returned", (out, lse) or the type it returned instead, the blocks it computed)."""
    runs = []
    for mask in ra.MASKS:
        for block_size in BLOCK_SIZES:
            calls = []
            try:
                with traced_blocks(calls):
                    got = blockwise_attention(q.clone(), k.clone(), v.clone(), block_size, mask)
            except NotImplementedError:  # not attempted yet: said as such, as every exercise says it
                raise
            except RuntimeError as e:  # a library error inside the student's function: the check names its cause
                runs.append(("raised", str(e)))
                continue
            pair = isinstance(got, tuple) and len(got) == 2 and all(type(t) is torch.Tensor for t in got)
            runs.append(("returned", tuple(t.detach() for t in got) if pair else type(got).__name__,
                         [(kind, qp, kp) for kind, qp, kp, _ in calls]))
    return runs


def check_blockwise_attention(blockwise_attention):
    """Attention in blocks equals plain attention and SDPA: causal and not, block sizes that divide the sequence,
    that do not, of 1 and longer than it; no score computed in a block the causal mask hides entirely. The student's
    function runs in a rank of its own, which returns what it computed as data; the comparison runs here. The blocks
    it computed are counted in that rank (by ra.block_attention, traced there): code that computes the right values
    could lie about them, not about the values."""
    q, k, v = ra.attention_inputs(2, 2, 12, 4, seed=5)
    runs = iter(apart(_blockwise_runs, blockwise_attention, q, k, v, timeout=CHECK_TIMEOUT))
    for mask in ra.MASKS:
        want_out, want_lse = ra.reference_attention(q, k, v, mask)
        assert close(ra.sdpa(q, k, v, mask), want_out)  # the reference is PyTorch's attention
        for block_size in BLOCK_SIZES:
            case = f"block_size {block_size}, mask {mask!r}, sequence 12"
            how, got, *calls = next(runs)
            if how == "raised":
                raise AssertionError(f"{case}: blockwise_attention raised RuntimeError: {got.splitlines()[0]}" + (
                    f": {CARRIED}, and this block of queries has {12 % block_size} where the one before had "
                    f"{block_size}" if 12 % block_size and "size of tensor" in got else
                    ": each block of queries (q[..., q_pos, :]) meets each block of keys (k[..., k_pos, :]); merge "
                    "pieces of the same queries only"))
            if isinstance(got, str):
                raise AssertionError(f"{case}: blockwise_attention must return (out, lse), got {got}")
            (got_out, got_lse), calls = got, [(kind, qp, kp, None) for kind, qp, kp in calls[0]]
            if got_out.shape != want_out.shape:
                rows = got_out.shape[-2] if got_out.dim() >= 2 else "?"
                raise AssertionError(
                    f"{case}: out has shape {tuple(got_out.shape)}, expected {tuple(want_out.shape)}" + (
                        f": {12 - rows} positions are missing. A block size that does not divide the sequence "
                        f"leaves a shorter last block (torch.split makes it)" if isinstance(rows, int) and rows < 12
                        else ""))
            if not close(got_out, want_out):
                hint = confirmed(got_out, _blockwise_mistakes(q, k, v, block_size, mask))
                raise AssertionError(f"{case}: out differs from plain attention at positions "
                                     f"{_where(got_out, want_out, -2)}" + (f": {hint}" if hint else ""))
            if got_lse.shape != want_lse.shape or not close(got_lse, want_lse):
                raise AssertionError(f"{case}: out is right but lse differs from the log-sum-exp of each query's "
                                     f"scores: return the merged lse of every block of queries, in order")
            total, hidden = score_entries(calls, mask)
            if not calls:
                raise AssertionError(f"{case}: ra.block_attention was never called: compute each block with it")
            if hidden:
                raise AssertionError(f"{case}: {hidden} of the {total} score entries computed are in blocks whose "
                                     f"every key comes after every query: skip those blocks (ra.visible), they "
                                     f"contribute nothing")
            biggest = max(len(qp) * len(kp) for _, qp, kp, _ in calls)
            if biggest > block_size * block_size:
                raise AssertionError(f"{case}: a block of {biggest} score entries was computed: each block is at "
                                     f"most block_size queries x block_size keys")
    print("blockwise_attention: equals plain attention and scaled_dot_product_attention (out and lse, 1e-12), "
          "causal and not, block sizes 4, 5, 1, 12 and 16 over 12 positions; no hidden block computed")


# ---------------------------------------------------------------- ring attention

RING_SIZES = dict(batch=2, heads=2, head_dim=4)
CHUNK = 3  # positions per rank in the ring's checks; 4 (two chunks of 2) in zigzag's


def ring_inputs(seq_len, seed=7):
    """q, k, v and the gradient of the output, over the whole sequence."""
    s = RING_SIZES
    q, k, v = ra.attention_inputs(s["batch"], s["heads"], seq_len, s["head_dim"], seed)
    return q, k, v, ra.attention_inputs(s["batch"], s["heads"], seq_len, s["head_dim"], seed + 1)[0]


def _ring_main(rank, world_size, forward, backward, mask, positions):
    """One rank's run of the student's ring (forward, then backward if given) on its positions, traced: its results,
    and per phase its communication calls and block computations on one clock (the number of events so far)."""
    q, k, v, grad_out = (t[..., positions[rank], :].clone() for t in ring_inputs(sum(map(len, positions))))
    result = {}
    phases = [("forward", lambda: forward(q, k, v, positions, mask))]
    if backward is not None:
        phases.append(("backward", lambda: backward(grad_out, q, k, v, *result["forward"], positions, mask)))
    for phase, run in phases:
        events = []

        def clock():
            events.append(None)
            return len(events)

        calls = []
        with traced_blocks(calls, clock), intercept(clock=clock) as log:
            try:
                got = run()
            except Exception as e:  # a library's error inside the student's ring: said with its line and cause
                hint = next((h for words, h in RING_ERRORS if words in str(e)), "")
                raise AssertionError(f"rank {rank}: " + str(raised_in(f"ring_attention_{phase}", e, hint))) from e
        result[phase] = got
        result[phase + " log"] = [(c.name, c.nbytes, c.blocking, c.started_at, c.waited_at) for c in log]
        result[phase + " blocks"] = [(kp, t) for kind, _, kp, t in calls if kind == phase]
    return result


def _simulated_ring(q, k, v, positions, mask, variant):
    """Ring attention's out on every rank, in sequence order, as a usual mistake computes it (single process)."""
    world_size, out_by_position = len(positions), torch.empty_like(q)
    for rank, mine in enumerate(positions):
        out = lse = None
        if variant == "zero start":
            out, lse = torch.zeros_like(q[..., mine, :]), torch.zeros(q[..., mine, 0].shape, dtype=q.dtype)
        for step in range(world_size):
            source = (rank - step) % world_size
            held = (rank + step) % world_size if variant == "other direction" else source
            named = (step - rank) % world_size if variant == "step - rank" else source  # whose block it is taken for
            k_positions = mine if variant.startswith("own positions") else positions[named]
            if variant == "own block only" and step:
                continue
            seen = k_positions if variant == "own positions everywhere" else positions[named]
            if not (ra.visible(seen, mine, mask) if variant == "visibility reversed" else ra.visible(mine, seen, mask)):
                continue
            block = ra.block_attention(q[..., mine, :], k[..., positions[held], :], v[..., positions[held], :],
                                       mine, k_positions, mask)
            out, lse = block if out is None or variant == "replaced" else ra.merge_pieces(out, lse, *block)
        out_by_position[..., mine, :] = out
    return out_by_position


RING_MISTAKES = {
    "own block only": "only this rank's own block was merged: the blocks received from the other ranks never "
                      "reached the merge",
    "replaced": "each block replaced the running result instead of being merged into it",
    "own positions everywhere": "every block was masked with this rank's own positions: the block held at step s "
                                "came from rank (rank - s) mod N and has that rank's positions",
    "own positions": "every block was masked with this rank's own positions: the block held at step s came from "
                     "rank (rank - s) mod N and has that rank's positions",
    # a source computed as rank + s gives these very numbers (the same pairs of a block and positions, merged in
    # another order): the hint names both
    "other direction": "the blocks travel one way round the ring and their positions are taken for the other: "
                       "sending to rank + 1 and receiving from rank - 1, step s holds rank (rank - s) mod N's block; "
                       "either the source was taken as rank (rank + s) mod N, or the blocks were sent to rank - 1 "
                       "(on 2 ranks the two are the same rank, so only 3 or more show it)",
    "step - rank": "the block held at step s came from rank (rank - s) mod N, not (s - rank) mod N: its positions "
                   "were taken from the wrong rank (the two agree on rank 0, and on 2 ranks everywhere: only 3 or "
                   "more show it)",
    "visibility reversed": "ra.visible was asked with the keys' positions first: visible(q_positions, k_positions, "
                           "mask) takes this rank's queries' positions, then the block's keys' (positions[rank], "
                           "positions[source]); reversed, a rank skips the earlier blocks it sees and keeps the later",
    "zero start": "the running lse started at 0 (out at 0): that counts a score of 0 in every softmax, exp(0) = 1 more "
                  "in its denominator; start from the first block's (out, lse)",
}


def _protocol_problems(results, phase):
    """Calls the ring must not make, or receives never waited for (which make any value a matter of luck)."""
    for rank, result in enumerate(results):
        log = result[phase + " log"]
        used = sorted({name for name, *_ in log if name in COLLECTIVES})
        if used:
            return (f"rank {rank} calls dist.{used[0]} in the {phase}: ring attention passes blocks to its neighbour "
                    f"with isend/irecv (the all-gather version is section 7's)")
        unwaited = [name for name, _, _, _, waited in log if waited is None]
        if unwaited:
            return (f"rank {rank}'s {phase}: a {unwaited[0]} was never waited for: its buffer may be read (or reused) "
                    f"before the data has arrived (or left). Wait for every isend and irecv")
    return None


def _ring_run_problems(results, positions, mask, phase, kv_bytes):
    """What is wrong with how the ring ran (not its values), or None."""
    world_size = len(positions)
    for rank, result in enumerate(results):
        log, mine = result[phase + " log"], positions[rank]
        want = [positions[(rank - s) % world_size].tolist() for s in range(world_size)]
        want = [kp for kp in want if ra.visible(mine, torch.tensor(kp), mask)]
        got = [kp for kp, _ in result[phase + " blocks"]]
        hidden = [kp for kp in got if not ra.visible(mine, torch.tensor(kp), mask)]
        if hidden:
            return (f"rank {rank}'s {phase} computed {len(hidden)} block(s) whose every key comes after every query "
                    f"(keys at positions {hidden[0][0]}..{hidden[0][-1]}): skip them, they contribute nothing; the "
                    f"blocks still travel on")
        if sorted(got) != sorted(want):
            return (f"rank {rank}'s {phase} computed blocks of keys at positions {[(kp[0], kp[-1]) for kp in got]}: "
                    f"expected each visible block once, {[(kp[0], kp[-1]) for kp in want]}")
        receives = [(started, waited) for name, _, _, started, waited in log if name in RECEIVES]
        for _, t in result[phase + " blocks"][:-1]:  # after the last block's compute, nothing is left to fetch
            if not any(started < t < waited for started, waited in receives):
                return (f"rank {rank}'s {phase}: no transfer was in flight while a block computed: start the next "
                        f"block's isend/irecv before computing the current block, and wait for them after; a "
                        f"blocking recv (or a wait before the compute) leaves the link idle while the rank computes")
        sent = sum(nbytes for name, nbytes, *_ in log if name in SENDS)
        if sent != kv_bytes:
            return (f"rank {rank}'s {phase} sent {sent} bytes; the ring sends {kv_bytes} (see the formula above): "
                    f"{'more' if sent > kv_bytes else 'less'} than the blocks it must pass on")
    return None


def _raise(n, mask, problem):
    if problem:
        raise AssertionError(f"{n} ranks, mask {mask!r}: {problem}")


RING_ERRORS = [  # (words in the error, what in the student's ring usually causes it)
    ("must match the size", ": tensors of different shapes met: ra.block_attention_backward takes (grad_out, q, k, v, "
                            "out, lse, q_positions, k_positions, mask), out and lse the forward's, and returns (dq, "
                            "dk, dv); ra.block_attention takes (q, k, v, q_positions, k_positions, mask): check the "
                            "order of the arguments"),
]


def _spawn_ring(forward, backward, positions, mask, timeout):
    try:
        return _spawn_ring_ranks(forward, backward, positions, mask, timeout)
    except RankError as e:  # a rank's AssertionError (the student's function raised): said here
        if e.summary.startswith("AssertionError: "):
            raise AssertionError(e.summary.removeprefix("AssertionError: ")) from None
        raise


def _spawn_ring_ranks(forward, backward, positions, mask, timeout):
    return spawn_explaining_stalls(
        _ring_main, len(positions), forward, backward, mask, positions, timeout=timeout,
        hint=("the ring stalls: some rank waits for a block that never comes. Each rank sends to rank + 1 and "
              "receives from rank - 1, every step but the last (in the backward, the key/value gradients also travel "
              "at the last step, home to their owner); every isend and irecv must be waited for"),
        sizes="each receive buffer has the shape of the block its neighbour sends")


def kv_bytes_per_rank(world_size, chunk, dtype=torch.float64, backward=False):
    """What a rank sends: its keys and values, N-1 times; in the backward also their gradients, N times."""
    s = RING_SIZES
    kv = 2 * s["batch"] * s["heads"] * chunk * s["head_dim"] * torch.finfo(dtype).bits // 8
    return kv * (world_size - 1) + (kv * world_size if backward else 0)


def _ring_forward_checked(forward, positions, mask, timeout):
    """Run the student's forward on these positions and check it; return the runs."""
    n = len(positions)
    q, k, v, _ = ring_inputs(sum(map(len, positions)))
    results = _spawn_ring(forward, None, positions, mask, timeout)
    _raise(n, mask, _protocol_problems(results, "forward"))
    want_out, want_lse = ra.reference_attention(q, k, v, mask)
    for rank, result in enumerate(results):
        got, mine = result["forward"], positions[rank]
        if not (isinstance(got, tuple) and len(got) == 2):
            raise AssertionError(f"rank {rank}: ring_attention_forward must return (out, lse), "
                                 f"got {type(got).__name__}")
        got_out, got_lse = got
        want = want_out[..., mine, :]
        if got_out is None or got_out.shape != want.shape:
            raise AssertionError(f"{n} ranks, mask {mask!r}: rank {rank}'s out has shape "
                                 f"{tuple(getattr(got_out, 'shape', ()))}, expected {tuple(want.shape)} (its "
                                 f"queries' chunk)")
        if not close(got_out, want):
            everyone = torch.empty_like(q)
            for r, other in enumerate(results):
                everyone[..., positions[r], :] = other["forward"][0]
            fits = [h for variant, h in RING_MISTAKES.items()  # every mistake that gives these numbers, named
                    if confirmed(everyone, [(_simulated_ring(q, k, v, positions, mask, variant), h)])]
            hint = "; or ".join(dict.fromkeys(fits)) or None
            if hint is None and mask == "causal" and close(everyone, ra.reference_attention(q, k, v, "none")[0]):
                hint = "no causal mask was applied: pass the mask to block_attention"
            raise AssertionError(f"{n} ranks, mask {mask!r}: rank {rank}'s out differs from plain attention at its "
                                 f"positions {[mine[i].item() for i in _where(got_out, want, -2)]}"
                                 + (f": {hint}" if hint else ""))
        if not close(got_lse, want_lse[..., mine]):
            raise AssertionError(f"{n} ranks, mask {mask!r}: rank {rank}'s out is right but its lse is not the "
                                 f"log-sum-exp of its queries' scores over every key: return the merged lse")
    _raise(n, mask, _ring_run_problems(results, positions, mask, "forward", kv_bytes_per_rank(n, len(positions[0]))))


def _ring_backward_checked(forward, backward, positions, mask, timeout):
    n = len(positions)
    q, k, v, grad_out = ring_inputs(sum(map(len, positions)))
    results = _spawn_ring(forward, backward, positions, mask, timeout)
    _raise(n, mask, _protocol_problems(results, "backward"))
    leaves = [t.clone().requires_grad_() for t in (q, k, v)]
    ra.reference_attention(*leaves, mask)[0].backward(grad_out)
    for rank, result in enumerate(results):
        got = result["backward"]
        if not (isinstance(got, tuple) and len(got) == 3):
            raise AssertionError(f"rank {rank}: ring_attention_backward must return (dq, dk, dv)")
        for name, value, leaf in zip(("dq", "dk", "dv"), got, leaves):
            want = leaf.grad[..., positions[rank], :]
            if value is None or value.shape != want.shape:
                raise AssertionError(f"{n} ranks, mask {mask!r}: rank {rank}'s {name} has shape "
                                     f"{tuple(getattr(value, 'shape', ()))}, expected {tuple(want.shape)}")
            if not close(value, want):
                full_grads = dict(zip(("dq", "dk", "dv"), (t.grad for t in leaves)))
                hint = _backward_hint(name, value, full_grads, rank, positions, q, k, v, grad_out, mask)
                raise AssertionError(f"{n} ranks, mask {mask!r}: rank {rank}'s {name} differs from autograd's "
                                     f"through plain attention by up to {max_abs_diff(value, want):.3g}"
                                     + (f": {hint}" if hint else ""))
    _raise(n, mask, _ring_run_problems(results, positions, mask, "backward",
                                       kv_bytes_per_rank(n, len(positions[0]), backward=True)))


def check_ring_attention(ring_attention_forward, world_size, world_sizes=WORLD_SIZES, timeout=CHECK_TIMEOUT):
    """Ring attention's forward: every rank's (out, lse) equal plain attention's for its chunk, causal and not."""
    sizes = runnable_world_sizes(sorted({*world_sizes, world_size}))
    for n in sizes:
        for mask in ra.MASKS:
            _ring_forward_checked(ring_attention_forward, ra.chunk_positions(CHUNK * n, n), mask, timeout)
    print(f"ring_attention_forward: out and lse equal plain attention (1e-12) on {', '.join(map(str, sizes))} ranks, "
          f"causal and not; hidden blocks skipped, the next block in flight during each compute, "
          f"(N-1) x keys and values sent")


def check_ring_attention_backward(ring_attention_forward, ring_attention_backward, world_size,
                                  world_sizes=WORLD_SIZES, timeout=CHECK_TIMEOUT):
    """Ring attention's backward: every rank's (dq, dk, dv) equal autograd's through plain attention."""
    sizes = runnable_world_sizes(sorted({*world_sizes, world_size}))
    for n in sizes:
        for mask in ra.MASKS:
            _ring_backward_checked(ring_attention_forward, ring_attention_backward, ra.chunk_positions(CHUNK * n, n),
                                   mask, timeout)
    print(f"ring_attention_backward: dq, dk and dv equal autograd's through plain attention (1e-12) on "
          f"{', '.join(map(str, sizes))} ranks, causal and not; the next block in flight during each compute, the "
          f"key/value gradients home after N steps")


def _backward_hint(name, value, full_grads, rank, positions, q, k, v, grad_out, mask):
    """The confirmed reason a rank's dq, dk or dv is wrong, or None. full_grads: autograd's, by name."""
    candidates, n, mine, full_grad = [], len(positions), positions[rank], full_grads[name]
    out, lse = ra.reference_attention(q, k, v, mask)
    which = {"dq": 0, "dk": 1, "dv": 2}[name]

    def share(r, j):
        """Rank r's share of block j's (dq, dk, dv)[which], or None where r's queries see none of block j."""
        a, b = positions[r], positions[j]
        if not ra.visible(a, b, mask):
            return None
        return ra.block_attention_backward(grad_out[..., a, :], q[..., a, :], k[..., b, :], v[..., b, :],
                                           out[..., a, :], lse[..., a], a, b, mask)[which]

    # overwritten instead of added: what is left is the share of the last visible block of the ring's order
    if name == "dq":
        shares = [share(rank, (rank - s) % n) for s in range(n)]
    else:
        shares = [share((rank + s) % n, rank) for s in range(n)]  # the ranks block `rank` visits, in order
    shares = [x for x in shares if x is not None]
    if len(shares) > 1:
        candidates.append((shares[-1], f"it is only the last block's share: each block's {name} was assigned, not "
                                       f"added (+=) to the running {'dq' if name == 'dq' else 'dkv'}"))
    if name in ("dk", "dv"):
        other = "dv" if name == "dk" else "dk"
        candidates.append((full_grads[other][..., mine, :],
                           f"it is {other}: ra.block_attention_backward returns (dq, dk, dv), in that order"))
        following = (rank + 1) % n
        candidates.append((full_grad[..., positions[following], :],
                           f"it is rank {following}'s {name}: the key/value gradients stopped one step short; after "
                           f"the last step they travel once more, home to their owner"))
        # the gradients passed the other way round (to rank - 1): block j's gradient buffer visits j, j - 1, ... and
        # ends at rank j + 1 (a direction right on 2 ranks only)
        if n > 2:
            buffers = [0] * n
            for step in range(n):
                buffers = [b + (share(r, (r - step) % n) if ra.visible(positions[r], positions[(r - step) % n], mask)
                                else 0) for r, b in enumerate(buffers)]
                buffers = buffers[1:] + buffers[:1]  # rank r receives rank r + 1's
            candidates.append((buffers[rank] + torch.zeros_like(full_grad[..., mine, :]),
                               "the key/value gradients travelled the other way round the ring: they must follow "
                               "their block (isend to rank + 1, irecv from rank - 1) to come home; sent to rank - 1, "
                               "each rank ends with another rank's (on 2 ranks both ways lead home: only 3 or more "
                               "show it)"))
        start = (k, v)[which - 1][..., mine, :]
        candidates.append((full_grad[..., mine, :] + start, "the travelling key/value gradients started from the keys "
                                                            "and values themselves, not from zeros: dkv = "
                                                            "torch.zeros_like(kv)"))
        # every block's share added into one buffer that never moves
        kept = sum(x for j in range(n) if (x := share(rank, j)) is not None)
        candidates.append((kept, "the key/value gradients did not travel: each block's share belongs to the rank the "
                                 "block came from, so the gradients travel the ring with their block, every rank "
                                 "adding its share, and arrive home after N steps"))
    return confirmed(value, candidates)


# ---------------------------------------------------------------- zigzag

def zigzag_reference(seq_len, world_size):
    """Rank r's positions under zigzag sharding: chunks r and 2N-1-r of the sequence cut into 2N."""
    chunk = ra.check_sizes(seq_len, world_size, "zigzag")
    return [torch.cat([torch.arange(r * chunk, (r + 1) * chunk),
                       torch.arange((2 * world_size - 1 - r) * chunk, (2 * world_size - r) * chunk)])
            for r in range(world_size)]


def work_per_rank(positions, mask="causal"):
    """Scores each rank computes in a whole ring (ra.block_attention's pieces): the load."""
    return [sum(ra.score_entries(mine, theirs, mask) for theirs in positions if ra.visible(mine, theirs, mask))
            for mine in positions]


def _layout_problem(got, seq_len, n):
    if not (isinstance(got, (list, tuple)) and len(got) == n and all(isinstance(p, torch.Tensor) for p in got)):
        return f"zigzag_positions must return a list of {n} tensors of positions, one per rank"
    chunk = seq_len // (2 * n)
    for rank, mine in enumerate(got):
        if mine.dtype != torch.int64 or mine.dim() != 1 or len(mine) != 2 * chunk:
            return (f"rank {rank} holds {tuple(mine.shape)} positions of dtype {mine.dtype}: every rank holds "
                    f"2 chunks of S/2N = {chunk} positions, a 1-D int64 tensor")
    held = torch.cat(list(got))
    counts = torch.bincount(held.clamp(0, seq_len), minlength=seq_len + 1)
    if held.min() < 0 or held.max() >= seq_len:
        outside = held[(held < 0) | (held >= seq_len)][0].item()
        rank = next(r for r, mine in enumerate(got) if (mine == outside).any())
        first = [p // chunk for p in got[rank].tolist()]
        return (f"a position outside the sequence 0..{seq_len - 1} is held: {outside}, by rank {rank}, whose chunks "
                f"are {sorted(set(first))} of the {2 * n} (0..{2 * n - 1}): zigzag gives rank r chunks r and 2N-1-r "
                f"({rank} and {2 * n - 1 - rank})" + (": one off, 2N - r" if max(first) == 2 * n - rank else ""))
    if (counts[:seq_len] != 1).any():
        position = (counts[:seq_len] != 1).nonzero()[0].item()
        owners = [r for r, mine in enumerate(got) if (mine == position).any()]
        return (f"position {position} is held by {'no rank' if not owners else 'ranks ' + str(owners)}: every "
                f"position must be held by exactly one rank")
    want = zigzag_reference(seq_len, n)
    for rank, mine in enumerate(got):
        chunks = sorted({p // chunk for p in mine.tolist()})
        if sorted(mine.tolist()) != sorted(want[rank].tolist()):
            work = work_per_rank(list(got))
            return (f"rank {rank} holds chunks {chunks} of the {2 * n}: zigzag gives rank r chunks r and 2N-1-r "
                    f"({rank} and {2 * n - 1 - rank}). Causal scores per rank with this layout: {work}" +
                    (" (unbalanced)" if len(set(work)) > 1 else ""))
    return None


def check_zigzag(zigzag_positions, ring_attention_forward, ring_attention_backward, world_size,
                 world_sizes=WORLD_SIZES, timeout=CHECK_TIMEOUT):
    """Zigzag positions: rank r holds chunks r and 2N-1-r; the ring, unchanged, gives plain attention's values on
    them, and every rank computes the same number of scores."""
    sizes = runnable_world_sizes(sorted({*world_sizes, world_size}))
    for n in sizes:
        seq_len = 4 * n
        got = zigzag_positions(seq_len, n)
        problem = _layout_problem(got, seq_len, n)
        if problem:
            raise AssertionError(f"{n} ranks, sequence {seq_len}: {problem}")
        _ring_forward_checked(ring_attention_forward, list(got), "causal", timeout)
        _ring_backward_checked(ring_attention_forward, ring_attention_backward, list(got), "causal", timeout)
    print(f"zigzag_positions: rank r holds chunks r and 2N-1-r on {', '.join(map(str, sizes))} ranks; the ring's out, "
          f"lse, dq, dk and dv on them equal plain attention's (1e-12), and every rank computes as many scores")


# ---------------------------------------------------------------- training the transformer

TRAIN_SIZES = TransformerSizes(seq_len=24)  # splits into 2, 3 and 4 chunks, and into 2N for zigzag
TRAIN_STEPS = 3


def _rope_at(positions_by_rank, sizes, seed=0):
    """Step 0's loss of the whole batch when RoPE rotates each token by `rope[r]` on rank r instead of its global
    position, the mask still by global positions: what a rank that passes its local positions computes."""
    model = build_transformer(sizes, seed)
    seq = torch.arange(sizes.seq_len)
    use_attention(model, lambda q, k, v, _: causal_self_attention(q, k, v, seq))
    rope = torch.empty(sizes.seq_len, dtype=torch.int64)
    for mine in positions_by_rank:
        rope[mine] = torch.arange(len(mine))
    inputs, targets = make_tokens(sizes, seed, 0)
    return lm_loss(model(inputs, rope), targets).item()


def _first_gradients(sizes, seed=0):
    model = build_transformer(sizes, seed)
    inputs, targets = make_tokens(sizes, seed, 0)
    lm_loss(model(inputs), targets).backward()
    return {name: p.grad for name, p in model.named_parameters()}


def _gradient_hint(runs, want, n):
    """Why the gradients the first step used are not the whole batch's (on every rank), or None."""
    for name, expected in want.items():
        got = [grads.get(name) for _, _, grads in runs]
        if any(g is None for g in got):
            return f"{name}'s gradient is None on some rank at the optimizer step"
        if all(close(g, expected) for g in got):
            continue
        if any(not close(g, got[0]) for g in got[1:]):
            return (f"{name}'s gradient differs between the ranks at the optimizer step: each rank holds only its "
                    f"tokens' share, so average every gradient over the ranks (all-reduce, then divide by N)")
        for factor, hint in [(n, f"it is {n} times the whole batch's: the sum over ranks of each rank's mean loss's "
                                 f"gradient, where the mean is wanted (divide by the world size)"),
                             (1 / n, f"it is the whole batch's divided by {n} once more")]:
            if close(got[0], expected * factor):
                return f"{name}'s gradient at the optimizer step: {hint}"
        return (f"{name}'s gradient at the optimizer step differs from the whole batch's by up to "
                f"{max_abs_diff(got[0], expected):.3g}")
    return None


TRAIN_ERRORS = [  # (words in a rank's error, what in forward_backward causes it)
    ("to match target batch_size", "the logits and the targets cover different tokens: take this rank's tokens of "
                                   "both, inputs[:, mine] and targets[:, mine], mine = positions[rank]"),
    ("only for scalar outputs", "backward was called on a tensor of many values: the loss is one number, lm_loss of "
                                "this rank's logits and targets"),
]


def check_context_parallel_training(forward_backward, ring_attention, world_size, world_sizes=WORLD_SIZES,
                                    timeout=CHECK_TIMEOUT):
    """The transformer trained with context parallelism (ring attention, contiguous and zigzag chunks) equals the
    single-process run: losses, the first step's gradients, the final parameters (float64, 1e-12)."""
    sizes = runnable_world_sizes(sorted({*world_sizes, world_size}))
    want_params, want_losses = train_transformer_reference(TRAIN_SIZES, TRAIN_STEPS, lr=LEARNING_RATE)
    want_grads = _first_gradients(TRAIN_SIZES)
    for n in sizes:
        for layout, positions in [("contiguous", ra.chunk_positions(TRAIN_SIZES.seq_len, n)),
                                  ("zigzag", zigzag_reference(TRAIN_SIZES.seq_len, n))]:
            case = f"{n} ranks, {layout} chunks"
            try:
                runs = spawn_explaining_stalls(
                    train_main, n, forward_backward, ring_attention, positions, TRAIN_SIZES, TRAIN_STEPS,
                    timeout=timeout, hint="training stalls: every rank must make the same collectives in the same "
                                          "order (the ring's, then one all-reduce per parameter)")
            except RankError as e:  # an error inside the student's function: what in it caused it
                hint = next((h for words, h in TRAIN_ERRORS if words in str(e)), None)
                if hint is None:
                    raise
                raise AssertionError(f"{case}: {e.args[0].splitlines()[0]}: {hint}") from None
            losses = [r[1] for r in runs]
            if any(not isinstance(loss, float) for run in losses for loss in run):
                raise AssertionError(f"{case}: forward_backward must return this rank's loss (a one-element tensor)")
            mean_first = sum(run[0] for run in losses) / n
            if abs(mean_first - want_losses[0]) > TOLERANCE:
                local = _rope_at(positions, TRAIN_SIZES)
                hint = (": RoPE rotated each token by its position within its rank's chunk; pass the chunk's "
                        "global positions to the model (model(tokens, positions)), as the ring masks by them"
                        if abs(mean_first - local) < TOLERANCE else
                        f": 1/{n} of it: each rank's loss was divided by the world size N = {n}; a rank's loss is the "
                        f"mean over its own tokens (lm_loss), and the mean over the ranks is the gradients' (all-reduce "
                        f"then / N, once)" if abs(mean_first * n - want_losses[0]) < TOLERANCE * n else "")
                raise AssertionError(f"{case}: step 0's loss, averaged over the ranks, is {mean_first:.12g}; one "
                                     f"process's is {want_losses[0]:.12g}{hint}")
            problem = _gradient_hint(runs, want_grads, n)
            if problem:
                raise AssertionError(f"{case}: {problem}")
            for name, expected in want_params.items():
                for rank, (params, _, _) in enumerate(runs):
                    if not close(params[name], expected):
                        raise AssertionError(f"{case}: after {TRAIN_STEPS} steps rank {rank}'s {name} differs from one "
                                             f"process's by up to {max_abs_diff(params[name], expected):.3g}")
            for step in range(TRAIN_STEPS):
                mean = sum(run[step] for run in losses) / n
                if abs(mean - want_losses[step]) > TOLERANCE:
                    raise AssertionError(f"{case}: step {step}'s loss averaged over the ranks is {mean:.12g}, one "
                                         f"process's {want_losses[step]:.12g}")
    print(f"context parallel training: {TRAIN_STEPS} AdamW steps of the transformer on {', '.join(map(str, sizes))} "
          f"ranks, contiguous and zigzag chunks, equal one process's run (losses, gradients, weights; 1e-12)")
