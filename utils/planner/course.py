"""The course's small model on gloo: the bytes each rank sends per group, against what notebooks 05, 09, 10 and 12
count at the calls and at the sockets (the formulas the planner's communication terms stand on)."""
from utils.planner.communication import collective_bytes
from utils.sizes import check_int, divide

# ---------------------------------------------------------------- the course's small model on gloo: bytes per group
#
# What each rank sends per step on each group of notebook 12's run, for comparison with the bytes it counts at the
# sockets. Assumptions, each one line to change if the notebook's composition differs: FSDP2 (fully_shard on every
# layer, then on the whole model) gathers each layer in forward and again in backward, the root's own parameters
# (tok_embeddings, norm, output) once, and reduce-scatters every unit's gradients, per micro-batch (its defaults);
# tensor parallel shards wq, wk, wv, w1 by rows and wo, w2 by columns (utils.sequence_parallel), and leaves the
# embeddings, the norms and output whole; sequence parallel all-reduces the two norms' weight gradients per layer.
# Checked against FSDP2 on this model (tests/test_planner.py): the bytes its all-gathers return and its
# reduce-scatters keep, call by call, and what gloo writes to the sockets (within 2%: message headers).

def fsdp_unit_bytes(shapes, world_size, element_size):
    """The bytes a unit's all-gather returns, padded as FSDP2 pads: every parameter cut along dim 0 into world_size
    chunks of ceil(rows / N) rows."""
    total = 0
    for shape in shapes:
        rows = -(-shape[0] // world_size)
        rest = 1
        for d in shape[1:]:
            rest *= d
        total += world_size * rows * rest
    return total * element_size


def fsdp_bytes(units, world_size, element_size, backend="gloo", gathers=None):
    """Bytes each rank sends per forward and backward of FSDP on `units` ({name: [shapes]}): gathers[name]
    all-gathers (default 2: forward, and backward after resharding) and one reduce-scatter of the gradients each.
    On a ring 3(N-1)/N of the model's bytes; on gloo, whose reduce-scatter is an all-reduce, 4(N-1)/N (notebook 05)."""
    gathers = gathers or {}
    sent = 0.0
    for name, shapes in units.items():
        size = fsdp_unit_bytes(shapes, world_size, element_size)
        sent += gathers.get(name, 2) * collective_bytes("all_gather", world_size, size, backend)
        sent += collective_bytes("reduce_scatter", world_size, size, backend)
    return sent


def tensor_parallel_layer_bytes(batch, seq, dim, world_size, element_size, backend="gloo", sequence_parallel=True,
                                norms=True):
    """Bytes each rank sends on the tensor-parallel group per layer, forward and backward (notebook 09): two column/
    row pairs, each crossed by M = batch seq dim e bytes in both directions; tensor parallel alone, an all-reduce per
    crossing (forward after the row layer, backward before the column layer); with sequence parallel an all-gather
    and a reduce-scatter per pair and direction, plus (`norms`) the all-reduce of the two norms' weight gradients
    (2 dim e; a composition with FSDP all-reduces them once per step, on their data shard: small_model_bytes)."""
    m = batch * seq * dim * element_size
    if not sequence_parallel:
        return 4 * collective_bytes("all_reduce", world_size, m, backend)
    pairs = 4 * (collective_bytes("all_gather", world_size, m, backend)
                 + collective_bytes("reduce_scatter", world_size, m, backend))
    return pairs + 2 * collective_bytes("all_reduce", world_size, dim * element_size, backend) * norms


def ring_attention_bytes(batch, heads, seq, head_dim, world_size, element_size, backward=True):
    """Bytes each rank sends in ring attention (notebook 09): its keys and values, 2 B H (S/N) D e, make N-1 hops
    forward; backward N-1 hops again and their gradients N (home): (2N-1) blocks."""
    block = 2 * batch * heads * (seq // world_size) * head_dim * element_size
    return (world_size - 1) * block + (2 * world_size - 1) * block * backward


def expert_dispatch_bytes_per_token(dim, top_k, element_size):
    """Bytes one token's copies hand to the all-to-alls of a MoE layer, forward and backward (notebook 10):
    k copies of dim elements, out and back, in each pass, 2 k h e 2; (N-1)/N of them leave the rank."""
    return 2 * top_k * dim * element_size * 2


def small_model_units(sizes, tp=1, pp=1, stage=0):
    """{FSDP unit: [parameter shapes on one tensor-parallel rank]} of utils.transformer's model on pipeline stage
    `stage`: one unit per layer, and the root's own parameters (tok_embeddings on the first stage, the final norm and
    output on the last). Tensor parallel cuts wq, wk, wv, w1 by rows, wo, w2 by columns; norms and embeddings whole."""
    from utils.pipeline import stage_layers  # the course's split: the first L % p stages take one more layer
    from utils.sequence_parallel import COLUMN, ROW

    divide("num_heads", sizes.num_heads, "tp", tp, "each tensor-parallel rank computes whole heads")
    divide("ffn_dim", sizes.ffn_dim, "tp", tp, "each tensor-parallel rank holds as many MLP features")
    d, v, f = sizes.dim, sizes.vocab_size, sizes.ffn_dim
    block = {"attention_norm.weight": (d,), "attention.wq.weight": (d, d), "attention.wk.weight": (d, d),
             "attention.wv.weight": (d, d), "attention.wo.weight": (d, d), "ffn_norm.weight": (d,),
             "feed_forward.w1.weight": (f, d), "feed_forward.w2.weight": (d, f)}

    def on_rank(name, shape):
        if name in COLUMN:
            return (shape[0] // tp, *shape[1:])
        return (shape[0], shape[1] // tp) if name in ROW else shape

    units = {f"layers.{i}": [on_rank(n, s) for n, s in block.items()]
             for i in stage_layers(sizes.num_layers, pp)[check_int("stage", stage, 0)]}
    units["root"] = [(v, d)] * (stage == 0) + [(d,), (v, d)] * (stage == pp - 1)
    return units


def small_model_bytes(sizes, dp=1, tp=1, pp=1, cp=1, num_micro_batches=1, stage=0, element_size=8, backend="gloo",
                      sequence_parallel=True, gathers_per_step=2):
    """{group: bytes} that one rank of pipeline stage `stage` sends in one training step of utils.transformer's
    model (TransformerSizes `sizes`, float64 by default) on the mesh (pp, dp, cp, tp), with the assumptions above.
    The batch is split over dp and then into micro-batches; the sequence over cp (ring attention). FSDP all-gathers
    each layer `gathers_per_step` times per micro-batch and the root's own weights once (2: FSDP2, which frees a layer
    after its forward and gathers and reduce-scatters again for every micro-batch; 1: notebook 12's FlatShards, which
    gathers the model once per step and reduce-scatters once, after the last micro-batch: measured in its section
    3, on 2 pipeline stages of 2 micro-batches). The weights whole on every tensor
    rank (norms, embeddings, output) saw different chunks of the sequence: their gradients are all-reduced over tp
    once per step, on the shard FSDP's reduce-scatter left (notebook 12, section 2)."""
    for name, value in (("dp", dp), ("tp", tp), ("pp", pp), ("cp", cp), ("num_micro_batches", num_micro_batches)):
        check_int(name, value)
    micro = divide("batch_size / dp", divide("batch_size", sizes.batch_size, "dp", dp, "replicas get equal batches"),
                   "num_micro_batches", num_micro_batches, "micro-batches are equal")
    seq = divide("seq_len", sizes.seq_len, "cp", cp, "every context-parallel rank holds a chunk")
    if sequence_parallel and tp > 1:
        divide("seq_len / cp", seq, "tp", tp, "sequence parallel splits each rank's chunk over tp")
    units = small_model_units(sizes, tp, pp, stage)
    layers, m, d = len(units) - 1, num_micro_batches, sizes.dim
    gathers = {name: 1 if name == "root" else gathers_per_step for name in units}
    rounds = m if gathers_per_step > 1 else 1  # FlatShards: one gather and one reduce-scatter per step
    sent = {"dp": rounds * fsdp_bytes(units, dp * cp, element_size, backend, gathers) if dp * cp > 1 else 0.0}
    sent["tp"] = 0.0
    if tp > 1:
        norms = [shape for name, shapes in units.items() if name != "root" for shape in shapes if len(shape) == 1]
        # tensor parallel alone: every rank saw the whole sequence, and the whole weights' gradients agree
        whole = norms + units["root"] if sequence_parallel else []
        whole_bytes = fsdp_unit_bytes(whole, dp * cp, element_size) / (dp * cp)
        sent["tp"] = (m * layers * tensor_parallel_layer_bytes(micro, seq, d, tp, element_size, backend,
                                                               sequence_parallel, norms=False)
                      + collective_bytes("all_reduce", tp, whole_bytes, backend))
    hand_off = micro * seq * d * element_size / (tp if sequence_parallel else 1)
    sent["pp"] = m * hand_off * ((stage < pp - 1) + (stage > 0))
    sent["cp"] = (m * layers * ring_attention_bytes(micro, sizes.num_heads // tp, sizes.seq_len, sizes.head_dim, cp,
                                                    element_size) if cp > 1 else 0.0)
    return sent
