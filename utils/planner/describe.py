"""What is planned: a model, the devices and links it runs on, and a split of it (notebook 12, section 5).

Every constant of a device carries its source. A split that does not divide is refused here, before any
estimate, with a message naming the sizes that would.
"""
import dataclasses
import functools

from utils.sizes import check_int, divide

RECOMPUTE = ("none", "selective", "full")
# torchtitan's selective "op" policy (torchtitan/parallelisms/parallelize_llama.py, _save_list at 9dec370): keeps the
# outputs of every other matrix product and of attention, recomputes the rest;
# accepted, not searched; DeepSeek-V3's norms_up_fp8 (memory.py: every RMSNorm and latent attention's up-projections
# recomputed, activations cached in FP8 and E5M6), offered to its record's framework only (utils.planner_runs)
RECOMPUTE_OTHER = ("selective_op", "norms_up_fp8")
ZERO_STAGES = (0, 1, 2, 3)
SCHEDULES = ("1F1B", "interleaved", "ZB-H1")
CP_MODES = ("ring", "all_gather")
GB = 1e9
MIB = 2**20


# ---------------------------------------------------------------- the model

@dataclasses.dataclass(frozen=True)
class Model:
    """A decoder-only transformer. Bytes per parameter default to the ZeRO paper's mixed precision (2 bf16 weight,
    2 bf16 gradient, 12 fp32 master weight + Adam's two moments: notebook 05); activations in 16 bits.

    Llama-shaped by default (no biases, RMSNorm, rotary positions, no dropout, flash attention, untied output).
    GPT-3-shaped as in Narayanan et al. 2021: biases=True, learned_positions=True, tied=True, dropout=True,
    flash_attention=False, ffn_dim = 4 dim, ffn_matrices = 2."""

    num_layers: int
    dim: int
    num_heads: int
    ffn_dim: int
    seq_len: int
    vocab_size: int
    num_kv_heads: int = 0  # 0: as many as num_heads (no grouped-query attention)
    num_experts: int = 1  # 1: dense; more: every layer's MLP is a mixture of experts
    top_k: int = 1
    ffn_matrices: int = 2  # the course's w1, GELU, w2; Llama's SwiGLU has 3
    param_bytes: int = 2
    grad_bytes: int = 2
    optimizer_bytes: int = 12
    activation_bytes: int = 2
    name: str = "model"
    tied: bool = False  # the output layer reuses tok_embeddings' weight
    biases: bool = False  # every linear layer and norm has a bias (GPT)
    learned_positions: bool = False  # a (seq_len, dim) position embedding (GPT); False: rotary
    dropout: bool = False  # dropout after attention's softmax and each residual branch (GPT-3; its masks are kept)
    flash_attention: bool = True  # attention's s x s scores are never kept (recomputed in backward, in blocks)
    capacity_factor: float = 1.0  # a MoE layer's experts process up to this times their even share of tokens
    # DeepSeek-V2/V3's multi-head latent attention (DeepSeek-AI 2024, arXiv 2405.04434 section 2.1; their config.json
    # names): queries from a q_lora_rank latent, keys and values from a kv_lora_rank latent (with a shared rotary key
    # of qk_rope_head_dim), each head's query/key qk_nope_head_dim + qk_rope_head_dim wide, its value v_head_dim.
    q_lora_rank: int = 0  # 0: the queries straight from dim (DeepSeek-V2-Lite)
    kv_lora_rank: int = 0  # 0: no latent attention (wq, wk, wv, wo of dim / num_heads per head)
    qk_nope_head_dim: int = 0
    qk_rope_head_dim: int = 0
    v_head_dim: int = 0
    # DeepSeekMoE (arXiv 2401.06066): experts every token goes through beside its top_k routed ones, and the first
    # layers dense, with an MLP of intermediate_size (0: ffn_dim, the experts' width)
    n_shared_experts: int = 0
    first_k_dense_replace: int = 0
    intermediate_size: int = 0
    topk_group: int = 0  # node-limited routing (DeepSeek-V3, section 2.1.2): a token's experts on at most this many
    #                      nodes; 0: anywhere

    def __post_init__(self):
        for field in ("num_layers", "dim", "num_heads", "ffn_dim", "seq_len", "vocab_size", "num_experts", "top_k",
                      "ffn_matrices", "param_bytes", "grad_bytes", "activation_bytes"):
            check_int(field, getattr(self, field))
        check_int("optimizer_bytes", self.optimizer_bytes, 0)  # 0: plain SGD
        check_int("num_kv_heads", self.num_kv_heads, 0)
        divide("dim", self.dim, "num_heads", self.num_heads, "every head gets dim / num_heads features")
        divide("num_heads", self.num_heads, "num_kv_heads", self.kv_heads, "query heads share key/value heads evenly")
        if self.top_k > self.num_experts:
            raise ValueError(f"top_k {self.top_k} is more than num_experts {self.num_experts}")
        if not self.capacity_factor >= 1:
            raise ValueError(f"capacity_factor must be at least 1, got {self.capacity_factor}")
        for field in ("q_lora_rank", "kv_lora_rank", "qk_nope_head_dim", "qk_rope_head_dim", "v_head_dim",
                      "n_shared_experts", "first_k_dense_replace", "intermediate_size", "topk_group"):
            check_int(field, getattr(self, field), 0)
        if self.kv_lora_rank and not (self.qk_nope_head_dim + self.qk_rope_head_dim and self.v_head_dim):
            raise ValueError("latent attention (kv_lora_rank > 0) needs qk_nope_head_dim + qk_rope_head_dim and "
                             "v_head_dim")
        if (self.n_shared_experts or self.first_k_dense_replace) and not self.moe:
            raise ValueError("n_shared_experts and first_k_dense_replace belong to a MoE model (num_experts > 1)")
        if self.first_k_dense_replace > self.num_layers:
            raise ValueError(f"first_k_dense_replace {self.first_k_dense_replace} is more than num_layers "
                             f"{self.num_layers}")

    @functools.cached_property
    def kv_heads(self):
        return self.num_kv_heads or self.num_heads

    @functools.cached_property
    def kv_dim(self):
        return self.kv_heads * self.dim // self.num_heads

    @property
    def head_dim(self):
        return self.dim // self.num_heads

    @property
    def moe(self):
        return self.num_experts > 1

    @property
    def mla(self):
        return self.kv_lora_rank > 0

    @functools.cached_property
    def qk_head_dim(self):
        """A head's query and key width: head_dim, or latent attention's qk_nope_head_dim + qk_rope_head_dim."""
        return self.qk_nope_head_dim + self.qk_rope_head_dim if self.mla else self.head_dim

    @functools.cached_property
    def value_head_dim(self):
        return self.v_head_dim if self.mla else self.head_dim

    @functools.cached_property
    def attention_widths(self):
        """(Q, K, V, output, latents): what attention keeps per token for backward, in elements: Q and K heads x
        qk_head_dim (K kv_dim under grouped-query attention), V kv_dim, the output (wo's input) heads x
        value_head_dim; latent attention's K and V per head as Q and the output, and its two latents, each as its
        norm's input and its up-projection's input."""
        q, out = self.num_heads * self.qk_head_dim, self.num_heads * self.value_head_dim
        if not self.mla:
            return q, self.kv_dim, self.kv_dim, out, 0
        return q, q, out, out, 2 * self.q_lora_rank + 2 * self.kv_lora_rank + self.qk_rope_head_dim

    @functools.cached_property
    def kv_cache_dim(self):
        """What a token keeps of keys and values per layer (elements): 2 kv_dim, or latent attention's compressed
        kv_lora_rank + qk_rope_head_dim (576 for DeepSeek-V3 against 2 x 128 x 128 for its heads' own)."""
        return self.kv_lora_rank + self.qk_rope_head_dim if self.mla else 2 * self.kv_dim

    @functools.cached_property
    def attention_matrices(self):
        """(k, n) of each of attention's weights, in order: wq, wk, wv, wo; with latent attention (DeepSeek-V3's
        names) wq_a (dim, q_lora_rank) and wq_b (q_lora_rank, heads x qk) or wq (dim, heads x qk), wkv_a (dim,
        kv_lora_rank + qk_rope_head_dim), wkv_b (kv_lora_rank, heads x (qk_nope_head_dim + v_head_dim)), wo
        (heads x v_head_dim, dim)."""
        h, heads = self.dim, self.num_heads
        if not self.mla:
            return ((h, h), (h, self.kv_dim), (h, self.kv_dim), (h, h))
        q = ((h, self.q_lora_rank), (self.q_lora_rank, heads * self.qk_head_dim)) if self.q_lora_rank else \
            ((h, heads * self.qk_head_dim),)
        kv = ((h, self.kv_lora_rank + self.qk_rope_head_dim),
              (self.kv_lora_rank, heads * (self.qk_nope_head_dim + self.v_head_dim)))
        return q + kv + ((heads * self.v_head_dim, h),)

    # parameters, counted layer by layer (utils/transformer.py's names)
    @functools.cached_property
    def attention_params(self):
        weights = sum(k * n for k, n in self.attention_matrices)  # wq, wk, wv (smaller under GQA), wo
        latent_norms = self.q_lora_rank + self.kv_lora_rank  # RMSNorm of each latent
        return weights + (2 * self.dim + 2 * self.kv_dim) * self.biases + latent_norms

    @functools.cached_property
    def expert_params(self):
        """One MLP: ffn_matrices matrices of dim x ffn_dim (and, with biases, ffn_dim biases per input matrix and
        dim for the output one)."""
        biases = ((self.ffn_matrices - 1) * self.ffn_dim + self.dim) * self.biases
        return self.ffn_matrices * self.dim * self.ffn_dim + biases

    @functools.cached_property
    def norm_params(self):
        return self.dim * (2 if self.biases else 1)  # LayerNorm's weight and bias, or RMSNorm's weight

    @functools.cached_property
    def layer_dense_params(self):
        """A layer's weights outside its routed experts: attention, two norms, the router and shared experts of a
        MoE layer (or the MLP of a dense layer, which has one 'expert' that every rank holds)."""
        router = self.dim * self.num_experts if self.moe else 0
        mlp = self.n_shared_experts * self.expert_params if self.moe else self.expert_params
        return self.attention_params + 2 * self.norm_params + router + mlp

    @functools.cached_property
    def attention_weight_tensors(self):
        """Elements of each of attention's weight matrices as its module holds them: Megatron-LM's GPT (biases)
        holds wq, wk and wv as one query_key_value (megatron/model/transformer.py, ParallelSelfAttention)."""
        sizes = [k * n for k, n in self.attention_matrices]
        return [sum(sizes[:3])] + sizes[3:] if self.biases and not self.mla else sizes

    @functools.cached_property
    def layer_weight_tensors(self):
        """A layer's weight tensors as its module holds them (what a framework gathering tensor by tensor gathers):
        two norms, attention's matrices, the MLP's (each norm and matrix with its bias, with biases): Megatron-LM's
        GPT 12 tensors, Llama's as torchtitan holds it 9. A MoE layer's router and experts besides."""
        mlps = self.n_shared_experts + self.num_experts if self.moe else 1
        matrices = len(self.attention_weight_tensors) + self.ffn_matrices * mlps
        return (2 + matrices) * (1 + self.biases) + self.moe  # + the router

    @functools.cached_property
    def largest_weight_tensor(self):
        """Elements of a layer's largest weight tensor (what a framework gathering tensor by tensor holds whole at
        once): an MLP matrix dim x ffn_dim, or one of attention's (attention_weight_tensors)."""
        return max(self.attention_weight_tensors + [self.dim * self.ffn_dim])

    @functools.cached_property
    def dense_layer(self):
        """The model of the first_k_dense_replace dense layers (DeepSeek-V3's first 3): the same attention, one MLP
        of intermediate_size; None if every layer is alike."""
        if not self.first_k_dense_replace:
            return None
        return dataclasses.replace(self, num_experts=1, top_k=1, ffn_dim=self.intermediate_size or self.ffn_dim,
                                   n_shared_experts=0, first_k_dense_replace=0, intermediate_size=0,
                                   capacity_factor=1.0, topk_group=0)

    def layer_kinds(self, dense_layers, layers):
        """[(model of a layer, how many)] for `layers` layers of which `dense_layers` are the dense first ones."""
        if not dense_layers:
            return [(self, layers)]
        return [(self.dense_layer, dense_layers)] + ([(self, layers - dense_layers)] if layers > dense_layers else [])

    @functools.cached_property
    def layer_expert_params(self):
        return self.num_experts * self.expert_params if self.moe else 0

    @functools.cached_property
    def embedding_params(self):
        """tok_embeddings (and the learned positions)."""
        return self.vocab_size * self.dim + self.seq_len * self.dim * self.learned_positions

    @functools.cached_property
    def head_params(self):
        """The final norm and the output layer (its weight is tok_embeddings' when tied)."""
        return self.norm_params + self.vocab_size * self.dim * (not self.tied)

    def _over_layers(self, per_layer):
        """per_layer(model of a layer) summed over the layers: the dense first ones and the rest."""
        return sum(count * per_layer(kind) for kind, count in self.layer_kinds(self.first_k_dense_replace,
                                                                              self.num_layers))

    @functools.cached_property
    def num_params(self):
        """Every parameter. Narayanan et al. 2021's 12 l h^2 (1 + 13/(12 h) + (V + s)/(12 l h)) for a GPT-3-shaped
        model (see the class), plus the final norm's 2h, which their count leaves out."""
        layers = self._over_layers(lambda kind: kind.layer_dense_params + kind.layer_expert_params)
        return layers + self.embedding_params + self.head_params

    @functools.cached_property
    def active_params(self):
        """The parameters one token goes through: top_k of the routed experts (and the shared ones)."""
        idle = (self.num_experts - self.top_k) * self.expert_params if self.moe else 0
        return self.num_params - (self.num_layers - self.first_k_dense_replace) * idle

    @functools.cached_property
    def layer_matmul_params(self):
        """The weights one token multiplies in a layer: attention's (attention_matrices), the router and top_k
        experts' matrices and the shared experts' (a dense layer's MLP); biases and norms are added, not
        multiplied."""
        router = self.dim * self.num_experts if self.moe else 0
        experts = self.top_k + self.n_shared_experts if self.moe else 1
        mlp = self.ffn_matrices * self.dim * self.ffn_dim * experts
        return sum(k * n for k, n in self.attention_matrices) + router + mlp

    @functools.cached_property
    def attention_flops_per_token(self):
        """QK^T and AV of one token in one layer, forward, against all s keys (the whole square, as Narayanan et al.
        count): 2 s heads (qk_head_dim + value_head_dim), 4 s h without latent attention."""
        return 2 * self.seq_len * self.num_heads * (self.qk_head_dim + self.value_head_dim)

    def flops_per_token(self, recompute="none"):
        """Training FLOPs per token, counted from the matrix products: the forward 2 x the weights a token
        multiplies, attention's QK^T and AV 4 s h per layer (the whole s x s square, as Narayanan et al. count), the
        output layer 2 V h; backward twice the forward. Not counted: the embedding lookup (a gather, no product),
        norms and element-wise work. With full recomputation one more forward of the layers (not of the output
        layer): Narayanan et al. 2021's 96 B s l h^2 (1 + s/6h + V/16lh) per step of B sequences."""
        forward_layers = self._over_layers(lambda kind: 2 * kind.layer_matmul_params + kind.attention_flops_per_token)
        passes = 4 if recompute == "full" else 3
        return passes * forward_layers + 3 * 2 * self.vocab_size * self.dim


# ---------------------------------------------------------------- devices and links

@dataclasses.dataclass(frozen=True)
class Link:
    """A link of the alpha-beta model (notebook 01): a message of S bytes takes alpha + S / beta seconds."""

    alpha: float  # seconds
    beta: float  # bytes per second, per device, in one direction


@dataclasses.dataclass(frozen=True)
class GPU:
    """A device's constants: dense 16-bit peak, memory bandwidth and size, the links of the node it is sold in,
    and how close its matrix products come to the peak (the efficiency curve: compute.py)."""

    name: str
    peak_flops: float  # dense bf16, per second
    hbm_bandwidth: float  # bytes per second
    memory_bytes: float  # what the device reports as total memory
    intra: Link  # NVLink, one direction, per device
    inter: Link  # InfiniBand, one direction, per device (one NIC per GPU)
    devices_per_node: int = 8
    matmul_efficiency: float = 0.8  # the share of peak a large bf16 GEMM reaches
    kernel_seconds: float = 5e-6  # fixed cost of one kernel: launch, the first wave's ramp and the last's tail
    fp8_flops: float = None  # dense float8 peak, per second; None: no float8 tensor cores
    fp8_efficiency_ratio: float = 1.0  # a large float8 GEMM's share of fp8_flops over a bf16 one's of peak_flops


# H100 SXM5 80GB (NVIDIA H100 datasheet, 2023): 989.4 TFLOP/s dense BF16 (1979 with 2:4 sparsity), HBM3 3.35 TB/s,
# 80 GB (nvidia-smi reports 81559 MiB); NVLink 4: 900 GB/s per GPU both directions, 450 GB/s one way; DGX H100: 8
# ConnectX-7 NICs at 400 Gb/s (NDR), one per GPU: 50 GB/s. A100 SXM4 80GB (NVIDIA A100 datasheet, 2021): 312 TFLOP/s
# dense BF16, HBM2e 2.039 TB/s, 81920 MiB; NVLink 3: 600 GB/s both directions, 300 one way; DGX A100 / Selene
# (Narayanan et al. 2021, section 5): 8 HDR InfiniBand NICs at 200 Gb/s per node, one per GPU: 25 GB/s.
# What collectives reach of a link (assumed, of the size nccl-tests' bus bandwidths show): 0.8 of NVLink, 0.9 of
# InfiniBand (nccl-tests on 8 H100s reach about 370 GB/s of NVLink 4's 450 one way: NVIDIA/nccl issue 1374). Latency
# per ring step, NCCL's own model for its Simple protocol, which carries the megabytes of a layer (NVIDIA/nccl,
# src/graph/tuning.cc, hwLatencies): 3.4 us on NVLink, 14 us on the network (a ring across nodes pays it once per
# node: communication.group_link). Left out: its base latency of 6.6 us per collective (under 1% of a layer's
# collective at the sizes the runs move), and its LL and LL128 protocols (lower latency, half or 0.92 of the
# bandwidth: chosen only for messages of kilobytes).
# The efficiency curve (compute.py): large BF16 GEMMs reach about 0.75 of peak, as cuBLAS's published plots show for
# H100 ("New cuBLAS 12.0 Features and Matrix Multiplication Performance on NVIDIA Hopper GPUs", NVIDIA blog, 2023);
# the same 0.75 on A100 brings Narayanan et al. 2021 Table 1's two smallest runs (1.7B and 3.6B parameters, where
# little is communicated) within 5% of their published 137 and 138 TFLOP/s per GPU: a fit to those two rows,
# together with compute.ELEMENTWISE_TRAFFIC; the other eight rows are predictions.
# The same datasheet's dense FP8 peak, 1978.9 TFLOP/s (3958 with sparsity), twice BF16's; the A100 has no FP8.
# A large FP8 GEMM reaches a smaller share of it than a BF16 one of its peak: 0.62, 0.83 of BF16's 0.75
# (fp8_efficiency_ratio), from torchao's float8 README (torchao/float8/README.md, "Performance", example 2): a
# Float8Linear's forward and backward at M, K, N = 4096, 8192, 16384 on an H100, casts included, runs 1.39 times as
# fast as bf16's. Its three bf16 products take 4.46 ms at 0.75 of 989 TFLOP/s, its casts (compute.py's FLOAT8_*
# bytes) 0.50 ms at 3.35 TB/s: 4.46 / 1.39 - 0.50 = 2.71 ms for three FP8 products, 1.22 PFLOP/s, 0.62 of the FP8
# peak (0.65 at the 2.4 TB/s torchao's roofline script names for Meta's H100s). Not a fit to any run of the table:
# tests/test_planner.py recomputes the 1.39 from these constants.
H100_SXM = GPU("H100 SXM", peak_flops=989.4e12, hbm_bandwidth=3.35e12, memory_bytes=81559 * MIB,
               intra=Link(alpha=3.4e-6, beta=0.8 * 450e9), inter=Link(alpha=14e-6, beta=0.9 * 50e9),
               matmul_efficiency=0.75, fp8_flops=1978.9e12, fp8_efficiency_ratio=0.83)
A100_80GB = GPU("A100 80GB", peak_flops=312e12, hbm_bandwidth=2.039e12, memory_bytes=81920 * MIB,
                intra=Link(alpha=3.4e-6, beta=0.8 * 300e9), inter=Link(alpha=14e-6, beta=0.9 * 25e9),
                matmul_efficiency=0.75)
GPUS = {gpu.name: gpu for gpu in (H100_SXM, A100_80GB)}


@dataclasses.dataclass(frozen=True)
class Cluster:
    """num_devices devices in nodes of devices_per_node. `mfu` None (the default): compute times come from the
    roofline of the device (compute.py) and MFU is an output; a number: every matrix product runs at that share of
    peak (to compare with a source that assumes one)."""

    num_devices: int
    devices_per_node: int
    memory_bytes: float
    intra: Link  # within a node (NVLink)
    inter: Link  # between nodes (InfiniBand), per device
    peak_flops: float  # per device, in the training's precision
    mfu: float = None
    hbm_bandwidth: float = H100_SXM.hbm_bandwidth
    matmul_efficiency: float = H100_SXM.matmul_efficiency
    kernel_seconds: float = H100_SXM.kernel_seconds
    gpu: str = "custom"
    fp8_flops: float = None  # dense float8 peak per device; None: none
    fp8_efficiency_ratio: float = H100_SXM.fp8_efficiency_ratio  # a float8 GEMM's efficiency over a bf16 one's

    def __post_init__(self):
        check_int("num_devices", self.num_devices)
        check_int("devices_per_node", self.devices_per_node)
        if self.num_devices > self.devices_per_node:
            divide("num_devices", self.num_devices, "devices_per_node", self.devices_per_node, "nodes are whole")
        for name, value in (("memory_bytes", self.memory_bytes), ("peak_flops", self.peak_flops),
                            ("intra.beta", self.intra.beta), ("inter.beta", self.inter.beta),
                            ("hbm_bandwidth", self.hbm_bandwidth)):
            _check_positive(name, value)
        for name, value in (("intra.alpha", self.intra.alpha), ("inter.alpha", self.inter.alpha),
                            ("kernel_seconds", self.kernel_seconds)):
            _check_positive(name, value, allow_zero=True)
        if self.mfu is not None and not 0 < self.mfu <= 1:
            raise ValueError(f"mfu must be in (0, 1] or None, got {self.mfu}")
        if not 0 < self.matmul_efficiency <= 1:
            raise ValueError(f"matmul_efficiency must be in (0, 1], got {self.matmul_efficiency}")


def cluster(gpu, num_devices, **changes):
    """A Cluster of num_devices of a named GPU ("H100 SXM", "A100 80GB") in its vendor's nodes of 8."""
    if gpu not in GPUS:
        raise ValueError(f"gpu must be one of {tuple(GPUS)}, got {gpu!r}")
    g = GPUS[gpu]
    fields = dict(num_devices=num_devices, devices_per_node=g.devices_per_node, memory_bytes=g.memory_bytes,
                  intra=g.intra, inter=g.inter, peak_flops=g.peak_flops, hbm_bandwidth=g.hbm_bandwidth,
                  matmul_efficiency=g.matmul_efficiency, kernel_seconds=g.kernel_seconds, gpu=g.name,
                  fp8_flops=g.fp8_flops, fp8_efficiency_ratio=g.fp8_efficiency_ratio)
    return Cluster(**(fields | changes))


def _check_positive(name, value, allow_zero=False):
    if isinstance(value, bool) or not isinstance(value, (int, float)):
        raise TypeError(f"{name} must be a number, got {value!r}")
    if value < 0 or (value == 0 and not allow_zero):
        raise ValueError(f"{name} must be {'non-negative' if allow_zero else 'positive'}, got {value}")


# ---------------------------------------------------------------- a split

@dataclasses.dataclass(frozen=True)
class Config:
    dp: int = 1
    tp: int = 1  # with sequence parallel outside the column/row pairs (Korthikanti et al.) unless told otherwise
    pp: int = 1
    cp: int = 1
    ep: int = 1  # borrowed from the data axis dp * cp
    micro_batch_size: int = 1  # sequences
    recompute: str = "none"
    zero_stage: int = 1  # over the data axis dp * cp; 3 is FSDP
    schedule: str = "1F1B"  # the pipeline's: "1F1B", "interleaved" (v pieces per rank), "ZB-H1"
    v: int = 1  # pieces of the model per pipeline rank (interleaved)
    cp_mode: str = "ring"  # ring attention, or an all-gather of keys and values (Llama 3)
    tp_overlap: bool = False  # tensor-parallel collectives overlapped with the matrix products they feed (PyTorch's
    #                           AsyncTP: backward, the column-parallel products' input-gradient reduce-scatters not)
    sequence_parallel: bool = True  # False: Megatron-LM before Korthikanti et al. 2022 (norms, dropout, residuals
    #                                 on every tensor-parallel rank in full; an all-reduce per column/row pair)
    prefetch: bool = True  # ZeRO-3/FSDP gathers a layer's weights beside the previous one's compute; False: on demand
    pp_scatter_gather: bool = True  # without sequence parallel, each tensor-parallel rank sends 1/tp of the
    #                                 activations to the next stage, gathered there over NVLink (Narayanan et al.
    #                                 2021, section 4.1; DeepSpeed's pipeline engine, PartitionedTensor); False:
    #                                 each sends them whole
    pp_whole_grads: bool = False  # the activations' gradients sent back whole by every tensor-parallel rank, the
    #                               activations split (DeepSpeed's pipeline engine before v0.6: is_grad_partitioned
    #                               False, is_pipe_partitioned True; deepspeed/runtime/pipe/engine.py)
    pp_blocking: bool = False  # DeepSpeed's pipeline engine: each step's receive and send blocking and paired, in turn
    #                            (deepspeed/runtime/pipe/schedule.py, TrainSchedule): two hand-offs in series per pass
    accumulate_fp32: bool = False  # DeepSpeed's BF16_Optimizer: each micro-batch's bf16 gradients added into fp32
    #                                ones after its backward, a pass over the stage's gradients (step.ACCUMULATE_BYTES)
    gather_copies: bool = False  # ZeRO-3 of DeepSpeed 0.3 (2021): each weight tensor gathered apart, waited for,
    #                              through PyTorch's list all_gather, which copies each of the n ranks' shards out of
    #                              a flat buffer: n copy kernels per tensor (step.py)
    distribute_saved_activations: bool = False  # without sequence parallel, full recomputation's saved layer inputs
    #                                             split over tp (Megatron-LM's --distribute-checkpointed-activations)
    float8: bool = False  # the layers' linear products in float8 (torchao's Float8Linear, dynamic tensorwise scaling)
    fused: bool = True  # element-wise work in fused kernels (Megatron's, torch.compile); False: PyTorch eager
    logit_bytes: int = 4  # bytes per logit at the loss's peak (memory.logits_bytes): 4, Megatron's fused cross
    #                       entropy (Korthikanti et al.'s fp32 logits); 12, PyTorch's F.cross_entropy on fp32 logits
    loss_parallel: bool = False  # with tp > 1, PyTorch's loss_parallel on the vocab-sharded logits (torchtitan's
    #                              default), whose backward holds memory.LOSS_PARALLEL_BYTES per logit, not logit_bytes
    ep_overlap: bool = False  # the expert all-to-all hidden behind another micro-batch's computation (DeepSeek-V3's
    #                           DualPipe, section 3.2.1: a forward and a backward chunk overlapped)
    keep_stage_outputs: bool = False  # the pipeline schedule keeps each in-flight piece's output tensor until its
    #                                   backward (Megatron-LM before deallocate_output_tensor, 2022-01: memory.py)
    uncounted_activations: float = 0.0  # without recomputation, what a framework's runs held beyond the counted
    #                                     activations, as a share of them, where a published run measures it (memory.py)


@functools.lru_cache(maxsize=1024)
def stage_layer_counts(num_layers, pp):
    """Layers per pipeline stage, as practitioners place them: ceil(L / pp) each, and the layers that are missing
    taken from the stages that also carry the embedding or the head, last and first, then their neighbours
    (Llama 3 405B: 126 layers on 16 stages, the first and last stage one layer fewer; Dubey et al. 2024, 3.3.2).
    The first and last stage may hold no layer: Llama 3's interleaved pieces, "the first model chunk on the first
    stage has only the embedding, and the last model chunk on the last stage has only output projection and loss
    calculation" (ibid.), 126 layers on 16 x 8 pieces of one layer each; every other stage needs one."""
    if num_layers < max(1, pp - 2):
        raise ValueError(f"num layers {num_layers} do not fill pp {pp} stages: every stage needs a layer, but the "
                         f"first and last, which carry the embedding and the head")
    full = -(-num_layers // pp)
    counts = [full] * pp
    missing = full * pp - num_layers
    for i in (i for pair in zip(range(pp - 1, -1, -1), range(pp)) for i in pair):
        if not missing:
            break
        if counts[i] > (0 if i in (0, pp - 1) else 1):
            counts[i] -= 1
            missing -= 1
    return tuple(counts)


@functools.lru_cache(maxsize=1024)
def rank_layer_counts(num_layers, pp, v=1):
    """Layers each pipeline rank holds: its pieces rank, rank + pp, ... of stage_layer_counts(num_layers, pp v)."""
    counts = stage_layer_counts(num_layers, pp * v)
    return tuple(sum(counts[rank::pp]) for rank in range(pp))


@functools.lru_cache(maxsize=1024)
def rank_dense_layers(num_layers, first_k_dense, pp, v=1):
    """How many of the first `first_k_dense` layers each pipeline rank holds (its pieces rank, rank + pp, ... of
    stage_layer_counts(num_layers, pp v), in order)."""
    counts = stage_layer_counts(num_layers, pp * v)
    starts = [sum(counts[:piece]) for piece in range(pp * v)]
    dense = [max(0, min(first_k_dense, start + count) - start) for start, count in zip(starts, counts)]
    return tuple(sum(dense[rank::pp]) for rank in range(pp))


@functools.lru_cache(maxsize=1024)
def ranks_alike(num_layers, first_k_dense, pp, v=1):
    """The pipeline ranks that stand for all: the first and the last (the embedding; the head and the logits), and,
    of the ranks holding alike layers (as many, and as many of DeepSeek-V3's dense first ones), the first. Any other
    rank holds what one of these holds, with no more in flight and the same time per micro-batch: the peak memory
    and the slowest stage are among them. With uneven stages a later rank can hold more than the first: 105 layers
    on 56 stages are 1, 1, 1, 2, ... and the fourth rank keeps 53 micro-batches of 2 layers, the first 56 of 1."""
    counts = rank_layer_counts(num_layers, pp, v)
    dense = rank_dense_layers(num_layers, first_k_dense, pp, v) if first_k_dense else (0,) * pp
    firsts = {}
    for stage, alike in enumerate(zip(counts, dense)):
        firsts.setdefault(alike, stage)
    return tuple(sorted({0, pp - 1, *firsts.values()}))


def rank_layer_kinds(model, pp, v, stage):
    """[(model of a layer, how many)] on pipeline rank `stage`: its dense first layers and its others."""
    layers = rank_layer_counts(model.num_layers, pp, v)[stage]
    if not model.first_k_dense_replace:
        return ((model, layers),)
    dense = rank_dense_layers(model.num_layers, model.first_k_dense_replace, pp, v)[stage]
    return model.layer_kinds(dense, layers)


def _batch_sizes_that_divide(global_batch, unit):
    below = global_batch // unit * unit
    return [b for b in (below, below + unit) if b > 0]


def check_config(model, cluster, global_batch, config):
    """The number of micro-batches per step, if `config` splits `model` on `cluster` evenly; else a ValueError
    that names what does not divide (and, for the batch, the sizes that would)."""
    for name in ("dp", "tp", "pp", "cp", "ep", "micro_batch_size", "v"):
        check_int(name, getattr(config, name))
    check_int("global_batch", global_batch)
    for name, value, allowed in (("recompute", config.recompute, RECOMPUTE + RECOMPUTE_OTHER),
                                 ("zero_stage", config.zero_stage, ZERO_STAGES),
                                 ("schedule", config.schedule, SCHEDULES), ("cp_mode", config.cp_mode, CP_MODES)):
        if value not in allowed:
            raise ValueError(f"{name} must be one of {allowed}, got {value!r}")
    if config.float8 and not cluster.fp8_flops:
        raise ValueError(f"float8 needs a device with float8 tensor cores; {cluster.gpu} has none (fp8_flops None)")
    mesh = config.dp * config.tp * config.pp * config.cp
    if mesh != cluster.num_devices:
        raise ValueError(f"the mesh dp x tp x pp x cp = {config.dp} x {config.tp} x {config.pp} x {config.cp} = {mesh} "
                         f"is not the number of devices, {cluster.num_devices}")
    divide("num_heads", model.num_heads, "tp", config.tp, "each tensor-parallel rank computes whole heads")
    if model.kv_heads % config.tp and config.tp % model.kv_heads:
        raise ValueError(f"num kv heads {model.kv_heads} and tp {config.tp} do not divide one another: each "
                         f"tensor-parallel rank holds whole key/value heads, or a copy of one")
    divide("ffn_dim", model.ffn_dim, "tp", config.tp, "each tensor-parallel rank holds as many MLP features")
    if config.v > 1 and config.schedule != "interleaved":
        raise ValueError(f"v {config.v} pieces per rank need the interleaved schedule, got {config.schedule!r}")
    stage_layer_counts(model.num_layers, config.pp * config.v)
    if config.cp > 1 and not model.flash_attention:  # as the search offers it (search._valid)
        raise ValueError(f"cp {config.cp} needs flash (blockwise) attention: the ring folds each hop's block of scores "
                         f"into the output and keeps none; a model that keeps the s x s scores has no ring to run "
                         f"(Model(flash_attention=True), or cp 1)")
    local_seq = divide("seq_len", model.seq_len, "cp", config.cp, "every context-parallel rank holds a chunk")
    divide("seq_len / cp", local_seq, "tp", config.tp, "sequence parallel splits each rank's chunk over tp")
    divide("dp x cp", config.dp * config.cp, "ep", config.ep, "expert parallel borrows its ranks from the data axis")
    divide("num_experts", model.num_experts, "ep", config.ep, "every expert-parallel rank holds as many experts")
    unit = config.dp * config.micro_batch_size
    if global_batch % config.dp:
        raise ValueError(f"global batch {global_batch} is not divisible by dp {config.dp}: every data-parallel "
                         f"replica gets as many; global batches that would divide: "
                         f"{', '.join(map(str, _batch_sizes_that_divide(global_batch, unit)))}")
    if global_batch % unit:
        raise ValueError(f"global batch / dp {global_batch // config.dp} is not divisible by micro batch size "
                         f"{config.micro_batch_size}: a replica's batch is a whole number of micro-batches; global "
                         f"batches that would divide: {', '.join(map(str, _batch_sizes_that_divide(global_batch, unit)))}")
    m = global_batch // unit
    if config.schedule == "interleaved" and config.pp > 1 and m % config.pp:
        raise ValueError(f"micro-batches {m} are not a multiple of pp {config.pp}: the interleaved schedule runs "
                         f"them in groups of pp (Megatron-LM's rule)")
    return m
