"""Notebook 10 (expert parallel): a mixture-of-experts layer, its single-process reference, and its sizes.

    router:   probs = softmax(x W_router^T)               (tokens, E)
              weights, index = top-k of probs, weights / their sum    each token's k experts and combine weights
    experts:  E FeedForward MLPs (utils.transformer's w1, GELU, w2)
    combine:  y[t] = sum_j weights[t, j] * expert_{index[t, j]}(x[t])

The layer takes a transformer block's FeedForward place (notebook 11): `MoE(sizes, num_experts, top_k)` reads
`sizes.dim` and `sizes.ffn_dim`, its parameters are named `router.weight` and `experts.{e}.w1.weight`, ..., with the
expert's *global* index e, and every parameter's value comes from (seed, its name) as the transformer's do: a rank
that builds only its own experts holds the same weights as one process that builds all of them.

Rules fixed once, here, and followed by the reference and the checks:
- the top-k weights are renormalised to sum to 1 over the k chosen experts (Mixtral's rule), before any drop;
- with a capacity C, each rank (each group of tokens, on one process) keeps at most C tokens per expert: the
  first C routed to it, in token order (first come, first served); a dropped (token, expert) pair contributes
  nothing (its weight is not given to the other choices): in a block, the residual carries the token on;
- C = ceil(capacity_factor * tokens * top_k / E), tokens counted per rank.
"""
import math

import torch
import torch.distributed as dist
import torch.nn as nn
import torch.nn.functional as F

from utils.model import generator
from utils.sizes import check_int, divide
from utils.transformer import FeedForward, initial_value

EXPERT_TOKENS = 4  # a random stream of its own (utils.model uses 0 and 1, utils.transformer 2 and 3)


def check_sizes(num_experts, top_k, world_size=1, capacity_factor=None):
    """Experts per rank, if the sizes make sense; a ValueError naming the bad one before any rank starts."""
    num_experts, top_k = check_int("num_experts", num_experts), check_int("top_k", top_k)
    if top_k > num_experts:
        raise ValueError(f"top_k {top_k} is larger than num_experts {num_experts}: a token picks k different experts")
    if capacity_factor is not None:
        if isinstance(capacity_factor, bool) or not isinstance(capacity_factor, (int, float)):
            raise TypeError(f"capacity_factor must be a number, got {capacity_factor!r}")
        if not capacity_factor > 0:
            raise ValueError(f"capacity_factor must be above 0, got {capacity_factor}: an expert with no room "
                             f"drops every token")
    return divide("num_experts", num_experts, "world_size", world_size, "every rank holds as many experts")


def capacity(num_tokens, num_experts, top_k, capacity_factor):
    """Tokens an expert keeps from one rank: ceil(capacity_factor * tokens * top_k / E), at least 1."""
    check_sizes(num_experts, top_k, capacity_factor=capacity_factor)
    return max(1, math.ceil(capacity_factor * check_int("num_tokens", num_tokens) * top_k / num_experts))


class MoE(nn.Module):
    """A router and the experts `experts` (global indices; default all E). forward(x) is the one-process layer
    without a capacity; it keeps its load-balancing loss in `self.aux_loss` and its routing in `self.index`."""

    def __init__(self, sizes, num_experts, top_k, experts=None):
        super().__init__()
        check_sizes(num_experts, top_k)
        self.num_experts, self.top_k = num_experts, top_k
        self.router = nn.Linear(sizes.dim, num_experts, bias=False)
        self.experts = nn.ModuleDict({str(e): FeedForward(sizes) for e in (range(num_experts) if experts is None
                                                                           else experts)})

    def forward(self, x):
        flat = x.reshape(-1, x.shape[-1])
        index, weights, probs = route(flat, self.router, self.top_k)
        self.aux_loss, self.index = load_balancing_loss(probs, index), index
        y, _ = moe_reference(flat, index, weights, self.experts, self.num_experts)
        return y.view(x.shape)


def build_moe(sizes, num_experts, top_k, seed=0, experts=None, dtype=torch.float64):
    """The layer, weights from (seed, each parameter's name): the same experts in any process."""
    with torch.device("meta"):  # no default init: it would draw from (and advance) the global RNG
        moe = MoE(sizes, num_experts, top_k, experts)
    moe = moe.to_empty(device="cpu").to(dtype)
    with torch.no_grad():
        for name, p in moe.named_parameters():
            p.copy_(initial_value(name, p.shape, seed, dtype))
    return moe


def local_experts(num_experts, rank, world_size):
    """The global indices of the experts rank `rank` holds: a contiguous range of E / N."""
    per_rank = check_sizes(num_experts, 1, world_size)
    return range(rank * per_rank, (rank + 1) * per_rank)


def route(x, router, top_k):
    """(index, weights, probs): each token's top-k experts, their renormalised weights, and the softmax over all."""
    probs = torch.softmax(router(x), dim=-1)
    weights, index = probs.topk(top_k, dim=-1)
    return index, weights / weights.sum(-1, keepdim=True), probs


def load_balancing_loss(probs, index):
    """Switch Transformer's auxiliary loss, E * sum_e f_e P_e: f_e the fraction of (token, choice) pairs routed to
    expert e, P_e its mean router probability. 1 when the load is uniform, up to E when one expert takes all; its
    gradient (through P_e) lowers the probability of the busiest experts."""
    num_experts = probs.shape[-1]
    f = torch.bincount(index.flatten(), minlength=num_experts).to(probs.dtype) / index.numel()
    return num_experts * (f * probs.mean(0)).sum()


def within_capacity(index, num_experts, capacity):
    """(tokens, k) bool: True where a (token, choice) pair is kept, each expert keeping its first `capacity` pairs in
    token order. A token never picks an expert twice, so token order is the order of the flattened pairs."""
    flat = index.flatten()
    place = (F.one_hot(flat, num_experts).cumsum(0) - 1).gather(1, flat[:, None]).squeeze(1)
    return (place < capacity).view(index.shape)


def moe_reference(x, index, weights, experts, num_experts, capacity=None, num_groups=1):
    """The layer on one process, expert by expert: (y, kept). With a capacity, the tokens are cut into `num_groups`
    equal groups (the ranks' tokens) and each group keeps at most `capacity` per expert (within_capacity)."""
    kept = torch.ones_like(index, dtype=torch.bool)
    if capacity is not None:
        size = divide("num_tokens", len(x), "num_groups", num_groups, "every rank holds as many tokens")
        kept = torch.cat([within_capacity(index[g:g + size], num_experts, capacity) for g in range(0, len(x), size)])
    y = torch.zeros_like(x)
    for name, expert in experts.items():
        tokens, choice = ((index == int(name)) & kept).nonzero(as_tuple=True)
        y = y.index_add(0, tokens, weights[tokens, choice, None] * expert(x[tokens]))
    return y, kept


def tokens_per_expert(index, num_experts):
    return torch.bincount(index.flatten(), minlength=num_experts)


def make_tokens(num_tokens, dim, seed=0, step=0, dtype=torch.float64):
    """A batch of token activations (num_tokens, dim), from (seed, step) alone: any rank can take its slice."""
    x = torch.randn(num_tokens, dim, generator=generator(seed, EXPERT_TOKENS, step), dtype=torch.float64)
    return x.to(dtype)


def agree_on_splits(output_splits, input_splits, num_rows, group=None):
    """Before an all-to-all: the splits must add up to the rows sent, and what rank s sends rank r must be what r
    expects from s. Every rank checks the whole table (one small all-gather) and raises the same ValueError, naming
    the rank and the mismatch, where gloo would abort or wait forever. Ranks are counted within `group`."""
    rank, world_size = dist.get_rank(group), dist.get_world_size(group)
    for name, splits in (("output_splits", output_splits), ("input_splits", input_splits)):
        if len(splits) != world_size or any(int(s) < 0 for s in splits):
            raise ValueError(f"rank {rank}: {name} {list(splits)} must hold {world_size} sizes, none negative")
    if sum(input_splits) != num_rows:
        raise ValueError(f"rank {rank}: input_splits {list(input_splits)} add up to {sum(input_splits)}, but the "
                         f"tensor sent has {num_rows} rows")
    mine = torch.tensor([*output_splits, *input_splits], dtype=torch.int64)
    table = torch.empty(world_size * len(mine), dtype=torch.int64)
    dist.all_gather_single(table, mine, group=group)
    table = table.view(world_size, 2, world_size)  # [rank, output or input, peer]
    for r in range(world_size):
        for s in range(world_size):
            expects, sends = int(table[r, 0, s]), int(table[s, 1, r])
            if expects != sends:
                raise ValueError(f"rank {r} expects {expects} rows from rank {s}, which sends it {sends}: "
                                 f"output_splits[{s}] on rank {r} must equal input_splits[{r}] on rank {s}")


def load_per_rank(counts, world_size):
    """Pairs each rank's experts receive, from the pairs per expert (rank r holds a contiguous range of experts)."""
    return counts.view(world_size, -1).sum(1)


def token_bytes(fn):
    """Run fn(); return (bytes handed to all_to_all_single in floating-point tensors, the part of them that leaves
    this rank): the tokens and their gradients, not the integer counts."""
    from utils.intercept import intercept
    moved = [0, 0]

    def before(call, arguments):
        x = arguments["input"]
        if call.name != "all_to_all_single" or not x.is_floating_point() or not len(x):
            return
        row = x[0].numel() * x.element_size()
        group = arguments.get("group")
        n = dist.get_world_size(group)
        splits = arguments.get("input_split_sizes") or [len(x) // n] * n
        moved[0] += len(x) * row
        moved[1] += (len(x) - splits[dist.get_rank(group)]) * row

    with intercept(before=before, names=("all_to_all_single",)):
        fn()
    return tuple(moved)


def expert_data_mesh(data_parallel, expert_parallel):
    """The 2-D mesh (data, expert) of the ranks: rank = d * expert_parallel + i. Returns (mesh, expert group, data
    group): rank (d, i) moves tokens within the ranks (d, *), and its experts' copies sit on the ranks (*, i)."""
    from torch.distributed.device_mesh import init_device_mesh
    mesh = init_device_mesh("cpu", (data_parallel, expert_parallel), mesh_dim_names=("data", "expert"))
    return mesh, mesh.get_group("expert"), mesh.get_group("data")


def group_ranks(group):
    """The global ranks of a process group (None: all of them)."""
    return list(range(dist.get_world_size())) if group is None else dist.get_process_group_ranks(group)
