"""Checks for notebook 10 (expert parallel): a differentiable all-to-all, dispatch with a capacity, dropless dispatch.

Every value is compared in float64 with one process: the all-to-all with every rank's rows put together in one place
(and with PyTorch's own `all_to_all_single_autograd`), the dispatches with utils.expert_parallel.moe_reference under
the same capacity rule. When a value is wrong, the check computes what the usual mistakes would have produced on the
same inputs and names the one that matches; otherwise it says what differs and where. Two runs with made-up experts
tell the moving of tokens apart from the experts: with identity experts and top-1 routing the layer must hand back
each kept token itself, exactly (the round trip); with expert e multiplying by e + 1, each token must come back
multiplied by its own expert's factor.
"""
import torch
import torch.distributed as dist
import torch.nn as nn

from utils import expert_parallel as ep
from utils.checks import CHECK_TIMEOUT, TOLERANCE, close, max_abs_diff, seeded_randn, spawn_explaining_stalls
from utils.launch import RankError, runnable_world_sizes
from utils.transformer import TransformerSizes

WORLD_SIZES = (2, 3, 4)
SIZES = TransformerSizes(dim=8, ffn_dim=16, num_heads=2)
TOKENS = 12  # per rank
STALL = ("a rank waits in a collective the others never reach: every rank must make the same all-to-all calls, in the "
         "same order, even one that sends or receives nothing")


def _run(fn, world_size, *args):
    return spawn_explaining_stalls(fn, world_size, *args, timeout=CHECK_TIMEOUT, hint=STALL)


# ---------------------------------------------------------------- the all-to-all

def split_table(world_size):
    """table[s][r]: rows rank s sends rank r. Uneven, zeros included (rank 0 sends rank 1 nothing), and every rank
    receives a different number of rows than it sends."""
    return [[(3 * s + 2 * r + 1) % 5 if (s, r) != (0, 1) else 0 for r in range(world_size)] for s in range(world_size)]


def subgroups(world_size):
    """The ranks cut in two halves, [0, h) and [h, N) (h = ceil(N / 2)): groups smaller than the world."""
    half = (world_size + 1) // 2
    return [list(range(half)), list(range(half, world_size))]


def _all_to_all_run(rank, world_size, fn, table):
    """(y, x.grad) of fn on this rank (its place in the group) with the rows table[s][r]."""
    input_splits, output_splits = table[rank], [table[s][rank] for s in range(world_size)]
    x = seeded_randn((sum(input_splits), 3), seed=3, rank=rank).requires_grad_()
    grad_y = seeded_randn((sum(output_splits), 3), seed=4, rank=rank)
    y = fn(x, output_splits, input_splits)
    (y * grad_y).sum().backward()
    return y.detach(), x.grad


def _all_to_all_main(rank, world_size, all_to_all, table):
    from torch.distributed._functional_collectives import all_to_all_single_autograd
    results = {name: _all_to_all_run(rank, world_size, fn, table) for name, fn in [
        ("yours", all_to_all), ("pytorch", lambda x, o, i: all_to_all_single_autograd(x, o, i, dist.group.WORLD))]}
    # on a group smaller than the world (section 6 passes one): every call, the backward's too, on that group
    groups = [dist.new_group(ranks) for ranks in subgroups(world_size)]  # every rank creates every group
    mine = next(i for i, ranks in enumerate(subgroups(world_size)) if rank in ranks)
    members = subgroups(world_size)[mine]
    results["subgroup"] = _all_to_all_run(members.index(rank), len(members), lambda x, o, i: all_to_all(
        x, o, i, group=groups[mine]), split_table(len(members)))
    return results


def _all_to_all_reference(table):
    """Every rank's (y, x.grad), computed with all the ranks' rows in one process."""
    n = len(table)
    xs = [seeded_randn((sum(table[s]), 3), seed=3, rank=s).split(table[s]) for s in range(n)]
    grads = [seeded_randn((sum(table[s][r] for s in range(n)), 3), seed=4, rank=r).split([table[s][r] for s in
                                                                                          range(n)]) for r in range(n)]
    return [(torch.cat([xs[s][r] for s in range(n)]), torch.cat([grads[d][r] for d in range(n)])) for r in range(n)]


def _all_to_all_error_hint(e):
    text = str(e)
    backward = "in backward" in text
    if "not equal to group size" in text:
        return (("the backward's all-to-all ran on all ranks, not on the group the forward was given: keep the group "
                 "in ctx and pass group=ctx.group to the reverse all-to-all") if backward else
                "the all-to-all ran on all ranks, not on `group`: pass group=group to dist.all_to_all_single")
    if "incorrect number of gradients" in text:
        return ("backward returns one gradient per input of forward: the gradient of x, then None for each of the "
                "two split lists")
    if "invalid gradient" in text:
        return ("backward returned a gradient with the shape of the output, not of x: each row's gradient must go "
                "back to the rank the row came from, a reverse all-to-all")
    if "ProcessGroupGloo::alltoall: invalid tensor size" in text:
        return ("gloo's dist.all_to_all (lists of tensors) takes tensors of one size only: with uneven splits use "
                "dist.all_to_all_single with its split sizes")
    if "Split sizes" in text or "split" in text.lower() and "size" in text.lower():
        return (("backward used the forward's splits: the gradient travels the other way, so the reverse all-to-all "
                 "receives input_splits and sends output_splits") if backward else
                ("the forward's output must have sum(output_splits) rows, and all_to_all_single takes "
                 "(output, input, output_split_sizes, input_split_sizes) in that order"))
    return None


def check_all_to_all(all_to_all, world_size, world_sizes=WORLD_SIZES):
    """all_to_all(x, output_splits, input_splits): forward and backward equal every rank's rows put together in one
    process and PyTorch's all_to_all_single_autograd, with uneven splits and a rank that sends a peer nothing; then
    on two groups of half the ranks each, given as `group`: forward and backward must both run on it."""
    sizes = runnable_world_sizes(sorted({*world_sizes, world_size}))
    for n in sizes:
        table = split_table(n)
        try:
            results = _run(_all_to_all_main, n, all_to_all, table)
        except RankError as e:
            hint = _all_to_all_error_hint(e)
            if hint is None:
                raise
            raise AssertionError(f"{n} ranks, rows sent from rank s to rank r {table} (then on the groups "
                                 f"{subgroups(n)}): {e.summary}: {hint}") from None
        for rank, (result, (want_y, want_grad)) in enumerate(zip(results, _all_to_all_reference(table))):
            pt_y, pt_grad = result["pytorch"]
            if not (close(pt_y, want_y) and close(pt_grad, want_grad)):
                raise AssertionError("PyTorch's all_to_all_single_autograd disagrees with the check's reference")
            y, grad = result["yours"]
            case = f"{n} ranks, rows sent from rank s to rank r {table}, rank {rank}"
            if not close(y, want_y):
                raise AssertionError(f"{case}: the output differs from the rows the ranks sent it, in rank order "
                                     f"(and from all_to_all_single_autograd's)" + (
                                         f": its shape is {tuple(y.shape)}, expected {tuple(want_y.shape)}"
                                         if y.shape != want_y.shape else ""))
            if grad is None:
                raise AssertionError(f"{case}: x.grad is None: return the gradient of x from backward")
            if not close(grad, want_grad):
                hint = ""
                if grad.shape == want_grad.shape and close(grad, torch.zeros_like(grad)):
                    hint = ": it is zero"
                raise AssertionError(f"{case}: the gradient of x differs from each row's gradient sent back from the "
                                     f"rank that received the row (all_to_all_single_autograd's){hint}")
        for members in subgroups(n):
            for local, (want_y, want_grad) in enumerate(_all_to_all_reference(split_table(len(members)))):
                y, grad = results[members[local]]["subgroup"]
                if not (close(y, want_y) and close(grad, want_grad)):
                    raise AssertionError(f"{n} ranks, on the group of ranks {members} (group=): rank "
                                         f"{members[local]}'s {'output' if not close(y, want_y) else 'gradient of x'} "
                                         f"differs from the rows sent within the group: every call, the backward's "
                                         f"too, runs on the group given (group=group, and group=ctx.group)")
    print(f"all_to_all: forward and backward equal the rows put together in one process and PyTorch's "
          f"all_to_all_single_autograd on {', '.join(map(str, sizes))} ranks, uneven splits, a rank sending a peer "
          f"nothing; and on groups of half the ranks (group=)")


# ---------------------------------------------------------------- dispatch

class Scale(nn.Module):
    """A made-up expert: x * factor."""

    def __init__(self, factor):
        super().__init__()
        self.factor = factor

    def forward(self, x):
        return x * self.factor


def _cases(world_size, capacity_factor):
    """(num_experts, top_k, capacity or None): 1 and 2 experts per rank, top-2; the capacity from the factor."""
    cases = []
    for per_rank, top_k in ((2, 2), (1, 1)):
        e = per_rank * world_size
        cases.append((e, top_k, None if capacity_factor is None else ep.capacity(TOKENS, e, top_k, capacity_factor)))
    return cases


def _route(x, moe, top_k, skewed):
    index, weights, probs = ep.route(x, moe.router, top_k)
    if skewed:  # top-1 onto the first half of the experts only: the others (and some ranks) get no token
        index = index % max(1, moe.num_experts // 2)
    return index, weights


def _dispatch(fn, x, index, weights, experts, num_experts, capacity):
    return fn(x, index, weights, experts, num_experts) if capacity is None else fn(x, index, weights, experts,
                                                                                   num_experts, capacity)


def _dispatch_main(rank, world_size, fn, num_experts, top_k, capacity, skewed):
    mine = ep.local_experts(num_experts, rank, world_size)
    x = ep.make_tokens(TOKENS * world_size, SIZES.dim, seed=1)[rank * TOKENS:(rank + 1) * TOKENS].clone()
    grad_y = ep.make_tokens(TOKENS * world_size, SIZES.dim, seed=2)[rank * TOKENS:(rank + 1) * TOKENS]
    moe = ep.build_moe(SIZES, num_experts, top_k, seed=3, experts=mine)
    result = {}
    # made-up experts, top-1: what comes back tells where each token went
    index, weights = _route(x, moe, 1, skewed)
    for name, experts in [("identity", [nn.Identity() for _ in mine]), ("scaled", [Scale(e + 1) for e in mine])]:
        y, kept = _dispatch(fn, x, index, weights, experts, num_experts, capacity)
        result[name] = y.detach()
    # the layer, with its gradients
    leaf = x.clone().requires_grad_()
    index, weights = _route(leaf, moe, top_k, skewed)
    y, other = _dispatch(fn, leaf, index, weights, list(moe.experts.values()), num_experts, capacity)
    (y * grad_y).sum().backward()
    result.update(y=y.detach(), other=other, x_grad=leaf.grad, router_grad=moe.router.weight.grad,
                  expert_grads={name: p.grad for name, p in moe.experts.named_parameters()})
    return result


def _reference(world_size, num_experts, top_k, capacity, skewed):
    x = ep.make_tokens(TOKENS * world_size, SIZES.dim, seed=1)
    grad_y = ep.make_tokens(TOKENS * world_size, SIZES.dim, seed=2)
    moe = ep.build_moe(SIZES, num_experts, top_k, seed=3)
    want = {}
    index1, weights1 = _route(x, moe, 1, skewed)
    leaf = x.clone().requires_grad_()
    index, weights = _route(leaf, moe, top_k, skewed)
    y, kept = ep.moe_reference(leaf, index, weights, moe.experts, num_experts, capacity, world_size)
    (y * grad_y).sum().backward()
    _, kept1 = ep.moe_reference(x, index1, weights1, moe.experts, num_experts, capacity, world_size)
    want.update(x=x, index=index.detach(), weights=weights.detach(), index1=index1, kept1=kept1, y=y.detach(),
                kept=kept, x_grad=leaf.grad, router_grad=moe.router.weight.grad,
                expert_grads={name: p.grad for name, p in moe.experts.named_parameters()}, moe=moe)
    return want


def _kept_mistakes(index, num_experts, capacity, world_size):
    """(kept, hint) as the usual wrong drop rules would keep (token, choice) pairs."""
    groups = [g for g in index.split(TOKENS)]

    def per_rank(rule):
        return torch.cat([rule(g) for g in groups])
    return [
        (torch.ones_like(index, dtype=torch.bool), "no pair was dropped: each expert keeps at most `capacity` of a "
                                                   "rank's pairs"),
        (per_rank(lambda g: ep.within_capacity(g, num_experts, capacity + 1)),
         "each expert kept capacity + 1 pairs: places in an expert's queue count from 0, keep place < capacity"),
        (per_rank(lambda g: ep.within_capacity(g, num_experts, capacity - 1)),
         "each expert kept capacity - 1 pairs, one short: places in an expert's queue count from 0 to capacity - 1, "
         "keep place < capacity"),
        (per_rank(lambda g: ep.within_capacity(g.flip(0), num_experts, capacity).flip(0)),
         "each expert kept its last pairs: the rule is first come, first served, in token order"),
        (per_rank(lambda g: ep.within_capacity(g.T.contiguous(), num_experts, capacity).T),
         "the pairs were queued choice by choice (every token's first choice before any second choice, GShard's "
         "priority): this course's rule queues them in token order"),
        (ep.within_capacity(index, num_experts, capacity),
         "the capacity was applied to all ranks' tokens together: each rank keeps at most `capacity` of its own "
         "tokens per expert"),
    ]


OVERWRITES = ("each token kept one of its results only: the combine wrote a token's results into y (y[tokens] = ..., "
              "index_put, index_copy), so a token's later choice overwrote its earlier one; add them (index_add, or "
              "index_put with accumulate=True): a token's output is the weighted sum over its top-k experts")


def _last_only(index, weights, kept, by):
    """The weights when each token keeps only the result written last: that of its last kept choice (pairs in token
    order), or of its kept choice with the highest expert (pairs sorted by expert)."""
    key = torch.arange(index.shape[1]).expand_as(index) if by == "choice" else index
    key = torch.where(kept, key, -1)
    return weights * (key == key.max(-1, keepdim=True).values) * kept


def _unpermuted(index, weights):
    """The weights each (token, choice) pair gets when the results are put back in expert order (sorted by
    expert on each rank) but the weights are left in token order: pair order[i] gets weight i."""
    wrong = []
    for g, w in zip(index.split(TOKENS), weights.split(TOKENS)):
        order = g.flatten().argsort(stable=True)
        wrong.append(torch.empty_like(w.flatten()).index_copy(0, order, w.flatten()).view(w.shape))
    return torch.cat(wrong)


def _kept_in_order(weights, kept):
    """The weights each kept pair gets when a rank's first kept.sum() weights are handed to its kept pairs in
    order, not each pair's own: weights.flatten()[:n] where weights.flatten()[kept] was meant."""
    wrong = []
    for w, k in zip(weights.split(TOKENS), kept.split(TOKENS)):
        flat = torch.zeros_like(w.flatten())
        flat[k.flatten()] = w.flatten()[:int(k.sum())]
        wrong.append(flat.view(w.shape))
    return torch.cat(wrong)


def _rows(got, want):
    bad = ((got - want).abs() > TOLERANCE * max(1.0, want.abs().max().item())).any(-1) | got.isnan().any(-1)
    return bad.nonzero().flatten().tolist()


def _check_dispatch(name, results, want, world_size, num_experts, top_k, capacity, skewed):
    case = (f"{name}, {world_size} ranks, {num_experts} experts, top-{top_k}"
            + (f", capacity {capacity}" if capacity is not None else "") + (", some experts get no token" if skewed
                                                                             else ""))
    x, kept1, index1 = want["x"], want["kept1"], want["index1"]
    if capacity is not None:  # which pairs were dropped, before what they did to the output
        shapes = [tuple(getattr(r["other"], "shape", ())) for r in results]
        if any(shape != (TOKENS, top_k) for shape in shapes):
            raise AssertionError(f"{case}: `kept` has shape {shapes[0] if len(set(shapes)) == 1 else shapes} on the "
                                 f"ranks, expected ({TOKENS}, {top_k}): the (tokens, top_k) bool mask of the "
                                 f"(token, choice) pairs kept, shaped like index (kept.view(index.shape))")
        got_kept = torch.cat([r["other"] for r in results])
        if not torch.equal(got_kept.bool(), want["kept"]):
            hint = next((h for kept, h in _kept_mistakes(want["index"], num_experts, capacity, world_size)
                         if got_kept.shape == kept.shape and torch.equal(got_kept.bool(), kept)), None)
            raise AssertionError(f"{case}: {int((~got_kept.bool()).sum())} pairs dropped, the reference drops "
                                 f"{int((~want['kept']).sum())}" + (f": {hint}" if hint else
                                 ": not the same pairs (`kept` must be the (tokens, top_k) mask of the pairs kept)"))
    # the round trip: identity experts, top-1 (weight exactly 1): each kept token comes back as it went
    got = torch.cat([r["identity"] for r in results])
    round_trip = x * kept1.any(-1, keepdim=True)
    if got.shape != x.shape or not torch.equal(got, round_trip):
        if capacity is not None and got.shape == x.shape:
            for kept, hint in _kept_mistakes(index1, num_experts, capacity, world_size):
                if torch.equal(got, x * kept.any(-1, keepdim=True)):
                    raise AssertionError(f"{case}: tokens dropped are not the reference's: {hint}")
        rows = _rows(got, round_trip) if got.shape == x.shape else "all"
        raise AssertionError(f"{case}: with identity experts and top-1 routing, tokens at rows {rows} (of all ranks' "
                             f"tokens) do not come back as they went: each result must return to the token it was "
                             f"sent for, at its position (the un-permute is the inverse of the permute), once; and the "
                             f"rows a rank receives are laid out by source rank, then by its local expert")
    # scaled experts: each token must come back multiplied by its own expert's factor
    got = torch.cat([r["scaled"] for r in results])
    want_scaled = x * (index1[:, :1] + 1) * kept1
    if not close(got, want_scaled):
        rows = _rows(got, want_scaled)
        t = rows[0]
        factor = (got[t] / x[t]).mean().item()
        raise AssertionError(f"{case}: with expert e multiplying by e + 1, token {t} routed to expert "
                             f"{int(index1[t, 0])} came back multiplied by {factor:.3g}: it went through another "
                             f"expert. The rows a rank receives are laid out by source rank, then by its local "
                             f"expert")
    # the layer
    got = torch.cat([r["y"] for r in results])
    if not close(got, want["y"]):
        weights, kept, index = want["weights"], want["kept"], want["index"]
        renormalised = weights * kept / (weights * kept).sum(-1, keepdim=True).clamp_min(1e-300)
        moe = want["moe"]
        candidates = [(renormalised, "the weights of a token's kept choices were renormalised after the drop: this "
                                     "course's rule renormalises the top-k weights once, before any drop; a dropped "
                                     "choice's share is lost (the residual carries the token)"),
                      (torch.ones_like(weights), "the combine weights were not applied: each result is multiplied "
                                                 "by its pair's weight before it is added to its token"),
                      *[(_last_only(index, weights, kept, by), OVERWRITES) for by in ("choice", "expert")],
                      (_unpermuted(index, weights), "the combine weights were not permuted with their tokens: the "
                                                    "results come back in expert order, so take the weights in that "
                                                    "order too (weights.flatten()[order]); with top-1 every weight "
                                                    "is 1, so only top-k > 1 shows it"),
                      (_kept_in_order(weights, kept), "the kept pairs took the first weights in order, not their own: "
                                                      "a pair's weight goes with it (weights.flatten()[kept], in the "
                                                      "order of the pairs' results)")]
        for w, hint in candidates:
            value, _ = ep.moe_reference(x, index, w, moe.experts, num_experts, capacity, world_size)
            if close(got, value.detach()):
                raise AssertionError(f"{case}: the output differs from the single-process layer: {hint}")
        raise AssertionError(f"{case}: the output differs from the single-process layer at tokens "
                             f"{_rows(got, want['y'])}, by up to {max_abs_diff(got, want['y']):.3g}")
    if capacity is None:
        counts = ep.tokens_per_expert(want["index"], num_experts)
        got_counts = torch.cat([_counts(r["other"], case) for r in results])
        if not torch.equal(got_counts, counts):
            raise AssertionError(f"{case}: rows computed per expert {got_counts.tolist()}, the routing sends "
                                 f"{counts.tolist()}: return how many rows each local expert received")
    # gradients
    router = [r["router_grad"] for r in results]
    learns = want["router_grad"].abs().max() > 1e-6  # top-1 renormalised: weight p / p = 1, no gradient at all
    if any(g is None for g in router) or learns and all(close(g, torch.zeros_like(g)) for g in router):
        raise AssertionError(f"{case}: the output is right but the router has no gradient: the combine weights "
                             f"were detached (or recomputed without autograd); the router learns only through them")
    checks = [("the router's weight (summed over ranks)", sum(router, torch.zeros_like(want["router_grad"])),
               want["router_grad"]),
              ("x", torch.cat([r["x_grad"] for r in results]), want["x_grad"])]
    expert_grads = {}
    for r in results:
        expert_grads.update(r["expert_grads"])
    checks += [(f"experts.{k}", expert_grads.get(k), g) for k, g in want["expert_grads"].items()]
    for what, got, want_grad in checks:
        if got is None or not close(got, want_grad):
            raise AssertionError(f"{case}: the output is right but the gradient of {what} differs from the "
                                 f"single-process layer's" + (": it is None" if got is None else
                                                              f" by up to {max_abs_diff(got, want_grad):.3g}"))
    return int((~want["kept"]).sum())


def _counts(received, case):
    """A rank's rows per local expert as a 1-D int64 tensor: a tensor, or any sequence of ints or 0-d tensors."""
    try:
        return torch.as_tensor([int(c) for c in received], dtype=torch.int64)
    except (TypeError, ValueError, RuntimeError):
        raise AssertionError(f"{case}: the second value returned must be the rows each local expert computed, one "
                             f"count per local expert (a tensor or a list of ints), got {received!r:.80}") from None


def _check_all(name, fn, world_size, world_sizes, capacity_factor, counts_hint):
    sizes = runnable_world_sizes(sorted({*world_sizes, world_size}))
    dropped = {}
    for n in sizes:
        skews = (False,) if capacity_factor is not None else (False, True)
        for num_experts, top_k, capacity in _cases(n, capacity_factor):
            for skewed in skews if top_k == 1 else (False,):
                try:
                    results = _run(_dispatch_main, n, fn, num_experts, top_k, capacity, skewed)
                except RankError as e:
                    if capacity is not None and "out of bounds" in str(e):
                        raise AssertionError(f"{name}, {n} ranks, capacity {capacity}: {e.summary}: a pair was put "
                                             f"beyond the (E x capacity) buffer: keep only the pairs whose place in "
                                             f"their expert's queue is below capacity") from None
                    if "rows from rank" in str(e) or "but the tensor sent has" in str(e):  # ep.agree_on_splits
                        raise AssertionError(f"{name}, {n} ranks: {e.summary}. {counts_hint}") from None
                    raise
                want = _reference(n, num_experts, top_k, capacity, skewed)
                dropped[(n, num_experts, top_k)] = _check_dispatch(name, results, want, n, num_experts, top_k,
                                                                   capacity, skewed)
    return sizes, dropped


def check_capacity_dispatch(capacity_dispatch, world_size, capacity_factor=1.0, world_sizes=WORLD_SIZES):
    """Outputs, kept pairs and every gradient equal the single-process layer with the same capacity rule."""
    sizes, dropped = _check_all("capacity_dispatch", capacity_dispatch, world_size, world_sizes, capacity_factor,
                                "With a capacity, every rank sends every rank capacity rows per expert it holds")
    print(f"capacity_dispatch: identity experts return each kept token exactly; output, kept pairs and the gradients "
          f"of x, the router and every expert equal one process with the same capacity rule (1e-12) on "
          f"{', '.join(map(str, sizes))} ranks, 1 and 2 experts per rank (pairs dropped: "
          f"{', '.join(str(d) for d in dropped.values())}, as the reference)")


def check_dropless_dispatch(dropless_dispatch, world_size, world_sizes=WORLD_SIZES):
    """No pair dropped: every token comes back once, to its position; outputs and gradients equal one process; experts
    (and ranks) that get no token."""
    sizes, _ = _check_all("dropless_dispatch", dropless_dispatch, world_size, world_sizes, None,
                          "A rank cannot know how many rows the others send it until they tell it: exchange the "
                          "counts per expert first (an all-to-all of the counts), then size the receive with them; "
                          "input_splits[r] adds up the counts of rank r's E/N consecutive experts, output_splits[s] "
                          "the counts received from rank s; the results go back with the splits swapped")
    print(f"dropless_dispatch: every token comes back exactly once, to its position; output, rows per expert and the "
          f"gradients of x, the router and every expert equal one process (1e-12) on {', '.join(map(str, sizes))} "
          f"ranks, 1 and 2 experts per rank, and with experts that get no token")


# ---------------------------------------------------------------- experts and data parallel

MESHES = {2: ((1, 2), (2, 1)), 4: ((2, 2), (1, 4))}  # world size: (data, expert) shapes


def _mesh_main(rank, world_size, dispatch, sync_gradients, data_parallel, expert_parallel, per_rank):
    from utils.intercept import intercept
    mesh, expert_group, data_group = ep.expert_data_mesh(data_parallel, expert_parallel)
    num_experts = per_rank * expert_parallel
    mine = ep.local_experts(num_experts, mesh.get_local_rank("expert"), expert_parallel)
    x = ep.make_tokens(TOKENS * world_size, SIZES.dim, seed=1)[rank * TOKENS:(rank + 1) * TOKENS].clone()
    grad_y = ep.make_tokens(TOKENS * world_size, SIZES.dim, seed=2)[rank * TOKENS:(rank + 1) * TOKENS]
    moe = ep.build_moe(SIZES, num_experts, 2 if num_experts > 1 else 1, seed=3, experts=mine)
    groups = []

    def before(call, arguments):
        groups.append((call.name, ep.group_ranks(arguments.get("group"))))

    with intercept(before=before) as log:
        index, weights, _ = ep.route(x, moe.router, moe.top_k)
        y, _ = dispatch(x, index, weights, list(moe.experts.values()), num_experts, expert_group)
        (y * grad_y).sum().backward()  # this rank's loss; the whole batch's is the mean over all ranks
        moved = len(log)
        local = {name: p.grad.clone() for name, p in moe.named_parameters()}
        sync_gradients(moe, data_group)
    return dict(grads={name: p.grad for name, p in moe.named_parameters()}, local=local, forward_groups=groups[:moved],
                sync_groups=groups[moved:], data=ep.group_ranks(data_group), expert=ep.group_ranks(expert_group))


def _mesh_reference(world_size, num_experts):
    x = ep.make_tokens(TOKENS * world_size, SIZES.dim, seed=1)
    grad_y = ep.make_tokens(TOKENS * world_size, SIZES.dim, seed=2)
    moe = ep.build_moe(SIZES, num_experts, 2 if num_experts > 1 else 1, seed=3)
    index, weights, _ = ep.route(x, moe.router, moe.top_k)
    y, _ = ep.moe_reference(x, index, weights, moe.experts, num_experts)
    ((y * grad_y).sum() / world_size).backward()  # the mean over ranks of each rank's loss
    return {name: p.grad for name, p in moe.named_parameters()}


def _mesh_hint(name, got, want, result, results, data_parallel, expert_parallel):
    """Why a synchronised gradient is wrong: the usual mistakes, recomputed from every rank's local gradients."""
    n = data_parallel * expert_parallel
    if name.startswith("experts."):
        copies = [r["local"][name] for r in results if name in r["local"]]
        total = sum(copies)
        both = (f"the data-parallel size (or the expert-parallel size: on this mesh both are {data_parallel})"
                if data_parallel == expert_parallel else "the data-parallel size")
        candidates = [(total / data_parallel, f"it is {expert_parallel} times too large, the expert-parallel size: "
                                              f"the sum over its {data_parallel} copies must be divided by all {n} "
                                              f"ranks (each rank's loss is 1/{n} of the batch's), not by {both}"),
                      (total / expert_parallel, f"it is {data_parallel} times too large, the data-parallel size: the "
                                                f"sum over its {data_parallel} copies was divided by the "
                                                f"expert-parallel size, {expert_parallel}; divide by all {n} ranks"),
                      (total, f"it is the sum over its copies: divide by the {n} ranks"),
                      (result["local"][name] / n, "it is this rank's own gradient: sum it over the ranks holding a "
                                                  "copy of this expert (the data-parallel group)"),
                      (result["local"][name], "it was never synchronised")]
        position = list(result["local"]).index(name)  # the same place in every rank's parameter list
        everyone = sum(list(r["local"].values())[position] for r in results)
        candidates += [(everyone / n, "it was averaged with other experts' gradients: an expert's gradient is "
                                      "all-reduced over the ranks holding a copy of it (the data-parallel group), "
                                      "not over all ranks")]
    else:
        total = sum(r["local"][name] for r in results)
        group_total = sum(results[r]["local"][name] for r in result["data"])
        candidates = [(group_total / n, "it was all-reduced on the data-parallel group only: the router sees every "
                                        "rank's tokens, all-reduce it over all ranks"),
                      (group_total / data_parallel, "it is averaged over the data-parallel group only: the router "
                                                    "sees every rank's tokens, average it over all ranks")
                      ] if data_parallel > 1 else []  # with one copy, the data group is the rank itself
        candidates += [(total, f"it is the sum over all ranks: divide by the {n} ranks"),
                       (result["local"][name], "it was never synchronised: average the router's gradient over all "
                                               "ranks"),
                       (result["local"][name] / n, "it is this rank's own gradient divided by the world size: it was "
                                                   "never all-reduced")]
    return next((hint for value, hint in candidates if close(got, value)), None)


def check_expert_data_parallel(dropless_dispatch, sync_gradients, world_size, world_sizes=(2, 4)):
    """Experts x data parallel: gradients of every parameter, synchronised, equal one process's (1e-12); the tokens
    move within the expert group, expert gradients on the data group, the router's on all ranks."""
    shapes = []
    for n in runnable_world_sizes(sorted({*world_sizes, world_size})):
        for data_parallel, expert_parallel in MESHES.get(n, ((n // 2, 2),) if n % 2 == 0 else ((n, 1),)):
            for per_rank in (1, 2):
                case = (f"{n} ranks as {data_parallel} (data) x {expert_parallel} (expert), {per_rank} expert(s) per "
                        f"rank")
                try:
                    results = _run(_mesh_main, n, dropless_dispatch, sync_gradients, data_parallel, expert_parallel,
                                   per_rank)
                except RankError as e:
                    if "rows from rank" in str(e) or "but the tensor sent has" in str(e):  # ep.agree_on_splits
                        raise AssertionError(f"{case}: {e.summary}. The dispatch (right on all ranks in section 4) "
                                             f"must make every collective on the expert group it is given: tokens "
                                             f"move within its expert-parallel group") from None
                    raise
                want = _mesh_reference(n, per_rank * expert_parallel)
                for rank, result in enumerate(results):
                    for what, ranks in result["forward_groups"]:
                        if ranks != result["expert"]:
                            raise AssertionError(f"{case}: rank {rank}'s dispatch ran dist.{what} on ranks {ranks}: "
                                                 f"tokens move within its expert-parallel group {result['expert']}")
                    for name, got in result["grads"].items():
                        if not close(got, want[name]):
                            hint = _mesh_hint(name, got, want[name], result, results, data_parallel,
                                              expert_parallel)
                            raise AssertionError(f"{case}: rank {rank}'s gradient of {name} differs from one "
                                                 f"process's" + (f": {hint}" if hint else ""))
                    used = {tuple(ranks) for _, ranks in result["sync_groups"]}
                    if used - {tuple(result["data"]), tuple(range(n))}:
                        raise AssertionError(f"{case}: rank {rank} synchronised gradients on ranks {sorted(used)}: "
                                             f"expert gradients on its data-parallel group {result['data']}, the "
                                             f"router's on all ranks")
                shapes.append(f"{data_parallel}x{expert_parallel}")
    print(f"sync_gradients: every gradient equals one process's (1e-12) on meshes (data x expert) "
          f"{', '.join(dict.fromkeys(shapes))}, 1 and 2 experts per rank; tokens moved within the expert group, "
          f"expert gradients summed on the data group, the router's on all ranks")
