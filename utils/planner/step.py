"""Time per step: each layer's compute (compute.py) and the communication it does not hide, per micro-batch, on
the slowest pipeline stage; the pipeline's bubble by schedule (notebook 11's functions); what the data axis does
once per step; the optimizer.

Overlap is decided layer by layer: a transfer hides behind the computation it runs beside, and what is longer
than that computation is exposed.
    tp  per layer, pass and column/row pair (2 per dense layer, 1 per MoE layer): an all-gather and a
        reduce-scatter of the micro-batch's activations M = b (s/cp) h e (sequence parallel, notebook 09; with
        Float8, the all-gather in 1-byte elements, as torchao's float8 tensor parallel casts before it); exposed,
        unless Config.tp_overlap (AsyncTP, async_tp_seconds): then each collective beside the products it is fused
        with, (t-1)/t of them, plus what the micro-pipeline adds (t pieces per product, the shard's copy into
        symmetric memory, the sum of the received partials); backward, the reduce-scatters of the column-parallel
        products' summed input gradients stay exposed (they fuse with no one product).
    cp  ring attention (notebook 09): keys and values of the rank's heads, K = 2 b (s/cp) kv/t e, hop cp - 1 times
        forward, each hop beside one block of attention: exposed where the block is shorter than the hop; backward
        cp - 1 hops of keys, values and their gradients beside a block's backward, then the gradients' hop home.
        cp_mode "all_gather" (Llama 3): one all-gather of K forward, a reduce-scatter of its gradient backward,
        exposed. The ring's own work per hop (the fp32 merge of each block's output, the send buffers:
        RING_HOP_WORK) is the device's, counted with the compute. PyTorch's context_parallel (torchtitan's) keeps
        the ring's kernels but by default gathers the keys and values in one all-gather, issued before the local
        block and waited for after it (_attention.py, _AllGatherRotater; dK, dV rotated by all-to-all): priced as
        the ring: at the published CP rows' 32K tokens per rank both hide behind attention (405B, CP 8 across nodes:
        a 117 MB gather, 2.7 ms, beside a 29 ms local block); at 1K-token blocks the gather would show more.
    ep  per MoE layer and pass: dispatch and combine, two all-to-alls of the rank's T/t tokens' top_k copies
        (notebook 10; at most topk_group of them between nodes, Model.topk_group), exposed, unless
        Config.ep_overlap (DeepSeek-V3's DualPipe), then what the layer's computation does not hide.
    pp  per micro-batch and piece, the activations forward and their gradient backward, M / t (notebook 04); M
        from every tensor-parallel rank without sequence parallel and Config.pp_scatter_gather; two in series per
        pass with Config.pp_blocking (DeepSpeed's pipeline engine).
    dp  FSDP (ZeRO-3), per micro-batch and layer: an all-gather forward, prefetched beside the previous layer's
        forward; an all-gather and a reduce-scatter backward, beside the layer's backward; the first gather and the
        last reduce-scatter exposed. ZeRO-2: the reduce-scatter per micro-batch (its gradients are sharded, so each
        micro-batch's must leave before the next accumulates), ZeRO-0/1 once per step (all-reduce, reduce-scatter)
        beside the last micro-batch's backward, layer by layer; ZeRO-1/2's all-gather of the updated weights beside
        the next step's first forward, layer by layer (Megatron-LM's --overlap-param-gather). Config.prefetch
        False: FSDP's gathers are issued when a layer starts, exposed, ZeRO-1/2's per-step ones too (FairScale's
        FSDP without resharding, which OPT ran); its reduce-scatters still overlap.
        The weights outside the layers (embedding, final norm, output layer: FSDP2's root unit) on the first and
        last pipeline ranks: gathered and reduced, exposed, per micro-batch with FSDP, once per step otherwise.
    bubble  1F1B (p-1)(F+B+W); interleaved (p-1)(F+B+W)/v; ZB-H1 (p-1)(F+B-W) for m >= p, counted exactly with
        idle_slots below that (utils.pipeline, notebook 11). F, B, W: the slowest stage's forward, input-gradient
        and weight-gradient times per micro-batch, their exposed communication included.
    optimizer  Adam on the rank's shard: its states read and written, memory-bound. With Config.accumulate_fp32
        (DeepSpeed's BF16_Optimizer), each micro-batch's gradients added into fp32 ones after its backward.
"""
import functools
import operator

from utils.pipeline import formula_idle_share, idle_slots, zb_h1_order
from utils.planner.communication import collective_seconds, group_links
from utils.planner.compute import (kv_width, layer_times, memory_bound_seconds, output_layer_seconds,
                                   tp_pair_products)
from utils.planner.describe import check_config, rank_layer_kinds, ranks_alike
from utils.planner.memory import held_value, model_state_bytes, stage_params


# what a run's framework did (describe.Config): fixed for a search, read by the layer's times and transfers
CHOICES = ("sequence_parallel", "prefetch", "pp_scatter_gather", "pp_whole_grads", "pp_blocking", "gather_copies",
           "accumulate_fp32", "float8", "fused", "ep_overlap")

# The ring's own work per hop after the first, beside each block's attention kernel: the block's output and
# log-sum-exp folded into the running ones in fp32 (the online softmax's correction), and the send buffer of keys
# and values (and, backward, their gradients) assembled. PyTorch's context_parallel, which torchtitan runs
# (torch/distributed/tensor/experimental/_attention.py, _templated_ring_attention and _SDPAMerger), does it in eager
# kernels: the block output cast to fp32 (2 + 4 bytes per element), out - block_out (12), sigmoid(...) times it
# (8), out minus that (12): 38 bytes per element of the rank's attention output, and with the log-sum-exp's
# casts, sigmoid and logsigmoid and the torch.cat of K and V, 11 kernels; TransformerEngine's ring (Megatron-Core)
# fuses the correction: the fp32 output read and written and the block's read, 10 bytes, in about 3 kernels.
# Backward, per hop: dq accumulated in fp32 (10 bytes per element) and dk, dv accumulated and sent on. At 8K-token
# blocks this is a few % of a layer; at 1K-token blocks (cp 8 at 8K, cp 32 at 32K) it is what makes context parallel
# at short sequences cost more than its hops (Megatron-Core's context-parallel guide: CP for long sequences).
# {fused: (forward bytes per output element, forward kernels, backward bytes per element, backward kernels)}
RING_HOP_WORK = {False: (38, 11, 10, 6), True: (10, 3, 10, 3)}


# DeepSpeed's BF16_Optimizer (deepspeed/runtime/bf16_optimizer.py, update_hp_grads, called by the pipeline engine
# after each micro-batch's backward since v0.6.2, 'bf16+pipeline parallelism'): every bf16 gradient cast to fp32 (2
# bytes read, 4 written) and added to the fp32 one (4 + 4 read, 4 written), bytes per parameter of the stage.
ACCUMULATE_BYTES = 18


def bubble_seconds(schedule, num_stages, num_micro_batches, num_virtual=1, forward=1.0, backward=1.0, weight=1.0):
    """The pipeline's idle time per step, on the slowest stage's times (forward F, input gradient B, weight
    gradient W per micro-batch). 1F1B and interleaved: notebook 11's idle share, (p-1)/(m+p-1) and
    (p-1)/(vm+p-1) of the step, scaled to these times; ZB-H1: Qi et al. 2023's (p-1)(F+B-W), which holds for
    m >= p; below that the step is played exactly (idle_slots on zb_h1_order)."""
    p, m, v = num_stages, num_micro_batches, num_virtual
    busy = m * (forward + backward + weight)
    if p == 1:
        return 0.0
    if schedule in ("1F1B", "interleaved"):
        share = formula_idle_share(schedule, p, m, v)
        return share / (1 - share) * busy
    if m >= p:
        return (p - 1) * max(forward + backward - weight, 0.0)
    # the step's length is proportional to the times: played once per (p, m) and ratio of F and B to W, to 1% of W
    scale = weight or forward or 1.0
    return scale * _zb_h1_idle(p, m, round(forward / scale, 2), round(backward / scale, 2), weight / scale)


@functools.lru_cache(maxsize=4096)
def _zb_h1_idle(p, m, forward, backward, weight):
    orders = [zb_h1_order(stage, p, m) for stage in range(p)]
    _, length = idle_slots(orders, durations={"F": forward, "B": backward, "W": weight})
    return length - m * (forward + backward + weight)


def step_seconds(model, cluster, config, global_batch):
    """{compute, tp, cp, ep, pp, dp, bubble, optimizer, exposed, step, mfu, flops_per_device} for one step, seconds
    (mfu: the model FLOPs of the step, without recomputation, over the devices' peak for its time)."""
    return _step_seconds(model, cluster, config, global_batch, check_config(model, cluster, global_batch, config))


def _memo(*fields):
    """Cache a function of (model, cluster, config) on the config's `fields` alone: the search asks for the same
    per-layer terms for every recomputation, schedule and interleaving of a split (tests/test_planner.py checks
    the search against the same functions uncached, through __wrapped__). The model and the cluster are keyed by
    identity, a table for each pair (memory.held_value): hashing a Model's fields costs more than a lookup."""
    def wrap(function):
        tables, values = {}, operator.attrgetter(*fields) if fields else (lambda config: ())

        @functools.wraps(function)
        def cached(model, cluster, config):
            return held_value(tables, (id(model), id(cluster)), (model, cluster), values(config),
                              lambda: function(model, cluster, config))
        cached.cache_clear = tables.clear
        return cached
    return wrap


_LAYER_FIELDS = ("dp", "tp", "pp", "cp", "ep", "micro_batch_size", "zero_stage", "cp_mode", "tp_overlap", *CHOICES)


@_memo(*_LAYER_FIELDS)
def _layer_terms(model, cluster, config):
    """One layer and micro-batch, whatever the recomputation and schedule: its times, each group's exposed
    communication forward and backward, the data axis's gather and reduce of its weights, the pipeline's hand-off,
    the output layer's (forward, backward), the ring's own work (forward, backward) and the root's transfers."""
    c, links, lt = config, group_links(cluster, config), layer_times(model, cluster, config)
    e, t = model.activation_bytes, config.tp

    def on(group, op, size):
        n, link = links[group]
        return collective_seconds(op, n, size, link) if n > 1 else 0.0

    tokens = c.micro_batch_size * model.seq_len // c.cp
    activations = tokens * model.dim * e

    # per layer and micro-batch: exposed communication, forward and backward
    pairs = 1 if model.moe else 2
    # Float8 (Config.float8) with tensor parallel: torchao's Float8ColwiseParallel, Float8RowwiseParallel and
    # PrepareFloat8ModuleInput (torchao/float8/float8_tensor_parallel.py), which torchtitan applies with Float8 and TP
    # (torchtitan/parallelisms/parallelize_llama.py at 9dec370), cast each input to float8 before its all-gather and,
    # backward, each output's gradient before its all-gather: the gathers move 1 byte an element; the reduce-scatters
    # (of the products' 16-bit outputs and input gradients) 2
    gathered = tokens * model.dim * (1 if c.float8 else e)
    tp_gather, tp_scatter = on("tp", "all_gather", gathered), on("tp", "reduce_scatter", activations)
    tp_f = tp_b = pairs * (tp_gather + tp_scatter)
    if c.tp_overlap and t > 1:
        tp_f, tp_b = async_tp_seconds(model, cluster, c, tp_gather, tp_scatter, gathered, activations)
    kv_block = tokens * kv_width(model, t) * e
    merge_f = merge_b = 0.0
    if c.cp_mode == "ring":
        block = lt.attention / c.cp
        hop, hop_back = on("cp", "send", kv_block), on("cp", "send", 2 * kv_block)
        cp_f = (c.cp - 1) * max(0.0, hop - block)
        cp_b = (c.cp - 1) * max(0.0, hop_back - 2 * block) + hop * (c.cp > 1)
        merge_f, merge_b = ring_merge_seconds(cluster, c, tokens * model.dim // t, kv_block)
    else:
        cp_f = on("cp", "all_gather", c.cp * kv_block)
        cp_b = on("cp", "reduce_scatter", c.cp * kv_block)
    # dispatch and combine: the rank's T/t tokens' top_k copies; with node-limited routing (DeepSeek-V3, section
    # 2.1.2: a token's experts on at most topk_group nodes) at most topk_group copies cross between nodes, the rest
    # forwarded over NVLink inside the node beside them (section 3.2.2)
    copies = model.top_k * model.capacity_factor
    if model.topk_group and links["ep"][1] is not cluster.intra:
        copies = min(copies, model.topk_group)
    a2a = on("ep", "all_to_all", tokens / t * copies * model.dim * e) if model.moe else 0
    ep_f = ep_b = 2 * a2a
    if c.ep_overlap:  # DualPipe: hidden behind another micro-batch's computation, what that does not cover exposed
        ep_f, ep_b = max(0.0, ep_f - lt.forward), max(0.0, ep_b - lt.input_grad - lt.weight_grad)

    # the data axis, per layer (experts on their own copies' group)
    n, _ = links["dp"]

    def dp_layer(op, per_param, dense_params, expert_params):
        expert_n, link = n // c.ep, links["dp"][1]
        return (on("dp", op, dense_params / t * per_param)
                + (collective_seconds(op, expert_n, expert_params / c.ep * per_param, link) if expert_n > 1 and expert_params else 0))

    layer_args = (model.layer_dense_params, model.layer_expert_params)
    gather = dp_layer("all_gather", model.param_bytes, *layer_args)
    if c.gather_copies and c.zero_stage == 3:  # DeepSpeed 0.3's ZeRO-3 (Config.gather_copies)
        gather += gather_copies_seconds(model, cluster, n)
    reduce_op = "all_reduce" if c.zero_stage == 0 else "reduce_scatter"
    reduce = dp_layer(reduce_op, model.grad_bytes, *layer_args)
    whole = not (c.sequence_parallel or c.pp_scatter_gather)  # every tensor-parallel rank sends all of it
    split = on("pp", "send", activations / (1 if whole else t)) if c.pp > 1 else 0.0
    # (activations forward, their gradients backward); Config.pp_whole_grads: the gradients whole from every rank
    pp_send = (split, on("pp", "send", activations) if c.pp > 1 and c.pp_whole_grads else split)
    # DeepSpeed's pipeline engine (Config.pp_blocking): a forward step receives its input, then sends the previous
    # step's gradient back; a backward step sends the previous step's output on, then receives its gradient; each
    # blocking until its neighbour's pair posts ("the communication is blocking and must be paired",
    # deepspeed/runtime/pipe/schedule.py): an activation's and a gradient's hand-off in series in every pass, where
    # batched isend/irecv pays one
    if c.pp_blocking:
        pp_send = (sum(pp_send), sum(pp_send))
    out_f, out_b = output_layer_seconds(model, cluster, c)
    roots = root_unit_seconds(model, c, *links["dp"])
    return lt, tp_f, tp_b, cp_f, cp_b, ep_f, ep_b, gather, reduce, n, pp_send, out_f, out_b, merge_f, merge_b, roots


def async_tp_seconds(model, cluster, config, gather, scatter, gathered_bytes, scattered_bytes):
    """(forward, backward) exposed seconds per layer and micro-batch of tensor parallel under AsyncTP (PyTorch's
    micro-pipeline TP: torch/_inductor/fx_passes/micro_pipeline_tp.py rewrites each all-gather followed by products
    of the gathered input into fused_all_gather_matmul, each product followed by a reduce-scatter into
    fused_matmul_reduce_scatter; torch/distributed/_symmetric_memory/__init__.py runs them). gather, scatter: one
    collective's seconds as NCCL would run it; gathered_bytes, scattered_bytes: the whole tensors.
    Each collective hides behind the products it is fused with only, not behind the layer's others: the
    all-gather behind the column-parallel products of the gathered input (wq, wk, wv; w1, w3), the reduce-scatter
    behind the row-parallel product (wo; w2); backward, the gather of the output gradient behind the row-parallel
    product's input gradient, while the reduce-scatter of the column products' summed input gradients is no
    product's output: exposed. Each fused pair runs as t pieces of t - 1 copies between peers
    (_pipelined_all_gather_and_consume, _pipelined_produce_and_all2all): the first piece's product (the rank's own
    shard, or its own chunk) has no copy beside it, so (t - 1)/t of the products hide the collective (PyTorch 2.13's
    code; late 2024's ran the own shard's piece before the first copy, (t - 2)/t for a gather: 0.1% of torchtitan's
    70B AsyncTP step); the t pieces cost t - 1 more kernels per product (at the device's fixed cost); the gather first
    copies the rank's shard into its symmetric-memory buffer (read and written), and the reduce-scatter ends with a
    sum of the t partial chunks it received (torch.sum over the stacked partials: the whole output read, 1/t of it
    written), both memory-bound and exposed. Not counted: the pieces are cut along the sequence
    (A.movedim(scatter_dim, 0).flatten(0, -2)), a copy of A with more than one sequence a micro-batch, but the
    inductor pass asks A's producer for that layout (force_stride_order with restride_A_for_fused_matmul_reduce_
    scatter, restride_A_shard_for_...), so the element-wise kernel that makes A writes it so."""
    t = config.tp
    share = (t - 1) / t
    shard_copy = memory_bound_seconds(2 * gathered_bytes / t, cluster)
    reduce = memory_bound_seconds(scattered_bytes * (1 + 1 / t), cluster)
    pieces = (t - 1) * cluster.kernel_seconds if cluster.mfu is None else 0.0  # t kernels a product, not one
    forward = backward = 0.0
    for columns, count, row in tp_pair_products(model, cluster, config):
        forward += (max(0.0, gather - share * columns) + count * pieces + shard_copy
                    + max(0.0, scatter - share * row) + pieces + reduce)
        backward += max(0.0, gather - share * row) + pieces + shard_copy + scatter
    return forward, backward


def gather_copies_seconds(model, cluster, n):
    """What DeepSpeed 0.3's ZeRO-3 adds to each gather of a layer (Narayanan et al. 2021's ZeRO-3 baseline): its
    fetch_sub_module gathers each weight tensor apart (deepspeed/runtime/zero/partition_parameters.py at v0.3.15,
    _allgather_param: torch.cuda.synchronize(), then torch.distributed.all_gather into a list of the n ranks'
    views), and PyTorch's ProcessGroupNCCL::allgather of a list gathers into a flat buffer and copies each of the n
    shards out, one copy_ each: n kernels per tensor, each at the device's fixed cost per kernel, waited for before
    the next tensor's gather starts. Its reduce-scatters (a list too) run on a side stream beside the backward
    (stage3.py, average_tensor on reduction_stream), as the planner counts them, though the next fetch's
    torch.cuda.synchronize() waits for them (not priced: communication.py's known limit). None at a fixed mfu."""
    if n == 1 or cluster.mfu is not None:
        return 0.0
    return model.layer_weight_tensors * n * cluster.kernel_seconds


def ring_merge_seconds(cluster, config, output_elements, kv_block_bytes):
    """(forward, backward) seconds of the ring's own work beside its attention kernels, per layer and micro-batch:
    cp - 1 hops of RING_HOP_WORK, memory-bound, each kernel at the device's fixed cost (none at a fixed mfu)."""
    hops = config.cp - 1
    if hops == 0 or cluster.mfu is not None:
        return 0.0, 0.0
    bytes_f, kernels_f, bytes_b, kernels_b = RING_HOP_WORK[config.fused]
    forward = memory_bound_seconds(bytes_f * output_elements + 2 * kv_block_bytes, cluster)
    backward = memory_bound_seconds(bytes_b * output_elements + 2 * 5 * kv_block_bytes, cluster)  # dk, dv: 10 B
    return (hops * (forward + kernels_f * cluster.kernel_seconds),
            hops * (backward + kernels_b * cluster.kernel_seconds))


@_memo("dp", "tp", "pp", "cp", "ep", "zero_stage", "v")
def _optimizer_seconds(model, cluster, config):
    """Adam on the rank's shard: its states read and written, memory-bound."""
    return memory_bound_seconds(2 * sum(model_state_bytes(model, config, 0).values()), cluster)


@_memo("dp", "tp", "pp", "cp", "ep", "micro_batch_size", "recompute", "zero_stage", "v", "cp_mode", "tp_overlap",
       *CHOICES)
def _slowest_stage(model, cluster, config):
    """Per micro-batch, on the pipeline stage whose F + B + W is longest: {compute, tp, cp, ep, pp, dp, F, B, W}
    seconds; and the data axis's exposed seconds once per step (ZeRO-0/1's gradients, ZeRO-1/2's updated weights).
    Whatever the schedule: 1F1B and ZB-H1 share them, and differ in the bubble only."""
    c = config
    per_layer, stages = {}, []
    for stage in ranks_alike(model.num_layers, model.first_k_dense_replace, c.pp, c.v):
        (kind, layers), *others = rank_layer_kinds(model, c.pp, c.v, stage)
        if id(kind) not in per_layer:  # one lookup per layer kind, not per stage
            per_layer[id(kind)] = _per_layer(kind, cluster, c)
        part = _layers_part(per_layer[id(kind)], c, layers, stage)
        for kind, layers in others:  # the routed layers after the dense ones
            more = _layers_part(_per_layer(kind, cluster, c), c, layers, stage, ends=False)
            part = {key: value + more[key] for key, value in part.items()}
        if c.accumulate_fp32:  # DeepSpeed's BF16_Optimizer: a pass over the stage's gradients per micro-batch
            accumulate = memory_bound_seconds(ACCUMULATE_BYTES * sum(stage_params(model, c, stage)), cluster)
            part["B"], part["compute"] = part["B"] + accumulate, part["compute"] + accumulate
        stages.append(part)
    part = max(stages, key=lambda p: p["F"] + p["B"] + p["W"])
    return part, part.pop("per_step")


@_memo(*_LAYER_FIELDS, "recompute")
def _per_layer(model, cluster, config):
    """One layer's terms (_layer_terms), what recomputation adds to its backward, its forward and backward with the
    communication they expose, and what one layer's transfers leave exposed beside them (_exposed_per_layer).
    Cached: every interleaving v of a split shares them."""
    c, terms = config, _layer_terms(model, cluster, config)
    lt, tp_f, tp_b, cp_f, cp_b, ep_f, ep_b = terms[:7]
    merge_f, merge_b = terms[13:15]
    recomputed = {"full": lt.forward + merge_f, "selective": lt.attention + merge_f, "none": 0.0,
                  "selective_op": lt.matmul / 2 + lt.elementwise,  # every other product, the rest
                  "norms_up_fp8": lt.norms_up}[c.recompute]  # DeepSeek-V3's (compute.up_recompute_seconds)
    forward_layer = lt.forward + merge_f + tp_f + cp_f + ep_f
    backward_layer = lt.input_grad + lt.weight_grad + merge_b + tp_b + cp_b + ep_b
    if c.recompute == "full":
        backward_layer += tp_f + cp_f + ep_f
    backward_layer += recomputed
    return terms, recomputed, forward_layer, backward_layer, _exposed_per_layer(terms, c, recomputed, backward_layer)


def _exposed_per_layer(terms, config, recomputed, backward_layer):
    """Per layer and micro-batch, what _layers_part multiplies by the stage's layer count: each group's exposed
    time (tp, cp, ep; forward again with full recomputation), what a data-axis transfer leaves exposed beside the
    computation it runs beside (FSDP's prefetched gather beside a forward, gather and reduce-scatter beside a
    backward; a reduce-scatter alone beside a backward; a per-step gather beside a forward), and the compute. They
    read the layer's terms, the recomputation and prefetch only: computed once per layer kind, not once per
    pipeline stage."""
    c = config
    lt, tp_f, tp_b, cp_f, cp_b, ep_f, ep_b, gather, reduce = terms[:9]
    merge_f, merge_b = terms[13:15]
    full = c.recompute == "full"
    return (tp_f + tp_b + tp_f * full, cp_f + cp_b + cp_f * full, ep_f + ep_b + ep_f * full,
            max(0.0, gather - lt.forward * c.prefetch), max(0.0, gather + reduce - backward_layer),
            max(0.0, reduce - backward_layer), max(0.0, gather - lt.forward),
            lt.forward + merge_f + lt.input_grad + lt.weight_grad + merge_b + recomputed)


def _layers_part(per_layer, config, layers, stage, ends=True):
    """`layers` layers alike of pipeline stage `stage` (per_layer: _per_layer of one), per micro-batch: each
    group's exposed time, F, B, W and compute; with `ends`, the stage's hand-offs, the output layer on the last
    stage and the root unit's transfers (root_unit_seconds); and the data axis's exposed seconds once per step.
    A transfer beside each of `layers` layers' computation leaves `layers` times what it leaves beside one
    (_exposed_per_layer)."""
    c = config
    terms, recomputed, forward_layer, backward_layer, exposed = per_layer
    lt, tp_f, tp_b, cp_f, cp_b, ep_f, ep_b, gather, reduce, n, pp_send, out_f, out_b, merge_f, merge_b, roots = terms
    tp, cp, ep, gather_beside_f, fsdp_beside_b, reduce_beside_b, gather_ahead, compute = exposed

    fsdp = c.zero_stage == 3 and n > 1
    # per micro-batch: each group's exposed time, and F, B, W
    pp_f, pp_b = pp_send if ends else (0.0, 0.0)
    part = {"tp": layers * tp, "cp": layers * cp, "ep": layers * ep, "pp": c.v * (pp_f + pp_b)}
    dp_f = gather + (layers - 1) * gather_beside_f if fsdp else 0.0
    dp_b = ((layers * fsdp_beside_b) if c.prefetch else  # gathers on demand
            layers * gather + layers * reduce_beside_b) + reduce if fsdp else 0.0
    if c.zero_stage == 2 and n > 1:
        dp_b = layers * reduce_beside_b + reduce
    root_gather, root_reduce = roots.get(stage, (0.0, 0.0)) if ends else (0.0, 0.0)
    if fsdp:  # the root unit: gathered before the first layer runs, reduce-scattered after the last gradient
        dp_f, dp_b = dp_f + root_gather, dp_b + root_reduce
    elif c.zero_stage == 2:
        dp_b += root_reduce
    last = stage == c.pp - 1 and ends
    part["dp"] = dp_f + dp_b
    part["F"] = layers * forward_layer + out_f * last + c.v * pp_f + dp_f
    part["W"] = layers * lt.weight_grad + out_b / 2 * last
    part["B"] = layers * backward_layer - part["W"] + out_b * last + c.v * pp_b + dp_b
    part["compute"] = layers * compute + (out_f + out_b) * last
    part["per_step"] = 0.0
    if n > 1:  # once per step: ZeRO-0/1's gradients, ZeRO-1/2's updated weights (the root's last and first)
        if c.zero_stage <= 1:
            part["per_step"] += layers * reduce_beside_b + reduce + root_reduce
        if c.zero_stage in (1, 2):  # the updated weights gathered beside the first forward, or on demand
            # (Config.prefetch False: FairScale's FSDP, which OPT ran with --no-reshard-after-forward, gathers a
            # unit's weights as its forward starts and waits for them, fully_sharded_data_parallel.py's forward ->
            # _rebuild_full_params -> current_stream().wait_stream(all_gather): no unit gathers the next one's)
            ahead = layers * gather_ahead + gather if c.prefetch else layers * gather
            part["per_step"] += ahead + root_gather
    return part


def root_unit_seconds(model, config, n, link):
    """{pipeline rank: (gather, reduce) seconds} on the data axis of the weights outside the layers: the embedding on
    the first rank, the final norm and the output layer on the last, vocab-parallel over tp. FSDP2 wraps them
    as the root unit, gathered once per micro-batch and reduce-scattered once (the course's small_model_bytes, checked
    call by call against FSDP2 in tests/test_planner.py; torchtitan's apply_fsdp shards the root after the blocks):
    nothing computes before the first gather or after the last reduce-scatter, so both are exposed. With a vocabulary
    of 128K they are 13% of Llama 3 8B's weights."""
    if n == 1:
        return {}
    reduce_op = "all_reduce" if config.zero_stage == 0 else "reduce_scatter"
    seconds = {}
    for stage in {0, config.pp - 1}:
        params = (model.embedding_params * (stage == 0) + model.head_params * (stage == config.pp - 1)) / config.tp
        seconds[stage] = (collective_seconds("all_gather", n, params * model.param_bytes, link),
                          collective_seconds(reduce_op, n, params * model.grad_bytes, link))
    return seconds


@_memo()
def _flops_per_token(model, cluster, config):
    return model.flops_per_token()


def _step_seconds(model, cluster, config, global_batch, m):
    c = config
    part, per_step = _slowest_stage(model, cluster, c)
    seconds = {group: m * part[group] for group in ("compute", "tp", "cp", "ep", "pp", "dp")}
    seconds["bubble"] = bubble_seconds(c.schedule, c.pp, m, c.v, part["F"], part["B"], part["W"])
    seconds["dp"] += per_step
    seconds["optimizer"] = _optimizer_seconds(model, cluster, c)
    seconds["step"] = sum(seconds.values())  # compute, tp, cp, ep, pp, dp, bubble, optimizer
    seconds["exposed"] = seconds["dp"] + seconds["cp"]
    model_flops = _flops_per_token(model, cluster, c) * global_batch * model.seq_len
    seconds["flops_per_device"] = model_flops / cluster.num_devices / seconds["step"]
    seconds["mfu"] = seconds["flops_per_device"] / cluster.peak_flops
    return seconds
