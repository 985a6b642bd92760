"""Notebook 09's checks: the solution passes at 2, 3 and 4 ranks; each wrong answer in the catalogue fails at its own
check with a hint that names the mistake; right answers written another way pass. Right answers come from the
solution notebook, wrong ones are small edits of it."""
import pytest
import torch

from utils import ring_attention as ra
from utils.checks.context_parallel import (
    check_blockwise_attention,
    check_context_parallel_training,
    check_merge,
    check_ring_attention,
    check_ring_attention_backward,
    check_zigzag,
)
from utils.notebooks import solution

NAME = "09_context_parallel"
SOLUTION = solution(NAME)


def wrong(old, new):
    return solution(NAME, replace={old: new})


def cases(catalogue, slow=()):
    """The catalogue's names, those in `slow` marked slow: they spawn again (about 1 s each) what another test
    already shows on one process or with the same hint; pytest -m slow runs them."""
    return [pytest.param(name, marks=pytest.mark.slow) if name in slow else name for name in catalogue]


@pytest.mark.slow  # the notebook's strict run passes every check at 2, 3 and 4 ranks too
def test_the_solution_passes(capsys):
    check_merge(SOLUTION.merge)
    check_blockwise_attention(SOLUTION.blockwise_attention)
    check_ring_attention(SOLUTION.ring_attention_forward, 4)
    check_ring_attention_backward(SOLUTION.ring_attention_forward, SOLUTION.ring_attention_backward, 4)
    check_zigzag(SOLUTION.zigzag_positions, SOLUTION.ring_attention_forward, SOLUTION.ring_attention_backward, 4)
    out = capsys.readouterr().out
    assert out.count("on 2, 3, 4 ranks") == 3 and "merge:" in out and "blockwise_attention:" in out


def test_the_reference_is_pytorchs_attention():
    q, k, v = ra.attention_inputs(2, 3, 10, 4, seed=1)
    for mask in ra.MASKS:
        assert (ra.reference_attention(q, k, v, mask)[0] - ra.sdpa(q, k, v, mask)).abs().max() < 1e-12


@pytest.mark.parametrize("bad, message", [((50, 4), "not divisible by world size 4"),
                                          ((3, 4), "shorter than the world size"), ((12, 0), "at least 1")])
def test_sizes_that_do_not_split_are_refused(bad, message):
    with pytest.raises(ValueError, match=message):
        ra.check_sizes(*bad)


def test_a_mask_the_ring_cannot_honour_is_refused():
    with pytest.raises(ValueError, match="causal mask or none"):
        ra.block_attention(*ra.attention_inputs(1, 1, 4, 2, 0), torch.arange(4), torch.arange(4), "sliding")


# ---------------------------------------------------------------- merge

MERGE = """    merged = torch.logaddexp(lse, block_lse)
    shift = merged.clamp_min(torch.finfo(merged.dtype).min)  # both -inf: exp(-inf - finite) = 0, not exp(NaN)
    out = torch.exp(lse - shift)[..., None] * out + torch.exp(block_lse - shift)[..., None] * block_out
    return out, merged
"""
MERGE_MISTAKES = {
    "averaged": ("    return (out + block_out) / 2, torch.logaddexp(lse, block_lse)\n", "averaged"),
    "running output not rescaled": (
        "    merged = torch.logaddexp(lse, block_lse)\n"
        "    return out + torch.exp(block_lse - merged)[..., None] * block_out, merged\n", "not rescaled"),
    "weights swapped": (
        "    merged = torch.logaddexp(lse, block_lse)\n"
        "    out = torch.exp(block_lse - merged)[..., None] * out + torch.exp(lse - merged)[..., None] * block_out\n"
        "    return out, merged\n", "swapped"),
    "lse is the running max": (MERGE.replace("return out, merged", "return out, torch.maximum(lse, block_lse)"),
                               "running maximum"),
    "lse not updated": (MERGE.replace("return out, merged", "return out, lse"), "running one, not updated"),
    "exponentials of the lse's themselves": (
        "    a, b = torch.exp(lse)[..., None], torch.exp(block_lse)[..., None]\n"
        "    return (a * out + b * block_out) / (a + b), torch.log(torch.exp(lse) + torch.exp(block_lse))\n",
        "overflow here: exponentiate differences"),
    "the block's out replaces the running one": (MERGE.replace(
        "    out = torch.exp(lse - shift)[..., None] * out + torch.exp(block_lse - shift)[..., None] * block_out\n"
        "    return out, merged\n", "    return block_out, merged\n"), "the block's out replaced the running one"),
    "the running out returned unchanged": (MERGE.replace(
        "    out = torch.exp(lse - shift)[..., None] * out + torch.exp(block_lse - shift)[..., None] * block_out\n",
        ""), "the running out was returned unchanged"),
    "weights exp(lse), not exp(lse - merged)": (MERGE.replace("torch.exp(lse - shift)", "torch.exp(lse)").replace(
        "torch.exp(block_lse - shift)", "torch.exp(block_lse)"), r"the weights are exp\(lse_block\), not exp"),
    # issue 43 (found by students): right wherever a query sees some key, NaN where it sees none in either block
    "NaN where both blocks are unseen": (
        "    merged = torch.logaddexp(lse, block_lse)\n"
        "    out = torch.exp(lse - merged)[..., None] * out + torch.exp(block_lse - merged)[..., None] * block_out\n"
        "    return out, merged\n", "queries that see no key of either block: merge's out holds inf or NaN. A query "
        "that sees no key of either block has lse -inf on both sides: .* its weights must come out 0"),
}


@pytest.mark.parametrize("mistake", MERGE_MISTAKES)
def test_merge_mistakes_are_named(mistake):
    new, hint = MERGE_MISTAKES[mistake]
    with pytest.raises(AssertionError, match=hint):
        check_merge(wrong(MERGE, new).merge)


@pytest.mark.parametrize("other", [
    # the running maximum made explicit, as FlashAttention's papers write it (a query seeing no key: weights 0)
    "    m = torch.maximum(lse, block_lse)\n    a, b = torch.exp(lse - m), torch.exp(block_lse - m)\n"
    "    seen = m > float('-inf')\n    a, b = a.where(seen, 0), b.where(seen, 0)\n"
    "    out = (a[..., None] * out + b[..., None] * block_out) / (a + b).where(seen, 1)[..., None]\n"
    "    return out, m + torch.log(a + b)\n",
    # the sigmoid form of ring-flash-attention, with a query that sees no key of either block kept out 0, lse -inf
    "    merged = lse - torch.nn.functional.logsigmoid(lse - block_lse)\n"
    "    out = out - torch.sigmoid(block_lse - lse)[..., None] * (out - block_out)\n"
    "    unseen = (lse == float('-inf')) & (block_lse == float('-inf'))\n"
    "    return out.masked_fill(unseen[..., None], 0), merged.masked_fill(unseen, float('-inf'))\n",
])
def test_merge_written_another_way_passes(other):
    check_merge(wrong(MERGE, other).merge)


# ---------------------------------------------------------------- attention in blocks

SKIP = "            if not ra.visible(q_pos, k_pos, mask):\n                continue\n"
BLOCK = ("            block = ra.block_attention(q[..., q_pos, :], k[..., k_pos, :], v[..., k_pos, :], q_pos, k_pos, "
         "mask)\n")
BLOCKWISE_MISTAKES = {
    "hidden blocks computed": (SKIP, "", "skip those blocks"),
    "no mask": (BLOCK, BLOCK.replace("q_pos, k_pos, mask)", "q_pos, k_pos, 'none')"), "without the causal mask"),
    "positions local to the block": (BLOCK, BLOCK.replace("q_pos, k_pos, mask)", "q_pos - q_pos[0], k_pos - k_pos[0], "
                                                                                 "mask)"), "global positions"),
    "own block of keys only": (SKIP, "            if not torch.equal(q_pos, k_pos):\n                continue\n",
                               "only its own block of keys"),
    "a last block that does not fit dropped": (
        "    for q_pos in positions.split(block_size):\n",
        "    for q_pos in positions[:len(positions) // block_size * block_size].split(block_size):\n",
        "positions are missing"),
    "every query against each block of keys": (
        "    for q_pos in positions.split(block_size):\n", "    for q_pos in [positions]:\n", "at most block_size"),
    "lse of the last block only": ("        lses.append(lse)\n", "        lses.append(block[1])\n", "lse differs"),
    # issue 43's patterns: per-block state not reset; a running lse that starts at 0
    "running result not reset per block of queries": (
        "    for q_pos in positions.split(block_size):\n        out = lse = None\n",
        "    out = lse = None\n    for q_pos in positions.split(block_size):\n", "not reset for each block of queries"),
    "running lse started at 0": (
        "        out = lse = None\n        for k_pos in positions.split(block_size):\n",
        "        out, lse = torch.zeros_like(q[..., q_pos, :]), torch.zeros(q[..., q_pos, 0].shape, dtype=q.dtype)\n"
        "        for k_pos in positions.split(block_size):\n", "the running lse started at 0"),
}


@pytest.mark.parametrize("mistake", BLOCKWISE_MISTAKES)
def test_blockwise_mistakes_are_named(mistake):
    old, new, hint = BLOCKWISE_MISTAKES[mistake]
    with pytest.raises(AssertionError, match=hint):
        check_blockwise_attention(wrong(old, new).blockwise_attention)


@pytest.mark.parametrize("edits", [
    # `break` at the first hidden block (the rest are later still)
    {SKIP: "            if not ra.visible(q_pos, k_pos, mask):\n                break\n"},
    # the running result started at out 0, lse -inf (nothing seen yet), every block merged into it
    {"        out = lse = None\n        for k_pos in positions.split(block_size):\n":
     "        out = torch.zeros_like(q[..., q_pos, :])\n"
     "        lse = torch.full(q[..., q_pos, 0].shape, float('-inf'), dtype=q.dtype)\n"
     "        for k_pos in positions.split(block_size):\n",
     "mask)\n            out, lse = block if out is None else merge(out, lse, *block)\n        outs.append(out)":
     "mask)\n            out, lse = merge(out, lse, *block)\n        outs.append(out)"},
])
def test_blockwise_written_another_way_passes(edits):
    check_blockwise_attention(solution(NAME, replace=edits).blockwise_attention)


# ---------------------------------------------------------------- ring attention, forward

START = ("            transfers = [dist.isend(kv, (rank + 1) % world_size), dist.irecv(incoming, (rank - 1) % "
         "world_size)]\n")
RING_SKIP = "        if ra.visible(positions[rank], positions[source], mask):\n"
RING_BLOCK = "            block = ra.block_attention(q, kv[0], kv[1], positions[rank], positions[source], mask)\n"
WAIT = "            for transfer in transfers:\n                transfer.wait()\n            kv = incoming\n"
RING_MISTAKES = {  # checked on 3 ranks: on 2, rank + 1 and rank - 1 are the same neighbour
    "waits before computing": (
        START + "        source", START + "            for transfer in transfers:\n                transfer.wait()\n"
        "            kv_next = incoming\n        source", "no transfer was in flight"),
    "hidden blocks computed": (RING_SKIP + RING_BLOCK, "        if True:\n" + RING_BLOCK,
                               "every key comes after every query"),
    "keys masked with this rank's positions": (
        RING_BLOCK, RING_BLOCK.replace("positions[source], mask", "positions[rank], mask"),
        "this rank's own positions"),
    "the other way round the ring": (
        START, START.replace("(rank + 1)", "(rank - 1)").replace("incoming, (rank - 1)", "incoming, (rank + 1)"),
        "one way round the ring"),
    "blocks replaced, not merged": (
        RING_BLOCK + "            out, lse = block if out is None else merge(out, lse, *block)\n",
        RING_BLOCK + "            out, lse = block\n", "replaced the running result"),
    "a receive never waited for": (WAIT, "            transfers[0].wait()\n            kv = incoming\n",
                                   "never waited for"),
    "all-gather instead of the ring": (
        "    kv = torch.stack([k, v])  # one message per step\n",
        "    kv = torch.stack([k, v])  # one message per step\n"
        "    dist.all_gather([torch.empty_like(kv) for _ in range(world_size)], kv)\n", "calls dist.all_gather"),
    # issue 43's patterns: a direction right only on 2 ranks; a running lse that starts at 0
    "the block taken for rank + step's": (
        "        source = (rank - step) % world_size\n" + RING_SKIP + RING_BLOCK,
        "        source = (rank + step) % world_size\n" + RING_SKIP + RING_BLOCK,
        "the source was taken as rank \\(rank \\+ s\\) mod N"),
    "running lse started at 0": (
        "    kv = torch.stack([k, v])  # one message per step\n    out = lse = None\n",
        "    kv = torch.stack([k, v])  # one message per step\n"
        "    out, lse = torch.zeros_like(q), torch.zeros(q.shape[:-1], dtype=q.dtype)\n",
        "the running lse started at 0"),
    "the source rank taken as (step - rank) mod N": (
        "        source = (rank - step) % world_size\n        if ra.visible(positions[rank], positions[source], mask):\n"
        "            block = ra.block_attention(",
        "        source = (step - rank) % world_size\n        if ra.visible(positions[rank], positions[source], mask):\n"
        "            block = ra.block_attention(", r"not \(s - rank\) mod N"),
    "visibility asked with the keys' positions first": (
        RING_SKIP + RING_BLOCK, "        if ra.visible(positions[source], positions[rank], mask):\n" + RING_BLOCK,
        "the keys' positions first"),
    "a transfer after the last step too": (
        "        last = step == world_size - 1\n        if not last:\n            incoming = torch.empty_like(kv)\n"
        + START, "        last = False\n        if not last:\n            incoming = torch.empty_like(kv)\n" + START,
        "sent .* bytes; the ring sends"),
}


@pytest.mark.parametrize("mistake", cases(RING_MISTAKES, slow={"the block taken for rank + step's",
                                                             "running lse started at 0",
                                                             "the source rank taken as (step - rank) mod N",
                                                             "visibility asked with the keys' positions first"}))
def test_ring_mistakes_are_named(mistake):
    old, new, hint = RING_MISTAKES[mistake]
    edits = {old: new}
    if mistake == "waits before computing":  # the block received is used after the compute, as before
        edits[WAIT] = "            kv = kv_next\n"
    with pytest.raises(AssertionError, match=hint):
        check_ring_attention(solution(NAME, replace=edits).ring_attention_forward, 3, world_sizes=())


@pytest.mark.slow  # 1 s; the ring's mistakes run in the default run
def test_ring_written_another_way_passes():
    # the running result started at out 0, lse -inf (nothing seen yet), every visible block merged into it
    other = solution(NAME, replace={
        "    kv = torch.stack([k, v])  # one message per step\n    out = lse = None\n":
        "    kv = torch.stack([k, v])  # one message per step\n"
        "    out, lse = torch.zeros_like(q), torch.full(q.shape[:-1], float('-inf'), dtype=q.dtype)\n",
        RING_BLOCK + "            out, lse = block if out is None else merge(out, lse, *block)\n":
        RING_BLOCK + "            out, lse = merge(out, lse, *block)\n"})
    check_ring_attention(other.ring_attention_forward, 3, world_sizes=())


def test_a_ring_sending_to_the_wrong_neighbour_stops_in_seconds_naming_the_ring():
    stuck = wrong(START, START.replace("irecv(incoming, (rank - 1)", "irecv(incoming, (rank + 1)"))
    with pytest.raises(TimeoutError, match="the ring stalls"):
        check_ring_attention(stuck.ring_attention_forward, 3, world_sizes=(), timeout=1.5)


# ---------------------------------------------------------------- ring attention, backward

DKV_WAIT = ("        for transfer in dkv_transfers + ([] if last else transfers):\n            transfer.wait()\n"
            "        dkv = incoming_dkv\n")
BACKWARD_START = "            transfers = [dist.isend(kv, send_to), dist.irecv(incoming, receive_from)]\n"
BACKWARD_MISTAKES = {
    "the key/value gradients passed the other way round": (
        "        dkv_transfers = [dist.isend(dkv, send_to), dist.irecv(incoming_dkv, receive_from)]\n",
        "        dkv_transfers = [dist.isend(dkv, receive_from), dist.irecv(incoming_dkv, send_to)]\n",
        "travelled the other way round the ring"),
    "the travelling gradients started from the keys and values": (
        "    dq, dkv = torch.zeros_like(q), torch.zeros_like(kv)", "    dq, dkv = torch.zeros_like(q), kv.clone()",
        "started from the keys and values themselves"),
    "block_attention_backward given lse before out (a raw size error inside it)": (
        "                grad_out, q, kv[0], kv[1], out, lse, positions[rank], positions[source], mask)\n",
        "                grad_out, q, kv[0], kv[1], lse, out, positions[rank], positions[source], mask)\n",
        r"rank \d: ring_attention_backward raised RuntimeError: The size of tensor a .*, at `.*`: tensors of different "
        r"shapes met: ra.block_attention_backward takes \(grad_out, q, k, v, out, lse"),
    "gradients one step short of home": (
        "        incoming_dkv = torch.empty_like(dkv)\n",
        "        if last:\n            break\n        incoming_dkv = torch.empty_like(dkv)\n", "one step short"),
    "gradients that never travel": (
        "        incoming_dkv = torch.empty_like(dkv)\n"
        "        dkv_transfers = [dist.isend(dkv, send_to), dist.irecv(incoming_dkv, receive_from)]\n" + DKV_WAIT,
        "        for transfer in [] if last else transfers:\n            transfer.wait()\n", "did not travel"),
    "waits for the next block before computing": (
        BACKWARD_START, BACKWARD_START + "            for transfer in transfers:\n                transfer.wait()\n"
        "            transfers = []\n", "no transfer was in flight"),
    # issue 43's patterns: overwrite where one must accumulate; the returned gradients taken in the wrong order
    "dq assigned, not added": ("            dq += block_dq\n", "            dq = block_dq\n",
                               "rank \\d's dq .* only the last block's share: each block's dq was assigned, not added"),
    "dkv assigned, not added": ("            dkv += torch.stack([block_dk, block_dv])\n",
                                "            dkv = torch.stack([block_dk, block_dv])\n",
                                "only the last block's share: each block's dk was assigned, not added"),
    "dk and dv swapped": ("            block_dq, block_dk, block_dv = ra.block_attention_backward(",
                          "            block_dq, block_dv, block_dk = ra.block_attention_backward(",
                          "it is dv: ra.block_attention_backward returns \\(dq, dk, dv\\), in that order"),
    "hidden blocks computed": ("        if ra.visible(positions[rank], positions[source], mask):\n            block_dq",
                               "        if True:\n            block_dq", "every key comes after every query"),
}


@pytest.mark.slow  # 1.5 s; the backward's mistakes run in the default run
def test_ring_backward_written_another_way_passes():
    # the block's shares added to dk and dv in place, one at a time
    other = wrong("            dkv += torch.stack([block_dk, block_dv])\n",
                  "            dkv[0] += block_dk\n            dkv[1] += block_dv\n")
    check_ring_attention_backward(SOLUTION.ring_attention_forward, other.ring_attention_backward, 3, world_sizes=())


@pytest.mark.parametrize("mistake", cases(BACKWARD_MISTAKES, slow={"dq assigned, not added", "dk and dv swapped",
                                                   "the key/value gradients passed the other way round",
                                                   "the travelling gradients started from the keys and values"}))
def test_backward_mistakes_are_named(mistake):
    old, new, hint = BACKWARD_MISTAKES[mistake]
    wrong_one = wrong(old, new)
    with pytest.raises(AssertionError, match=hint):
        check_ring_attention_backward(SOLUTION.ring_attention_forward, wrong_one.ring_attention_backward, 3,
                                      world_sizes=())


# ---------------------------------------------------------------- zigzag

ZIGZAG = """    return [torch.cat([torch.arange(r * chunk, (r + 1) * chunk),
                       torch.arange((2 * world_size - 1 - r) * chunk, (2 * world_size - r) * chunk)])
            for r in range(world_size)]
"""
ZIGZAG_MISTAKES = {
    "second chunk 2N - r, one past": (
        ZIGZAG.replace("(2 * world_size - 1 - r) * chunk, (2 * world_size - r) * chunk",
                       "(2 * world_size - r) * chunk, (2 * world_size + 1 - r) * chunk"),
        r"held: 8, by rank 0, whose chunks are \[0, 4\] of the 4 .*one off, 2N - r"),
    "chunks r and N + r": (
        "    return [torch.cat([torch.arange(r * chunk, (r + 1) * chunk),\n"
        "                       torch.arange((world_size + r) * chunk, (world_size + r + 1) * chunk)])\n"
        "            for r in range(world_size)]\n", r"chunks \[0, 2\] of the 4: zigzag .* \(unbalanced\)"),
    "contiguous chunks": (
        "    return [torch.arange(2 * r * chunk, 2 * (r + 1) * chunk) for r in range(world_size)]\n",
        r"chunks \[0, 1\] of the 4: zigzag gives rank r chunks r and 2N-1-r"),
    "second chunk one off": (ZIGZAG.replace("(2 * world_size - 1 - r) * chunk, (2 * world_size - r) * chunk",
                                            "(2 * world_size - r) * chunk, (2 * world_size + 1 - r) * chunk"),
                             "outside the sequence"),
    "chunks of S/N": (ZIGZAG.replace("    return [", "    chunk = seq_len // world_size\n    return ["),
                      r"every rank holds 2 chunks of S/2N"),
    "one tensor": (ZIGZAG.replace("    return [", "    return torch.stack([").replace("range(world_size)]",
                                                                                    "range(world_size)])"),
                   "a list of 2 tensors"),
}


@pytest.mark.parametrize("mistake", ZIGZAG_MISTAKES)
def test_zigzag_mistakes_are_named(mistake):
    new, hint = ZIGZAG_MISTAKES[mistake]
    with pytest.raises(AssertionError, match=hint):
        check_zigzag(wrong(ZIGZAG, new).zigzag_positions, SOLUTION.ring_attention_forward,
                     SOLUTION.ring_attention_backward, 2, world_sizes=())


def test_zigzag_with_the_late_chunk_first_passes():
    late_first = wrong(ZIGZAG, ZIGZAG.replace(
        "torch.arange(r * chunk, (r + 1) * chunk),\n                       torch.arange((2 * world_size - 1 - r) * "
        "chunk, (2 * world_size - r) * chunk)",
        "torch.arange((2 * world_size - 1 - r) * chunk, (2 * world_size - r) * chunk),\n"
        "                       torch.arange(r * chunk, (r + 1) * chunk)"))
    check_zigzag(late_first.zigzag_positions, SOLUTION.ring_attention_forward, SOLUTION.ring_attention_backward, 3,
                 world_sizes=())


# ---------------------------------------------------------------- training the transformer

FORWARD = "    loss = lm_loss(model(inputs[:, mine], mine), targets[:, mine])\n"
AVERAGE = "        dist.all_reduce(p.grad)\n        p.grad /= world_size\n"
TRAIN_MISTAKES = {
    "local positions": (FORWARD, FORWARD.replace("model(inputs[:, mine], mine)", "model(inputs[:, mine])"),
                        "RoPE rotated each token by its position within its rank's chunk"),
    "gradients not averaged": (AVERAGE, "        pass\n", "differs between the ranks"),
    "summed, not averaged": (AVERAGE, "        dist.all_reduce(p.grad)\n", "times the whole batch's"),
    # a library error inside the student's function, named (issue 43)
    "each rank's loss divided by N, the gradients averaged too": (
        FORWARD, FORWARD.replace("targets[:, mine])", "targets[:, mine]) / world_size"),
        "1/2 of it: each rank's loss was divided by the world size N = 2"),
    "targets not sliced": (FORWARD, FORWARD.replace("targets[:, mine])", "targets)"),
                           "failed: ValueError: Expected input batch_size .*: the logits and the targets cover "
                           "different tokens"),
    "no loss returned": ("    return loss\n    ### END SOLUTION", "    ### END SOLUTION",
                         "must return this rank's loss"),
}


@pytest.mark.parametrize("mistake", cases(TRAIN_MISTAKES, slow={"targets not sliced",
                                                              "each rank's loss divided by N, the gradients averaged too"}))
def test_training_mistakes_are_named(mistake):
    old, new, hint = TRAIN_MISTAKES[mistake]
    wrong_one = wrong(old, new)
    with pytest.raises(AssertionError, match=hint):
        check_context_parallel_training(wrong_one.context_parallel_forward_backward, SOLUTION.RingAttention, 2,
                                        world_sizes=())


def test_training_with_the_mean_taken_before_the_sum_passes():
    other = wrong(AVERAGE, "        p.grad /= world_size\n        dist.all_reduce(p.grad)\n")
    check_context_parallel_training(other.context_parallel_forward_backward, SOLUTION.RingAttention, 3,
                                    world_sizes=())
