"""Memory per device, stage by stage: model states by ZeRO stage, activations by recompute mode, the fp32 logits,
FSDP's gathered units and gradient buffers, and what the allocator and the runtime take besides.

Activations are Korthikanti et al. 2022's count ("Reducing Activation Recomputation in Large Transformer Models",
section 4.1), written tensor by tensor so that it holds for other shapes than GPT-3's. Their 34 s b h + 5 a s^2 b
bytes (16-bit, dropout, a GELU MLP of 4h) are, per layer and element of s b:
    attention: the norm's input h, Q K V's input h, Q h and K, V kv_dim each, wo's input h (11 h at kv_dim = h,
               in bytes at 2 per element, with the dropout mask: 1 byte h);
               unless flash attention, the softmax's output a s, and with dropout its mask and output (5 a s);
    MLP:       the norm's input h, the first matrices' input h, then every ffn_dim-wide tensor the MLP keeps:
               GELU's input and output (2 f = 8h at f = 4h), SwiGLU's two products and their product (3 f);
               with dropout a 1-byte mask h.
With e bytes per element, s b ((6h + 2 kv_dim + 2 or 3 f) e + 2h masks + a s (e + (1 + e) dropout)); at e = 2,
kv_dim = h, f = 4h, GELU, dropout, no flash attention: exactly 34 s b h + 5 a s^2 b (a test checks it). Tensor parallel
with sequence parallel divides all of it by t (their Table 2); without, 10 s b h of it stays whole on every rank;
context parallel holds s / cp tokens.

DeepSeek-V3's mode, norms_up_fp8 (its technical report, arXiv 2412.19437v2, section 3.2.3: "We recompute all RMSNorm
operations and MLA up-projections during back-propagation, thereby eliminating the need to persistently store their
output activations"; section 3.3.3, "Low-Precision Activation": the Linear operators' inputs cached in FP8, "the
inputs of the Linear after the attention operator" in "a customized E5M6 data format", and "we cache the inputs of the
SwiGLU operator and recompute its output in the backward pass", in FP8). Per layer and element of s b it keeps:
    the two RMSNorms' inputs (the layer's input, and it plus attention's output) 2 h, in 16 bits: their outputs, the
               inputs of wq_a, wkv_a and of the MLP, are recomputed from them;
    latent attention's latents, the inputs of its RMSNorms: q_lora_rank, and kv_lora_rank + qk_rope_head_dim (the
               rotary key k_pe beside it), in 16 bits; the up-projections' outputs (every head's Q, K and V) are
               recomputed; without latent attention, Q, K and V in 16 bits (they come from no up-projection);
    attention's output, wo's input, in E5M6: 1.5 bytes (12 bits);
    a MoE layer: the routed experts' inputs as dispatched, top_k (x capacity factor) copies of h in FP8 (section
               3.3.3, "Low-Precision Communication": "we quantize the activation before MoE up-projections into FP8
               and then apply dispatch components"), and every expert's (routed and shared) SwiGLU inputs, 2 ffn_dim
               each, in FP8; the shared experts' input is the recomputed norm's output;
    a dense layer (the report says nothing of its MLP): the activation's inputs in 16 bits and w2's input in FP8.
At DeepSeek-V3's shape (h 7168, latents 1536 and 576, 128 heads of value 128, top 8 of 2048-wide experts and one
shared) a MoE layer keeps 28,672 + 4,224 + 24,576 + 57,344 + 36,864 = 151,680 bytes per token, 0.45 of the
340,096 it keeps without recomputation; during a layer's backward its recomputed Q, K, V are held besides.
"""
import operator

from utils.planner.describe import rank_layer_counts, rank_layer_kinds, ranks_alike

# PyTorch's caching allocator holds more than the tensors need (blocks rounded up and split): an assumed 5% of the
# tensors' bytes. With the CUDA context, cuBLAS's workspaces and NCCL's buffers (an assumed 2 GB), this is what the
# planner keeps free. Both are assumptions, not measurements: this course has no GPU. They are of the size the
# memory snapshots of PyTorch's allocator show (torch.cuda.memory_reserved over max_memory_allocated).
FRAGMENTATION = 0.05
RUNTIME_BYTES = 2e9
# ZeRO-2's reduce bucket: Megatron-LM's default --ddp-bucket-size, max(40M, 1M x dp) elements
# (megatron/core/distributed/distributed_data_parallel.py); unsharded gradients wait there for their reduce-scatter.
BUCKET_ELEMENTS = 40e6
# DeepSeek-V3's cached activations (module docstring): FP8 (E4M3) 1 byte, its E5M6 12 bits
FP8_BYTES, E5M6_BYTES = 1, 1.5
# PyTorch's loss_parallel (torch/distributed/tensor/parallel/loss.py, _nll_loss_and_log_softmax_backward) computes
# F.cross_entropy's backward on each rank's vocabulary shard in one function: a zeros_like of the log-probabilities
# for the target's -1, exp of the log-probabilities, their sum, then its product with the incoming gradient; three
# fp32 tensors of the logits' size made beside the saved log-probabilities at once (a test measures it), where
# F.cross_entropy's two aten kernels make two: 16 bytes per logit, against 12.
LOSS_PARALLEL_BYTES = 16


def zero_sharded_bytes(num_params, model, data_ranks, zero_stage):
    """{parameters, gradients, optimizer states} in bytes for num_params parameters on a data axis of data_ranks
    (notebook 05's table): ZeRO-1 shards the optimizer states, ZeRO-2 the gradients too, ZeRO-3 (FSDP) all three."""
    def share(stage):
        return num_params / data_ranks if zero_stage >= stage else num_params
    return {"parameters": share(3) * model.param_bytes, "gradients": share(2) * model.grad_bytes,
            "optimizer states": share(1) * model.optimizer_bytes}


def rank_layers(model, config, stage):
    """The layers pipeline rank `stage` holds: its pieces stage, stage + pp, ... of pp x v (stage_layer_counts)."""
    return rank_layer_counts(model.num_layers, config.pp, config.v)[stage]


def stage_params(model, config, stage=0):
    """(dense, experts): the parameters of pipeline rank `stage` on one device. Dense weights are split over tp
    (notebook 03: column and row shards; the norms are small and counted as split too), experts over ep. The first
    rank holds tok_embeddings, the last the final norm and output; a tied output layer on a rank other than the
    first is a copy of tok_embeddings (Megatron-LM keeps one there and sums the two gradients)."""
    first, last = stage == 0, stage == config.pp - 1
    head = model.head_params + model.vocab_size * model.dim * (model.tied and not first)
    layers, experts = 0, 0
    for kind, count in rank_layer_kinds(model, config.pp, config.v, stage):  # DeepSeek-V3's dense first layers apart
        layers += count * kind.layer_dense_params
        experts += count * kind.layer_expert_params
    dense = (layers + model.embedding_params * first + head * last) / config.tp
    return dense, experts / config.ep


_STATES = {}  # id(model): (model, {(_SPLIT, stage): (states, buffers)}); the search asks again for every
# micro-batch, knob and schedule
_SPLIT = operator.attrgetter("dp", "tp", "pp", "cp", "ep", "zero_stage", "v",  # what model states depend on,
                             "prefetch", "gather_copies")  # and the buffers: all _split_bytes reads of a config


def held_value(tables, owners_key, owners, key, compute):
    """compute(), cached under `key` in the table of its owners (a model; a model and a cluster) whose ids make
    owners_key. The table holds the owners, so that their ids stay theirs, a few tables at a time; its entries hold
    none of them: entries that did were objects Python's garbage collector kept scanning (a 405B search's 30,000
    made it scan the whole heap once or twice more, 0.1 to 0.2 s of its 2 s). A table is emptied past 8192 entries."""
    held = tables.get(owners_key)
    if held is None:
        if len(tables) >= 4:  # a search asks for one model (and a model per layer kind) on one cluster
            tables.clear()
        held = tables[owners_key] = (*owners, {})
    table = held[-1]
    value = table.get(key)
    if value is None:
        if len(table) >= 8192:
            table.clear()
        value = table[key] = compute()
    return value


def model_state_bytes(model, config, stage=0):
    """Parameters, gradients and optimizer states on one device of pipeline rank `stage`, sharded by ZeRO stage.
    A new dict each call (callers add to it)."""
    return dict(_split_bytes(model, config, stage)[0])


def _split_bytes(model, config, stage):
    """(model states, buffer_bytes) of pipeline rank `stage`: what depends on the split alone, not on the
    micro-batch, recomputation or schedule. Computed once per model (held_value), split and stage; _SPLIT lists
    every config field they read (a test changes every other one)."""
    return held_value(_STATES, id(model), (model,), (_SPLIT(config), stage),
                      lambda: (_model_state_bytes(model, config, stage), buffer_bytes(model, config, stage)))


def _model_state_bytes(model, config, stage):
    dense, experts = stage_params(model, config, stage)
    data = config.dp * config.cp  # cp ranks hold the same weights: their gradients are summed with dp's
    state = zero_sharded_bytes(dense, model, data, config.zero_stage)
    for group, value in zero_sharded_bytes(experts, model, data // config.ep, config.zero_stage).items():
        state[group] += value
    return state


def buffer_bytes(model, config, stage=0):
    """What a data-parallel scheme holds unsharded for a moment. FSDP (ZeRO-3): the unit being used and the one
    prefetched, gathered (2 layers' weights; 1 without Config.prefetch), and one layer's unsharded gradients before
    their reduce-scatter; the largest unit is a layer or, on the first and last rank, the embedding or the output
    layer. ZeRO-2: one reduce bucket of unsharded gradients. ZeRO-0/1 keep whole gradients, counted as gradients
    already."""
    layer = model.layer_dense_params / config.tp + model.layer_expert_params / config.ep
    if model.dense_layer:  # DeepSeek-V3's dense first layers
        layer = max(layer, model.dense_layer.layer_dense_params / config.tp)
    if config.zero_stage == 3:
        ends = [model.embedding_params * (stage == 0), model.vocab_size * model.dim * (stage == config.pp - 1)]
        if config.gather_copies:
            return deepspeed03_buffer_bytes(model, config, ends)
        unit = max([layer] + [e / config.tp for e in ends])
        return unit * ((1 + config.prefetch) * model.param_bytes + model.grad_bytes)  # no prefetch: one unit
    if config.zero_stage == 2 and config.dp * config.cp > 1:
        return min(max(BUCKET_ELEMENTS, 1e6 * config.dp * config.cp), stage_params(model, config, stage)[0]) * \
            model.grad_bytes
    return 0.0


def deepspeed03_buffer_bytes(model, config, ends):
    """What DeepSpeed 0.3's ZeRO-3 (Config.gather_copies) holds unsharded at its peak, in a layer's backward: it
    gathers module by module, one weight tensor at a time (fetch_sub_module, released after the module), and
    reduces each gradient through its own list reduce_scatter (deepspeed/runtime/zero/stage3.py and
    partition_parameters.py at v0.3.15). A tensor larger than the 5e8-element reduce bucket
    (reduce_bucket_size's default; contiguous_gradients off, stage 3's default, so no bucket buffers besides) is
    reduced alone once the next gradient arrives, and its whole gradient is
    freed only at the reduce after that (partition_previous_reduced_grads); PyTorch's
    ProcessGroupNCCL::reduce_scatter copies a list's inputs into one flat buffer first (flatten_for_scatter_gather).
    So, for the largest tensor W: W's weight gathered and its gradient, the previous tensor's whole gradient and
    its flattened copy in the reduce-scatter: W x (param_bytes + 3 grad_bytes). At GPT-3 shapes this is 4 MLP
    matrices (13.4 GB at 530B) where a whole layer's weights and gradients are 20 GB."""
    tensor = max([model.largest_weight_tensor] + ends) / config.tp
    return tensor * (model.param_bytes + 3 * model.grad_bytes)


def layer_activation_bytes(model, config, recompute=None):
    """Bytes one layer keeps for backward, per micro-batch (the module docstring's count; s = seq_len / cp, b the
    micro-batch, t = tp; `recompute` overrides config's): none, every tensor; selective, none of attention's s x s
    ones (what flash attention keeps anyway); selective_op (torchtitan's policy), the layer's input, the outputs of
    every other matrix product (wq, wv, the MLP's first and last: the 1st, 3rd, 5th and 7th products of a SwiGLU
    layer) and attention's output; full, the layer's input only, s b h e / t. Latent attention (DeepSeek-V3) keeps
    its heads' Q, K, V and output and its two latents (Model.attention_widths); a MoE layer's MLP tensors are its
    top_k routed experts' and its shared experts'.
    With sequence parallel all of it is split over t; without (Megatron-LM of 2021), the norms' inputs, the inputs of
    QKV and of the MLP and the dropout masks are whole on every rank: Korthikanti et al.'s 10 s b h of their
    s b h (10 + 24 / t + 5 a s / h t) (Table 2).
    Computed once per model (held_value) and the config's fields it reads (_ACTIVATION_FIELDS): the search asks
    again for every pipeline rank, data degree and ZeRO stage."""
    return held_value(_ACTIVATIONS, id(model), (model,), (_ACTIVATION_FIELDS(config), recompute),
                      lambda: _layer_activation_bytes(model, config, recompute))


_ACTIVATIONS = {}  # id(model): (model, {(_ACTIVATION_FIELDS, recompute): bytes})
_ACTIVATION_FIELDS = operator.attrgetter("tp", "cp", "micro_batch_size", "recompute", "sequence_parallel",
                                         "distribute_saved_activations")  # all that layer_activation_bytes reads


def _layer_activation_bytes(model, config, recompute=None):
    s, b, h, t, e = model.seq_len / config.cp, config.micro_batch_size, model.dim, config.tp, model.activation_bytes
    whole = 1 if config.sequence_parallel else t  # the part sequence parallel splits is divided by t / whole
    recompute = recompute or config.recompute
    if recompute == "full":
        return s * b * h * e * (1 if config.distribute_saved_activations else whole) / t
    # a token's expert MLPs: top_k routed (up to the capacity factor) and the shared ones
    f = model.ffn_dim * (model.top_k * model.capacity_factor + model.n_shared_experts if model.moe else 1)
    q, k, v, out, latents = model.attention_widths  # h, kv_dim, kv_dim, h without latent attention
    if recompute == "norms_up_fp8":
        return s * b * norms_up_fp8_bytes(model, whole) / t
    if recompute == "selective_op":  # input h (split like the norms'), wq's q, wv's v, w1's f, w2's h, attention's
        return s * b * (h * whole + q + v + out + h + f) * e / t
    kept_by_mlp = 3 if model.ffn_matrices == 3 else 2  # SwiGLU: w1 x, w3 x, silu(w1 x) w3 x; GELU: input, output
    unsplit = 4 * h * e + 2 * h * model.dropout  # norms' inputs, QKV's and the MLP's input; 1-byte dropout masks
    split = (q + k + v + out + latents + kept_by_mlp * f) * e  # Q, K, V, wo's input, the MLP's ffn_dim-wide ones
    if recompute == "none" and not model.flash_attention:
        split += model.num_heads * s * (e + (1 + e) * model.dropout)  # softmax output (and dropout's mask, output)
    return s * b * (unsplit * whole + split) / t


def norms_up_fp8_bytes(model, whole=1):
    """Bytes per token and layer that DeepSeek-V3's recomputation keeps (the module docstring), times t (the caller
    divides by it): the norms' inputs whole on every tensor-parallel rank without sequence parallel (whole = t)."""
    h, e, f = model.dim, model.activation_bytes, model.ffn_dim
    q, k, v, out, _ = model.attention_widths
    latents = model.q_lora_rank + model.kv_lora_rank + model.qk_rope_head_dim  # the latent norms' inputs, k_pe
    if not model.mla:
        latents += q + k + v  # no up-projection to recompute them from
    elif not model.q_lora_rank:
        latents += q  # the queries straight from dim (wq): kept
    kept = 2 * h * e * whole + latents * e + out * E5M6_BYTES
    if model.moe:
        routed = model.top_k * model.capacity_factor
        return kept + routed * h * FP8_BYTES + (routed + model.n_shared_experts) * (model.ffn_matrices - 1) * f * \
            FP8_BYTES
    return kept + (model.ffn_matrices - 1) * f * e + f * FP8_BYTES


def recomputed_up_projection_bytes(model, config):
    """What norms_up_fp8 holds on top of the saved tensors during a layer's backward: the layer's recomputed
    Q, K and V (the up-projections' outputs), s b (q + k + v) e / t."""
    q, k, v, _, _ = model.attention_widths
    return model.seq_len / config.cp * config.micro_batch_size * (q + k + v) * model.activation_bytes / config.tp


def logits_bytes(model, config):
    """The last stage's fp32 logits of one micro-batch at the loss's peak, config.logit_bytes s b V / t, s = seq_len /
    cp. Korthikanti et al. 2022 (section 4.2) count 4 s b V / t: Megatron's fused vocab-parallel cross entropy keeps
    the fp32 softmax in place of the logits and writes their gradient over it. PyTorch's F.cross_entropy (log_softmax
    then nll_loss; torchtitan's, on the model's fp32 output) holds three such tensors in its backward: the
    log-probabilities log_softmax saved, nll_loss's dense gradient of them, and log_softmax's gradient of its input
    (tools/autograd/derivatives.yaml): logit_bytes = 12. Under tensor parallel with Config.loss_parallel, 16
    (LOSS_PARALLEL_BYTES)."""
    per_logit = LOSS_PARALLEL_BYTES if config.loss_parallel and config.tp > 1 else config.logit_bytes
    return per_logit * model.seq_len / config.cp * config.micro_batch_size * model.vocab_size / config.tp


def micro_batches_in_flight(config, num_micro_batches, stage=0):
    """Micro-batches whose activations pipeline rank `stage` holds at its peak: 1F1B and ZB-H1 (W deferred, inputs'
    gradients not) p - stage on rank `stage` (fewer if there are fewer); without a pipeline, gradient accumulation
    keeps one (notebook 04). Interleaved: in pieces, not micro-batches; see pieces_in_flight."""
    return min(config.pp - stage, num_micro_batches)


def pieces_in_flight(config, num_micro_batches, stage=0):
    """Interleaved 1F1B (utils.pipeline.interleaved_order): rank `stage` runs 2 (p - stage - 1) + (v - 1) p forwards
    before its first backward, so it holds one more piece's activations at its peak: on the first rank p v + p - 1
    pieces of L / (p v) layers, Korthikanti et al.'s L (1 + (p - 1) / (p v)). With v = 1, 1F1B's p - stage."""
    p, v = config.pp, config.v
    if v == 1:
        return micro_batches_in_flight(config, num_micro_batches, stage)
    return min(2 * (p - stage - 1) + (v - 1) * p + 1, num_micro_batches * v)


def activation_bytes(model, config, num_micro_batches, stage=0):
    """Pipeline rank `stage`'s activations at their peak: its layers' for every micro-batch (piece) in flight; with
    full recomputation, plus one layer recomputed in full during its backward; on the first rank, the embedding's
    dropout masks (embedding_dropout_bytes); the stage outputs a schedule keeps (stage_output_bytes). Without
    recomputation, times 1 + Config.uncounted_activations: what a published run shows its framework held beyond this
    count, with no tensor yet named for it. Megatron-LM of 2021 (utils.planner_runs.UNCOUNTED_2021): Narayanan et
    al.'s Figure 17 ran t 8 x p 16 at micro-batch 1 without recomputation with 8 micro-batches in flight and not
    with 16 (utils.planner_runs.FIGURE_17), so it held at least 1.27 times this count at 16 and at most 2.56 at 8:
    0.3, the bound rounded up (a test checks that 0.25 would let 16 fit). Read against that code
    (megatron/model/transformer.py and fused_softmax.py at 6985e58938: Q, K and V views of one product, the fused
    softmax keeping its fp16 output), Korthikanti et al.'s count names every tensor the layers save; the excess is
    the allocator's or the schedule's. PyTorch's caching allocator had no expandable segments before 2.1 (2023);
    GMLake (Guo et al., ASPLOS 2024) took 9.2 GB (up to 25 GB) and 15 points (up to 33) of fragmentation off it in
    LLM training on A100-80GBs. One fragmentation share that large for every run would put DeepSpeed's ZeRO-3 530B
    on 640 GPUs, which ran, out of memory: the excess is counted where it was measured."""
    kinds = rank_layer_kinds(model, config.pp, config.v, stage)  # DeepSeek-V3's dense first layers apart
    piece = 0.0
    for kind, layers in kinds:
        piece += layers * layer_activation_bytes(kind, config)
    kept = pieces_in_flight(config, num_micro_batches, stage) * piece / config.v
    if config.recompute == "full":
        kept += recomputed_layer_bytes(model, config, stage)
    if config.recompute == "norms_up_fp8":
        kept += recomputed_up_projection_bytes(model, config)
    counted = (kept + embedding_dropout_bytes(model, config, num_micro_batches, stage)
               + stage_output_bytes(model, config, num_micro_batches, stage))
    return counted * (1 + config.uncounted_activations * (config.recompute == "none"))


def stage_output_bytes(model, config, num_micro_batches, stage=0):
    """The output tensors of the pieces in flight on pipeline rank `stage`, where the schedule keeps them until their
    backward (Config.keep_stage_outputs): s b h e each, whole on every tensor-parallel rank without sequence parallel.
    No op of the stage saves its last layer's output (the next stage's norm does, on the next rank): Megatron-LM's
    schedules kept it in output_tensors until the piece's backward, until deallocate_output_tensor (schedules.py,
    2022-01, commits 86da10e9d9 and 18846a0a57: 'output should be pseudo-freed in schedule, to optimize memory')
    freed its storage once sent. Every piece in flight sends its output but the model's last, on the last rank."""
    if not config.keep_stage_outputs or config.pp == 1:
        return 0.0
    pieces = pieces_in_flight(config, num_micro_batches, stage)
    if stage == config.pp - 1:  # its last piece feeds the loss; interleaved, its other pieces in flight send
        pieces = pieces - 1 if config.v > 1 else 0
    whole = 1 if config.sequence_parallel else config.tp
    return pieces * model.seq_len / config.cp * config.micro_batch_size * model.dim * model.activation_bytes * whole \
        / config.tp


def embedding_dropout_bytes(model, config, num_micro_batches, stage=0):
    """The first rank's dropout masks of the embedding's output, one byte per element of s b h for every micro-batch
    whose first piece is in flight: Korthikanti et al. 2022 (section 4.3) count this s b h p / t beside the layers'
    (whole on every tensor-parallel rank without sequence parallel). It sits outside the layers, so recomputing them
    keeps it. Interleaved, the first piece holds at most 2 p micro-batches (min(2 p, m): utils.pipeline's
    interleaved_order runs forwards p at a time per piece, backwards from the last piece; a test counts it)."""
    if stage != 0 or not model.dropout:
        return 0.0
    first = pieces_in_flight(config, num_micro_batches) if config.v == 1 else min(2 * config.pp, num_micro_batches)
    whole = 1 if config.sequence_parallel else config.tp
    return model.seq_len / config.cp * config.micro_batch_size * model.dim * whole / config.tp * first


def recomputed_layer_bytes(model, config, stage):
    """What full recomputation holds on top of the saved inputs, on pipeline rank `stage`: the rank's largest layer
    recomputed in full during its backward."""
    return max(layer_activation_bytes(kind, config, recompute="none")
               for kind, _ in rank_layer_kinds(model, config.pp, config.v, stage))


def logits_beyond_recompute(model, config, stage):
    """What the fp32 logits add to pipeline rank `stage`'s peak: on the last rank, one micro-batch's. With full
    recomputation and one piece per rank (1F1B, ZB-H1, no pipeline), the last rank runs each micro-batch's
    backward right after its forward, and the loss's backward frees its logits before any of its layers is
    recomputed: the logits and the layer recomputed in full (activation_bytes) are never held together, so the
    peak holds the larger of the two and the logits count only beyond it. Interleaved, the last rank's other
    pieces run between a micro-batch's loss and its backward: both are held."""
    if stage != config.pp - 1:
        return 0.0
    logits = logits_bytes(model, config)
    if config.recompute != "full" or config.v != 1:
        return logits
    return max(0.0, logits - recomputed_layer_bytes(model, config, stage))


def memory_per_device(model, config, num_micro_batches, stage=0):
    """{parameters, gradients, optimizer states, activations, logits, buffers, fragmentation, runtime, total} in
    bytes, on one device of pipeline rank `stage` (the first by default); logits: what they add to the peak
    (logits_beyond_recompute)."""
    terms = _counted_bytes(model, config, num_micro_batches, stage)
    memory = dict(zip(COUNTED, terms))
    memory["fragmentation"], memory["runtime"], memory["total"] = _margins(terms)
    return memory


COUNTED = ("parameters", "gradients", "optimizer states", "activations", "logits", "buffers")


def _counted_bytes(model, config, num_micro_batches, stage):
    """The COUNTED terms of memory_per_device, in its order: a tuple, which the search sums without a dict."""
    states, buffers = _split_bytes(model, config, stage)
    return (*states.values(), activation_bytes(model, config, num_micro_batches, stage),
            logits_beyond_recompute(model, config, stage), buffers)


def _margins(terms):
    """(fragmentation, runtime, total): the allocator's share of the counted terms, the runtime's, and the sum of all,
    added in memory_per_device's order."""
    fragmentation = FRAGMENTATION * sum(terms)
    return fragmentation, RUNTIME_BYTES, sum((*terms, fragmentation, RUNTIME_BYTES))


def _peak_candidates(model, config):
    return ranks_alike(model.num_layers, model.first_k_dense_replace, config.pp, config.v)


def peak_memory(model, config, num_micro_batches):
    """(stage, memory) of the pipeline rank that needs the most."""
    return max(((stage, memory_per_device(model, config, num_micro_batches, stage))
                for stage in _peak_candidates(model, config)), key=lambda item: item[1]["total"])


def peak_total(model, config, num_micro_batches):
    """(stage, total bytes) of peak_memory, without its dicts: all the search reads of it."""
    return max(((stage, _margins(_counted_bytes(model, config, num_micro_batches, stage))[2])
                for stage in _peak_candidates(model, config)), key=operator.itemgetter(1))
