"""Attention in blocks and across ranks (notebook 09): the online softmax, and ring attention.

Attention of queries q against keys/values (k, v) split into blocks never needs the whole score matrix: each
block gives its own softmax-weighted output `out_b` and the log-sum-exp of its scores `lse_b`, and two blocks'
results merge exactly,

    lse = log(exp(lse_a) + exp(lse_b))            out = exp(lse_a - lse) out_a + exp(lse_b - lse) out_b

(the weights are each block's share of the softmax's denominator). Ring attention puts one chunk of the sequence
on each rank and sends the key/value chunks around the ring, merging one block per step.

Positions are global throughout: a block is described by its queries' and keys' positions in the whole sequence,
so that the causal mask (a key may be seen by a query not before it) and RoPE are the same on any rank, for any
way of cutting the sequence into chunks.
"""
import math

import torch

from utils.sizes import check_int, divide
from utils.transformer import causal_mask

MASKS = ("causal", "none")


def check_mask(mask):
    if mask not in MASKS:
        raise ValueError(f"mask must be one of {MASKS}, got {mask!r}: ring attention merges blocks by position, "
                         f"so it honours a causal mask or none, not an arbitrary one")
    return mask


LAYOUTS = ("contiguous", "zigzag")


def check_sizes(seq_len, world_size, layout="contiguous"):
    """The length of each rank's chunk: every rank holds the same number of positions (no padding); zigzag cuts the
    sequence into 2N chunks, two per rank."""
    world_size = check_int("world_size", world_size)
    if layout not in LAYOUTS:
        raise ValueError(f"layout must be one of {LAYOUTS}, got {layout!r}")
    if check_int("seq_len", seq_len) < world_size:
        raise ValueError(f"seq len {seq_len} is shorter than the world size {world_size}: a rank would hold no "
                         f"position of the sequence")
    if layout == "zigzag":
        return divide("seq_len", seq_len, "twice_the_world_size", 2 * world_size,
                      "zigzag cuts the sequence into 2N equal chunks, two per rank")
    return divide("seq_len", seq_len, "world_size", world_size, "every rank holds an equal chunk of the sequence")


def chunk_positions(seq_len, world_size):
    """Every rank's global positions, contiguous chunks: rank r holds [r S/N, (r+1) S/N)."""
    chunk = check_sizes(seq_len, world_size)
    return [torch.arange(r * chunk, (r + 1) * chunk) for r in range(world_size)]


def visible(q_positions, k_positions, mask="causal"):
    """Whether some query sees some key of the block. Under a causal mask a block whose every key comes after
    every query contributes nothing: skip it."""
    return check_mask(mask) == "none" or bool(k_positions.min() <= q_positions.max())


# ---------------------------------------------------------------- one block

def scores(q, k):
    return q @ k.transpose(-2, -1) / math.sqrt(q.shape[-1])


def block_mask(q_positions, k_positions, mask):
    """True where a query may see a key; None when it sees every key."""
    return causal_mask(q_positions, k_positions) if check_mask(mask) == "causal" else None


def pieces(positions):
    """The pieces a block is computed in, as (start, stop) index ranges into `positions`: its two halves (zigzag:
    the rank's two chunks; contiguous: the two halves of its chunk), each cut where the positions jump. Computed
    piece against piece, a block skips what the causal mask hides at half-chunk granularity, which is what lets
    zigzag sharding balance the work."""
    n = len(positions)
    edges = sorted({0, n // 2, n} | set(((positions[1:] != positions[:-1] + 1).nonzero().flatten() + 1).tolist()))
    return [(a, b) for a, b in zip(edges[:-1], edges[1:]) if b > a]


def visible_pairs(q_positions, k_positions, mask):
    """The (query piece, key piece) pairs of a block that the mask does not hide entirely: the ones computed."""
    return [(qr, kr) for qr in pieces(q_positions) for kr in pieces(k_positions)
            if visible(q_positions[slice(*qr)], k_positions[slice(*kr)], mask)]


def score_entries(q_positions, k_positions, mask="causal"):
    """How many scores block_attention computes for this block: the work it does."""
    return sum((qb - qa) * (kb - ka) for (qa, qb), (ka, kb) in visible_pairs(q_positions, k_positions, mask))


def dense_attention(q, k, v, q_positions, k_positions, mask):
    """(out, lse) of q against every key of k, masked by position. A query that sees no key gets out 0, lse -inf."""
    s = scores(q, k)
    allowed = block_mask(q_positions, k_positions, mask)
    if allowed is not None:
        s = s.masked_fill(~allowed, float("-inf"))
    lse = torch.logsumexp(s, dim=-1)
    return softmax_slice(s, lse) @ v, lse


def softmax_slice(s, lse):
    """exp(s - lse): these scores' share of a softmax whose log-denominator is lse; exp(-inf - finite) = 0, no NaN."""
    return torch.exp(s - lse.clamp_min(torch.finfo(s.dtype).min)[..., None])


def block_attention(q, k, v, q_positions, k_positions, mask="causal"):
    """Attention of q (..., Sq, D) against one block of keys/values (..., Sk, D): (out, lse), where lse (..., Sq) is
    the log-sum-exp of each query's allowed scores; a query that sees no key of the block gets out 0, lse -inf (the
    block's share of its softmax is zero). The block is computed piece against piece (`pieces`), skipping the pairs
    the causal mask hides, and the pieces merged with the online softmax."""
    out, lse = torch.zeros_like(q), torch.full(q.shape[:-1], float("-inf"), dtype=q.dtype)
    for (qa, qb), (ka, kb) in visible_pairs(q_positions, k_positions, mask):
        pair = dense_attention(q[..., qa:qb, :], k[..., ka:kb, :], v[..., ka:kb, :], q_positions[qa:qb],
                               k_positions[ka:kb], mask)
        out[..., qa:qb, :], lse[..., qa:qb] = merge_pieces(out[..., qa:qb, :], lse[..., qa:qb], *pair)
    return out, lse


def merge_pieces(out, lse, block_out, block_lse):
    """The online-softmax merge (notebook 09's first exercise), for the pieces of one block: a query that sees no key
    of either (lse -inf on both sides) keeps out 0, lse -inf."""
    merged = torch.logaddexp(lse, block_lse)
    shift = merged.clamp_min(torch.finfo(merged.dtype).min)[..., None]
    return torch.exp(lse[..., None] - shift) * out + torch.exp(block_lse[..., None] - shift) * block_out, merged


def block_attention_backward(grad_out, q, k, v, out, lse, q_positions, k_positions, mask="causal"):
    """One block's share of (dq, dk, dv), given the whole attention's `out` and `lse` for these queries.

    With p = exp(s - lse) the block's slice of the softmax (not its own softmax: lse is every block's),
        dv = p^T dout,   ds = p * (dout v^T - rowsum(dout * out)),   dq = ds k / sqrt(D),   dk = ds^T q / sqrt(D).
    The rowsum term is the whole softmax's: the same for every block, which is why out and lse are the global ones.
    Pairs of pieces the causal mask hides are skipped, as in the forward."""
    dq, dk, dv = torch.zeros_like(q), torch.zeros_like(k), torch.zeros_like(v)
    scale = 1 / math.sqrt(q.shape[-1])
    for (qa, qb), (ka, kb) in visible_pairs(q_positions, k_positions, mask):
        qs, ks, vs, g = q[..., qa:qb, :], k[..., ka:kb, :], v[..., ka:kb, :], grad_out[..., qa:qb, :]
        s = scores(qs, ks)
        allowed = block_mask(q_positions[qa:qb], k_positions[ka:kb], mask)
        if allowed is not None:
            s = s.masked_fill(~allowed, float("-inf"))
        p = softmax_slice(s, lse[..., qa:qb])
        ds = p * (g @ vs.transpose(-2, -1) - (g * out[..., qa:qb, :]).sum(-1, keepdim=True))
        dq[..., qa:qb, :] += ds @ ks * scale
        dk[..., ka:kb, :] += ds.transpose(-2, -1) @ qs * scale
        dv[..., ka:kb, :] += p.transpose(-2, -1) @ g
    return dq, dk, dv


# ---------------------------------------------------------------- the ring: the course's reference (notebook 12)
# Notebook 09's exercise is the student's own; notebook 12 composes this one with the other parallelisms, on a
# process group: `group` (None: the world), the ring's neighbours its ranks (group_dst / group_src).

def ring_attention_forward(q, k, v, positions, mask="causal", group=None):
    """(out, lse) of this rank's queries against every rank's keys/values, passed around `group`'s ring: each
    step sends the block held to rank + 1 while merging it, and receives the next from rank - 1. `positions[r]`:
    group rank r's global positions."""
    import torch.distributed as dist

    rank, size = dist.get_rank(group), dist.get_world_size(group)
    kv, out, lse = torch.stack([k, v]), None, None
    for step in range(size):
        if step < size - 1:
            incoming = torch.empty_like(kv)
            transfers = [dist.isend(kv, group=group, group_dst=(rank + 1) % size),
                         dist.irecv(incoming, group=group, group_src=(rank - 1) % size)]
        source = (rank - step) % size
        if visible(positions[rank], positions[source], mask):
            block = block_attention(q, kv[0], kv[1], positions[rank], positions[source], mask)
            out, lse = block if out is None else merge_pieces(out, lse, *block)
        if step < size - 1:
            for transfer in transfers:
                transfer.wait()
            kv = incoming
    return out, lse


def ring_attention_backward(grad_out, q, k, v, out, lse, positions, mask="causal", group=None):
    """(dq, dk, dv): the keys/values travel the ring again, each with its gradient accumulator, which makes one hop
    more and arrives home."""
    import torch.distributed as dist

    rank, size = dist.get_rank(group), dist.get_world_size(group)
    send_to, receive_from = (rank + 1) % size, (rank - 1) % size
    kv = torch.stack([k, v])
    dq, dkv = torch.zeros_like(q), torch.zeros_like(kv)
    for step in range(size):
        last = step == size - 1
        if not last:
            incoming = torch.empty_like(kv)
            transfers = [dist.isend(kv, group=group, group_dst=send_to),
                         dist.irecv(incoming, group=group, group_src=receive_from)]
        source = (rank - step) % size
        if visible(positions[rank], positions[source], mask):
            block_dq, block_dk, block_dv = block_attention_backward(grad_out, q, kv[0], kv[1], out, lse,
                                                                    positions[rank], positions[source], mask)
            dq += block_dq
            dkv += torch.stack([block_dk, block_dv])
        if size == 1:  # the block never left: its gradients are home
            break
        incoming_dkv = torch.empty_like(dkv)
        dkv_transfers = [dist.isend(dkv, group=group, group_dst=send_to),
                         dist.irecv(incoming_dkv, group=group, group_src=receive_from)]
        for transfer in dkv_transfers + ([] if last else transfers):
            transfer.wait()
        dkv = incoming_dkv
        if not last:
            kv = incoming
    return dq, dkv[0], dkv[1]


class RingAttention(torch.autograd.Function):
    """out = ring attention of q against every rank's k, v: apply(q, k, v, positions, mask, group=None)."""

    @staticmethod
    def forward(ctx, q, k, v, positions, mask, group=None):
        out, lse = ring_attention_forward(q, k, v, positions, mask, group)
        ctx.save_for_backward(q, k, v, out, lse)
        ctx.positions, ctx.mask, ctx.group = positions, mask, group
        return out

    @staticmethod
    def backward(ctx, grad_out):
        grads = ring_attention_backward(grad_out, *ctx.saved_tensors, ctx.positions, ctx.mask, ctx.group)
        return *grads, None, None, None


# ---------------------------------------------------------------- references

def reference_attention(q, k, v, mask="causal"):
    """Plain attention over the whole sequence (positions 0 .. S-1): (out, lse), the values every version must
    reproduce."""
    positions = torch.arange(q.shape[-2])
    return dense_attention(q, k, v, positions, positions, mask)


def sdpa(q, k, v, mask="causal"):
    """PyTorch's scaled_dot_product_attention on the same tensors."""
    return torch.nn.functional.scaled_dot_product_attention(q, k, v, is_causal=check_mask(mask) == "causal")


def attention_inputs(batch, heads, seq_len, head_dim, seed, dtype=torch.float64, scale=1.0):
    """q, k, v (batch, heads, seq, head_dim) from `seed` alone; `scale` > 1 makes scores large (the softmax's
    exponentials overflow unless the maximum is subtracted)."""
    generator = torch.Generator().manual_seed(seed)
    return tuple(torch.randn(batch, heads, seq_len, head_dim, generator=generator, dtype=torch.float64)
                 .mul(scale).to(dtype) for _ in range(3))


def saved_bytes(fn, *args):
    """Bytes autograd saves for backward while `fn(*args)` runs (every saved tensor's storage counted once)."""
    seen = {}

    def pack(t):
        storage = t.untyped_storage()
        seen[storage.data_ptr()] = storage.nbytes()
        return t

    with torch.autograd.graph.saved_tensors_hooks(pack, lambda t: t):
        fn(*args)
    return sum(seen.values())
