"""The course's transformer trained with context parallelism (notebook 09): every rank holds a chunk of each
sequence's tokens, at their global positions, and its attention is ring attention, whose keys come from every rank.

    model = build_transformer(sizes, seed)
    use_attention(model, ring_attend(RingAttention, positions))    # each block's attention, through the ring
    train(model, optimizer, batches, forward_backward=...)          # the notebook's exercise, on every rank

Nothing else in the model changes: the embeddings, norms and MLP act token by token, so a chunk of tokens goes
through them as it would in one process; RoPE rotates each query and key by its global position; and the
gradients of the (replicated) weights are partial sums over each rank's tokens, averaged over the ranks as in
data parallelism.
"""
from utils.model import make_optimizer, train
from utils.transformer import build_transformer, make_tokens

LEARNING_RATE = 1e-2  # utils.transformer.train_transformer_reference's default


def use_attention(model, attend):
    """Every block's attention computes its scores with `attend(q, k, v, positions)`."""
    for block in model.layers.values():
        block.attention.attend = attend
    return model


def ring_attend(ring_attention, positions, mask="causal", group=None):
    """attend() through `ring_attention.apply(q, k, v, positions, mask)` (an autograd function): `positions[r]`
    are rank r's global positions, which the ring masks by. With `group` (utils.ring_attention.RingAttention), the
    ring runs on that process group, positions[r] being its rank r's."""
    def attend(q, k, v, _):
        if group is None:
            return ring_attention.apply(q, k, v, positions, mask)
        return ring_attention.apply(q, k, v, positions, mask, group)
    return attend


def train_main(rank, world_size, forward_backward, ring_attention, positions, sizes, num_steps, seed=0):
    """Train on this rank's chunks with the course's loop (utils.model.train), each batch (inputs, targets,
    positions) of the whole sequence: (final parameters by name, this rank's losses, the gradients by name the
    first optimizer step saw)."""
    model = use_attention(build_transformer(sizes, seed), ring_attend(ring_attention, positions))
    optimizer = make_optimizer(model.parameters(), "adamw", LEARNING_RATE)
    first = {}

    def note_gradients(optimizer, args, kwargs):
        if not first:
            first.update({name: None if p.grad is None else p.grad.clone() for name, p in model.named_parameters()})

    optimizer.register_step_pre_hook(note_gradients)
    batches = ((*make_tokens(sizes, seed, step), positions) for step in range(num_steps))
    losses = train(model, optimizer, batches, forward_backward=forward_backward)
    return {name: p.detach().clone() for name, p in model.named_parameters()}, losses, first
