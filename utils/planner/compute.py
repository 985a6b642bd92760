"""Compute: the time of each layer's matrix products from their shapes on one device, through a roofline.

    a product (m, k) x (k, n), `batch` of them:
        time = max(2 m k n batch / (peak x e_max),  (m k + k n + m n) batch bytes / HBM bandwidth) + t_kernel

e_max is the share of peak a large GEMM reaches on the device and t_kernel a fixed cost per kernel (launch, the
first wave of tiles ramping up, the last one running part-empty): together a curve on which efficiency falls as
a matrix shrinks, e_max F / (F + F_half) with F_half = t_kernel x peak x e_max (for an H100, 0.75 x 989 TFLOP/s x
5 us = 3.7 GFLOP: a 1024 x 1024 x 1024 product reaches 0.28 of peak, 8192 cubed 0.75). Both constants are stated
with the device (describe.py): e_max from cuBLAS's published large-size throughput, t_kernel an assumption (of the
size of a kernel launch and one wave of tiles on a small product), not a fit.

Element-wise work (norms, activations, residuals, dropout, softmax) is memory-bound: forward, it moves
ELEMENTWISE_TRAFFIC times the bytes a layer keeps for backward (ELEMENTWISE_TRAFFIC_EAGER unfused); backward,
twice that.

`matmul_seconds` is the primitive a replay of recorded steps uses (issue 42): one computation on a device.
"""
import dataclasses
import functools

from utils.planner.describe import Config
from utils.planner.memory import layer_activation_bytes


# Bytes moved forward by element-wise work per byte a layer keeps for backward: each kept tensor is written once and
# read at least once, and norms, residual adds and casts move more than they keep; 3, fitted with the A100's
# efficiency to Narayanan et al. 2021 Table 1's two smallest rows (describe.py).
ELEMENTWISE_TRAFFIC = 3
# The same in PyTorch eager (Config.fused False), counted kernel by kernel in torchtitan's Llama layer
# (torchtitan/models/llama/model.py at 9dec370), bytes per token forward: each RMSNorm 36 per feature (the cast to
# fp32, square, mean, scale, cast back, weight: 2+4, 4+4, 4, 4+4, 4+2, 2+2), rotary 20 per feature of q and k,
# repeat_kv's copies of k and v 4 (kv + h), attention's output made contiguous 4 h, two residual adds 6 h each,
# SwiGLU's silu and product 10 per ffn feature: 112 h + 24 kv + 10 f, 4.5 times the 139,264 bytes the layer keeps at
# Llama 3 8B's shape (h 4096, kv 1024, f 14336).
ELEMENTWISE_TRAFFIC_EAGER = 4.5


# float8 as torchao runs it (torchao.float8's Float8Linear, dynamic tensorwise scaling; its roofline,
# torchao/testing/float8/roofline_utils.py at 042170f, counts these kernels). Each 16-bit tensor a product reads is
# read once for its absolute maximum, then read again and written in 1 byte, once per layout the three products of a
# linear need (torch._scaled_mm takes its first operand row-major, its second column-major: the weight gradient
# reads the input and the output gradient transposed). Bytes moved per element, forward and backward:
#   an input (one per distinct input: wq, wk, wv share theirs, as w1 and w3 do): 2 + 2 + 1 + 1, all forward;
#   a weight: 2 + 2 + 1 forward (amax, e4m3), 2 + 1 backward (its column-major copy);
#   an output gradient (e5m2, Micikevicius et al. 2022, section 4.3): 2 + 2 + 1 + 1, all backward.
# Attention's QK^T and AV, the norms and the output layer stay in bf16 (torchtitan converts the layers' Linears only).
FLOAT8_INPUT_BYTES = 6
FLOAT8_WEIGHT_BYTES_FORWARD, FLOAT8_WEIGHT_BYTES_BACKWARD = 5, 3
FLOAT8_GRAD_OUTPUT_BYTES = 6


def matmul_seconds(m, k, n, cluster, batch=1, element_bytes=2, float8=False):
    """Seconds of `batch` products (m, k) x (k, n) on one device of `cluster` (the roofline above; with a fixed
    cluster.mfu, their FLOPs at that share of peak). float8: at the device's float8 peak and float8 efficiency
    (describe.py, fp8_efficiency_ratio), 1-byte operands; their casts are the layer's (float8_cast_seconds)."""
    flops = 2 * batch * m * k * n
    if cluster.mfu is not None:
        return flops / (cluster.peak_flops * cluster.mfu)
    peak, efficiency = cluster.peak_flops, cluster.matmul_efficiency
    if float8:
        peak, efficiency, element_bytes = cluster.fp8_flops, efficiency * cluster.fp8_efficiency_ratio, 1
    compute = flops / (peak * efficiency)
    memory = batch * (m * k + k * n + m * n) * element_bytes / cluster.hbm_bandwidth
    return max(compute, memory) + cluster.kernel_seconds


def float8_cast_seconds(groups, cluster):
    """(forward, backward) seconds of the float8 casts of a layer's products (FLOAT8_* above). groups: (m, k, ns,
    batch, shards, grad_shards), one per distinct input (m, k), read by the products (k, n) for n in ns, `batch` of
    each. shards > 1: the input arrives by an all-gather under sequence parallel, and torchao's Float8 tensor
    parallel casts it on the shard, before the gather (Float8ColwiseParallel); grad_shards > 1: likewise each output
    gradient, cast on the shard before its backward all-gather (Float8RowwiseParallel). A tensor cast on a shard
    then needs its gathered copy made column-major for the weight gradient (1-byte read and write, backward)."""
    forward = backward = 0.0
    for m, k, ns, batch, shards, grad_shards in groups:
        weights = batch * k * sum(ns)
        forward += weights * FLOAT8_WEIGHT_BYTES_FORWARD
        backward += weights * FLOAT8_WEIGHT_BYTES_BACKWARD
        if shards > 1:
            forward += batch * m * k * (FLOAT8_INPUT_BYTES - 1) / shards
            backward += batch * m * k * 2
        else:
            forward += batch * m * k * FLOAT8_INPUT_BYTES
        grads = batch * m * sum(ns)
        backward += grads * ((FLOAT8_GRAD_OUTPUT_BYTES - 1) / grad_shards + 2 if grad_shards > 1
                             else FLOAT8_GRAD_OUTPUT_BYTES)
    return memory_bound_seconds(forward, cluster), memory_bound_seconds(backward, cluster)


def memory_bound_seconds(nbytes, cluster):
    """Seconds to move nbytes through the device's memory once (element-wise work); none with a fixed mfu."""
    return 0.0 if cluster.mfu is not None else nbytes / cluster.hbm_bandwidth


@dataclasses.dataclass(frozen=True)
class LayerTimes:
    """One layer, one micro-batch, one device: forward seconds by part; backward is the input gradients (B: the
    products again, attention twice, element-wise twice) and the weight gradients (W: the products again)."""

    matmul: float  # the weights' products
    attention: float  # QK^T and AV
    elementwise: float
    flops: float
    norms_up: float = 0.0  # what DeepSeek-V3's recomputation (norms_up_fp8) adds to the backward: up_recompute_seconds
    casts_forward: float = 0.0  # float8's casts (float8_cast_seconds): of the inputs and weights
    casts_backward: float = 0.0  # of the output gradients and the weights' column-major copies

    # cached: the search reads them for every config of a split (the fields are frozen, so they cannot go stale)
    @functools.cached_property
    def forward(self):
        return self.matmul + self.attention + self.elementwise + self.casts_forward

    @functools.cached_property
    def input_grad(self):
        return self.matmul + 2 * self.attention + 2 * self.elementwise + self.casts_backward

    @functools.cached_property
    def weight_grad(self):
        return self.matmul


def layer_times(model, cluster, config):
    """The forward of one layer on one device: each product with its per-device shape. Tokens T = b s / cp; with
    sequence parallel each tensor-parallel rank multiplies all T by its 1/tp of the weights: wq (h, h/t), wk and wv
    (h, kv/t: whole heads, a copy when tp exceeds the key/value heads), wo (h/t, h), the MLP's (h, f/t) and
    (f/t, h). A MoE layer: the router on the rank's T/t tokens, then each of its E/ep experts on an even share of
    the ep group's tokens' top_k copies, times the capacity factor. Attention: b a/t heads, queries s/cp against
    keys s (the ring's cp blocks, or the gathered keys), head_dim d."""
    return _layer_times(model, cluster, config.tp, config.cp, config.ep, config.micro_batch_size,
                        config.sequence_parallel, config.float8, config.fused)


@functools.lru_cache(maxsize=4096)
def _layer_times(model, cluster, tp, cp, ep, b, sequence_parallel=True, float8=False, fused=True):
    h, t, e, f8 = model.dim, tp, model.activation_bytes, float8
    tokens = b * model.seq_len // cp
    # one group per distinct input (m, k, [n, ...], batch, shards, grad_shards): the products reading the layer's
    # normed input share it; under sequence parallel it arrives gathered, and the row products' output gradients too
    sp = t if sequence_parallel and t > 1 else 1
    groups = []
    for columns, row in column_row_pairs(model, t):
        groups += [(tokens, h, [n for k, n in columns if k == h], 1, sp, 1)]
        groups += [(tokens, k, [n], 1, 1, 1) for k, n in columns if k != h] + [(tokens, row[0], [row[1]], 1, 1, sp)]
    if model.moe:
        local = tokens // t * model.top_k * ep / model.num_experts * model.capacity_factor
        experts = [(local, h, [model.ffn_dim] * (model.ffn_matrices - 1), model.num_experts // ep, 1, 1),
                   (local, model.ffn_dim, [h], model.num_experts // ep, 1, 1)]
        groups += [(tokens // t, h, [model.num_experts], 1, 1, 1)] + experts
    matmul = sum(matmul_seconds(m, k, n, cluster, batch=batch, element_bytes=e, float8=f8)
                 for m, k, ns, batch, *_ in groups for n in ns)
    casts = float8_cast_seconds(groups, cluster) if f8 else (0.0, 0.0)
    heads, blocks = b * model.num_heads // t, cp
    block = model.seq_len // cp
    # Known limit: flash attention never writes the s x s scores, yet the roofline's memory term counts them: at
    # head dim 128 the whole square runs at 128 FLOP/byte x HBM, 43% of an H100's peak, as if the causal half ran at
    # 22%. Timing it instead as the kernel runs (the causal half of the square, at FlashAttention-2's 35% of an
    # H100's peak for head dim 128, as Shah et al. 2024's FlashAttention-3 paper measures it) was tried and not kept:
    # it puts torchtitan's 8K-token rows 1.20-1.35x and its 128K-256K CP rows 1.5-1.9x too fast. Those rows' own numbers
    # (Table 2: 32K tokens per GPU against 32K, 64K, 128K, 256K keys) cost 137, 270, 223 us per token for each
    # further 32K keys: no one kernel efficiency fits them (utils/planner_runs.py, the CP rows' disagreement).
    # Causal masking is priced alike with and without context parallel: at cp 1 flash attention's causal kernel
    # skips the upper triangle of s x s; PyTorch's ring (torch/distributed/tensor/experimental/_attention.py,
    # _is_causal_behavior, load balancing on by default: each rank holds chunks r and 2 cp - 1 - r) runs the causal
    # local block, then half of each other block, the causal half of s/cp x s on every rank. Both are timed here as
    # the full square, cp blocks of (s/cp)^2, so the two sides' attention differs by the kernels' sizes alone.
    attention = (matmul_seconds(block, model.qk_head_dim, block, cluster, batch=heads * blocks, element_bytes=e)
                 + matmul_seconds(block, block, model.value_head_dim, cluster, batch=heads * blocks, element_bytes=e))
    kept = layer_activation_bytes(model, Config(tp=tp, cp=cp, ep=ep, micro_batch_size=b,
                                                sequence_parallel=sequence_parallel))
    flops = (2 * tokens / t * model.layer_matmul_params
             + b * model.seq_len / cp * model.attention_flops_per_token / t)
    traffic = ELEMENTWISE_TRAFFIC if fused else ELEMENTWISE_TRAFFIC_EAGER
    return LayerTimes(matmul, attention, memory_bound_seconds(traffic * kept, cluster), flops,
                      up_recompute_seconds(model, cluster, tp, tokens, float8), *casts)


def up_recompute_seconds(model, cluster, tp, tokens, float8=False):
    """What DeepSeek-V3's recomputation (memory.py, norms_up_fp8) runs again in a layer's backward, for `tokens`
    tokens on one tensor-parallel rank: latent attention's up-projections (wq_b, wkv_b; products as the forward runs
    them), every RMSNorm (the layer's two over h, the latents' over q_lora_rank and kv_lora_rank: each input read and
    output written in 16 bits), and a MoE layer's SwiGLU outputs from its cached FP8 inputs (2 ffn_dim read at 1 byte,
    ffn_dim written, per expert a token goes through)."""
    h, e, t = model.dim, model.activation_bytes, tp
    ups = [(k, n // t) for k, n in model.attention_matrices[:-1] if k != h] if model.mla else []
    products = sum(matmul_seconds(tokens, k, n, cluster, element_bytes=e, float8=float8) for k, n in ups)
    norms = (2 * h + model.q_lora_rank + model.kv_lora_rank) * 2 * e
    experts = model.top_k * model.capacity_factor + model.n_shared_experts if model.moe else 0
    swiglu = experts * model.ffn_dim * (2 + e) if model.ffn_matrices == 3 else 0
    return products + memory_bound_seconds(tokens * (norms + swiglu) / t, cluster)


def tp_pair_products(model, cluster, config):
    """Per column/row pair of a layer with tensor parallel (attention, then the MLP; attention alone in a MoE
    layer), one micro-batch, one device, forward: (seconds of the products that read the gathered input, how many
    they are, seconds of the product whose output is reduce-scattered), the products AsyncTP fuses each collective
    with (step.py)."""
    return _tp_pair_products(model, cluster, config.tp, config.cp, config.micro_batch_size, config.float8)


@functools.lru_cache(maxsize=4096)
def _tp_pair_products(model, cluster, tp, cp, b, float8):
    tokens = b * model.seq_len // cp

    def seconds(shapes):
        return sum(matmul_seconds(tokens, k, n, cluster, element_bytes=model.activation_bytes, float8=float8)
                   for k, n in shapes)
    pairs = column_row_pairs(model, tp)[:1 if model.moe else 2]  # a MoE layer's shared experts: not fused (step.py)
    return [(seconds(columns), len(columns), seconds([row])) for columns, row in pairs]


def column_row_pairs(model, tp):
    """A layer's products on one tensor-parallel rank as column/row pairs ([(k, n) of each column product], (k, n) of
    the row product): attention's (attention_shapes), then every token's MLP, the dense one or a MoE layer's shared
    experts (none without)."""
    *columns, row = attention_shapes(model, tp)
    h, f = model.dim, (model.n_shared_experts if model.moe else 1) * model.ffn_dim // tp
    return [(columns, row)] + ([([(h, f)] * (model.ffn_matrices - 1), (f, h))] if f else [])


def attention_shapes(model, tp):
    """(k, n) of attention's products on one tensor-parallel rank: wq (h, h/t), wk and wv (h, kv/t: whole heads,
    a copy when tp exceeds the key/value heads), wo (h/t, h); latent attention's down-projections to its latents
    (wq_a, wkv_a) whole on every rank, its up-projections (wq_b, wkv_b) and wo split by heads."""
    if not model.mla:
        h, kv = model.dim, max(model.kv_dim // tp, model.head_dim)
        return [(h, h // tp), (h, kv), (h, kv), (h // tp, h)]
    *projections, (out, h) = model.attention_matrices
    downs = [(k, n) for k, n in projections if k == h]  # from the layer's input: wq_a (or wq), wkv_a
    ups = [(k, n // tp) for k, n in projections if k != h]
    if not model.q_lora_rank:  # wq straight from dim: split by heads like the up-projections
        downs, ups = downs[1:], [(h, downs[0][1] // tp)] + ups
    return downs + ups + [(out // tp, h)]


def kv_width(model, tp):
    """Keys' and values' features per token on one tensor-parallel rank (what a ring hands on): 2 kv_dim / t (whole
    heads), or latent attention's heads' keys and values, heads (qk_head_dim + v_head_dim) / t."""
    if model.mla:
        return model.num_heads * (model.qk_head_dim + model.value_head_dim) // tp
    return 2 * max(model.kv_dim // tp, model.head_dim)


def output_layer_seconds(model, cluster, config):
    """(forward, backward) of the output layer and its fp32 cross entropy on the last stage: (T, h) x (h, V/t),
    then the logits read and written about three times (softmax, loss, gradient) in fp32."""
    tokens = config.micro_batch_size * model.seq_len // config.cp
    product = matmul_seconds(tokens, model.dim, model.vocab_size // config.tp, cluster,
                             element_bytes=model.activation_bytes)
    loss = memory_bound_seconds(3 * 4 * tokens * model.vocab_size / config.tp, cluster)
    return product + loss, 2 * product + loss
