"""The course's transformer (notebooks 09, 10 and 12): a small decoder-only language model, written out.

    tokens -> tok_embeddings -> num_layers x Block -> norm -> output -> logits
    Block:  h = x + attention(attention_norm(x), positions)     causal multi-head self-attention, RoPE
            out = h + feed_forward(ffn_norm(h))                 the MLP: w1, GELU, w2 (notebook 03's column/row pair)

As the MLP of utils.model: every weight comes from its own generator, seeded from (seed, its parameter's name), and
every batch of tokens from (seed, step), so any process can build any layer, alone, bit for bit; float64 by default.

Positions are an argument of the forward, not a counter inside it: a rank that holds a chunk of the sequence
(context parallel) passes its tokens' **global** positions, and RoPE rotates each query and key by those. The
parameter names are torchtitan's Llama names (tok_embeddings, layers.{i}.attention.wq, ..., norm, output), which
`parallelize_module` plans, `fully_shard` and a pipeline split address; `layers` is a ModuleDict, so a pipeline
stage that deletes the layers it does not run keeps the others' names, and a stage without tok_embeddings (or
output) passes its input (or its last hidden state) through.
"""
import dataclasses
import math

import torch
import torch.nn as nn
import torch.nn.functional as F

from utils.model import generator, make_optimizer, train
from utils.sizes import check_int, divide

TRANSFORMER_WEIGHTS, TOKENS = 2, 3  # utils.model's streams are 0 and 1: no draw repeats another


@dataclasses.dataclass(frozen=True)
class TransformerSizes:
    vocab_size: int = 64
    dim: int = 32
    num_heads: int = 4
    num_layers: int = 2
    ffn_dim: int = 64
    seq_len: int = 16
    batch_size: int = 2
    rope_theta: float = 10000.0

    def __post_init__(self):
        for name in ("vocab_size", "dim", "num_heads", "num_layers", "ffn_dim", "seq_len", "batch_size"):
            check_int(name, getattr(self, name))
        head_dim = divide("dim", self.dim, "num_heads", self.num_heads, "every head gets dim / num_heads features")
        if head_dim % 2:
            raise ValueError(f"head dim {head_dim} (dim {self.dim} / num heads {self.num_heads}) is odd: RoPE rotates "
                             f"pairs of features")

    @property
    def head_dim(self):
        return self.dim // self.num_heads


# ---------------------------------------------------------------- the pieces, each a function of the math

def rope_angles(positions, head_dim, theta=10000.0):
    """cos and sin of RoPE's angles, (len(positions), head_dim / 2): position p turns feature pair i by
    p * theta**(-2i / head_dim)."""
    frequencies = theta ** (-torch.arange(0, head_dim, 2, dtype=torch.float64) / head_dim)
    angles = torch.outer(positions.to(torch.float64), frequencies)
    return angles.cos(), angles.sin()


def apply_rope(x, cos, sin):
    """Rotate each pair (x[..., i], x[..., i + head_dim/2]) of x (..., seq, head_dim) by its position's angle.
    A query at position p and a key at position q then meet with a score that depends on p - q only."""
    first, second = x.chunk(2, dim=-1)
    cos, sin = cos.to(x.dtype), sin.to(x.dtype)
    return torch.cat([first * cos - second * sin, first * sin + second * cos], dim=-1)


def causal_mask(q_positions, k_positions):
    """True where a query may see a key: the key's position is not after the query's (global positions)."""
    return k_positions[None, :] <= q_positions[:, None]


def attention(q, k, v, mask=None):
    """softmax(q k^T / sqrt(head_dim), masked) v, for (..., seq, head_dim) tensors; `mask` True where allowed.
    Written out (no fused kernel) so that every intermediate can be looked at."""
    scores = q @ k.transpose(-2, -1) / math.sqrt(q.shape[-1])
    if mask is not None:
        scores = scores.masked_fill(~mask, float("-inf"))
    return torch.softmax(scores, dim=-1) @ v


class RMSNorm(nn.Module):
    """x / sqrt(mean(x^2) + eps) * weight, over the last dimension (torch.nn.RMSNorm's arithmetic)."""

    def __init__(self, dim, eps=1e-6):
        super().__init__()
        self.eps = eps
        self.weight = nn.Parameter(torch.ones(dim))

    def forward(self, x):
        return x * torch.rsqrt(x.square().mean(-1, keepdim=True) + self.eps) * self.weight


def causal_self_attention(q, k, v, positions):
    """Causal attention of a sequence's tokens among themselves: the mask from their positions."""
    return attention(q, k, v, causal_mask(positions, positions))


class Attention(nn.Module):
    def __init__(self, sizes):
        super().__init__()
        self.head_dim, self.rope_theta = sizes.head_dim, sizes.rope_theta
        self.wq, self.wk, self.wv, self.wo = (nn.Linear(sizes.dim, sizes.dim, bias=False) for _ in range(4))
        # attend(q, k, v, positions) -> out, each (batch, heads, seq, head_dim): context parallelism replaces it with
        # ring attention, whose keys come from every rank
        self.attend = causal_self_attention

    def forward(self, x, positions):
        """x (batch, seq, dim) at global `positions` (seq,). The heads are counted from the projections' width, so
        that a tensor-parallel rank whose wq, wk, wv hold some heads' rows runs the same code on those heads."""
        batch, seq, _ = x.shape
        q, k, v = (split_heads(w(x), self.head_dim) for w in (self.wq, self.wk, self.wv))
        cos, sin = rope_angles(positions, self.head_dim, self.rope_theta)
        q, k = apply_rope(q, cos, sin), apply_rope(k, cos, sin)
        out = self.attend(q, k, v, positions)
        return self.wo(out.transpose(1, 2).reshape(batch, seq, -1))


def split_heads(x, head_dim):
    """(batch, seq, heads * head_dim) -> (batch, heads, seq, head_dim)."""
    batch, seq, width = x.shape
    return x.view(batch, seq, width // head_dim, head_dim).transpose(1, 2)


class FeedForward(nn.Module):
    def __init__(self, sizes):
        super().__init__()
        self.w1 = nn.Linear(sizes.dim, sizes.ffn_dim, bias=False)
        self.w2 = nn.Linear(sizes.ffn_dim, sizes.dim, bias=False)

    def forward(self, x):
        return self.w2(F.gelu(self.w1(x)))


class Block(nn.Module):
    def __init__(self, sizes):
        super().__init__()
        self.attention_norm, self.attention = RMSNorm(sizes.dim), Attention(sizes)
        self.ffn_norm, self.feed_forward = RMSNorm(sizes.dim), FeedForward(sizes)

    def forward(self, x, positions):
        h = x + self.attention(self.attention_norm(x), positions)
        return h + self.feed_forward(self.ffn_norm(h))


class Transformer(nn.Module):
    def __init__(self, sizes):
        super().__init__()
        self.sizes = sizes
        self.tok_embeddings = nn.Embedding(sizes.vocab_size, sizes.dim)
        self.layers = nn.ModuleDict({str(i): Block(sizes) for i in range(sizes.num_layers)})
        self.norm = RMSNorm(sizes.dim)
        self.output = nn.Linear(sizes.dim, sizes.vocab_size, bias=False)

    def forward(self, tokens, positions=None):
        """tokens (batch, seq) -> logits (batch, seq, vocab); `positions`: the tokens' global positions
        (default 0 .. seq-1). A pipeline stage whose tok_embeddings (output) is None takes (returns) hidden states."""
        h = self.tok_embeddings(tokens) if self.tok_embeddings is not None else tokens
        if positions is None:
            positions = torch.arange(h.shape[1])
        for block in self.layers.values():
            h = block(h, positions)
        return self.output(self.norm(h)) if self.output is not None else h


# ---------------------------------------------------------------- weights, data, loss

def initial_value(name, shape, seed, dtype=torch.float64):
    """A parameter's starting value, from (seed, its name) alone: norms 1; the embedding randn; a linear layer's
    weight randn / sqrt(fan_in), which keeps x @ W.T at the scale of x."""
    if name.endswith("norm.weight"):
        return torch.ones(shape, dtype=dtype)
    draw = torch.randn(shape, generator=generator(seed, TRANSFORMER_WEIGHTS, name), dtype=torch.float64)
    scale = 1.0 if name.startswith("tok_embeddings") else shape[-1] ** -0.5
    return (draw * scale).to(dtype)  # drawn in float64: every dtype holds the same model, rounded


def init_weights(model, seed=0):
    """Set every parameter `model` has to its initial value by name: a stage holding some layers gets the values
    the whole model has."""
    with torch.no_grad():
        for name, p in model.named_parameters():
            p.copy_(initial_value(name, p.shape, seed, p.dtype))
    return model


def build_transformer(sizes, seed=0, dtype=torch.float64):
    """The model notebooks 09, 10 and 12 train: the same weights in any process, from `seed` alone."""
    if not isinstance(sizes, TransformerSizes):
        raise TypeError(f"sizes must be a TransformerSizes, got {type(sizes).__name__}")
    with torch.device("meta"):  # no default init: it would draw from (and advance) the global RNG
        model = Transformer(sizes)
    return init_weights(model.to_empty(device="cpu").to(dtype), seed)


def make_tokens(sizes, seed=0, step=0):
    """Step `step`'s batch: (inputs, targets), each (batch, seq); targets are the inputs shifted by one token."""
    step, seed = check_int("step", step, 0), check_int("seed", seed, 0)
    tokens = torch.randint(sizes.vocab_size, (sizes.batch_size, sizes.seq_len + 1),
                           generator=generator(seed, TOKENS, step))
    return tokens[:, :-1], tokens[:, 1:]


def lm_loss(logits, targets):
    """Next-token cross-entropy, the mean over every token of the batch."""
    return F.cross_entropy(logits.flatten(0, 1), targets.flatten())


def train_transformer_reference(sizes, num_steps, seed=0, lr=1e-2, dtype=torch.float64):
    """The single-process run that the parallel versions reproduce: (final parameters by name, losses by step),
    AdamW as the course's (utils.model.make_optimizer)."""
    model = build_transformer(sizes, seed, dtype)
    batches = (make_tokens(sizes, seed, step) for step in range(check_int("num_steps", num_steps, 0)))

    def forward_backward(model, batch):
        inputs, targets = batch
        loss = lm_loss(model(inputs), targets)
        loss.backward()
        return loss

    losses = train(model, make_optimizer(model.parameters(), "adamw", lr), batches, forward_backward=forward_backward)
    return {name: p.detach().clone() for name, p in model.named_parameters()}, losses
