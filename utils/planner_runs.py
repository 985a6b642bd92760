"""The published runs the planner (utils/planner.py) is validated against: one record per run, as its source printed it.

    record (model shape, cluster, layout, what was reported, with its source)
        -> the reported number as the planner's quantity (seconds per step), with the source's own FLOP formula
        -> validate(RUNS): the planner at the published layout, predicted against reported, and the rank of that
           layout among the planner's search

A layout knob the source does not print (micro-batch size, recomputation, ZeRO stage, interleaving) is None in
the record, and validate() takes the planner's best for the published split; a value taken from elsewhere (a
framework's default, a formula that reproduces the printed numbers) is named in the record's `assumptions`.
Conversions are checked against the numbers the sources print next to them (tests/test_planner_runs.py).
"""
import dataclasses
import re

from utils import planner as pl

GIB = 2**30

# ---------------------------------------------------------------- GPUs and networks, each number with its source

# Each record's GPU as the planner's device (utils/planner/describe.py holds the constants and their sources) and
# what differs from it: memory; torchtitan's Grand Teton H100s (benchmarks/llama3_h100_202412_torchtitan.md,
# 'Hardware' and footnote 2) have 96 GB of HBM2e at 2.4 TB/s, run at a 500 W power limit, and their "actual peak
# TFLOPs number is between SXM and NVL" (989.4 and 835.5 TFLOP/s dense BF16, NVIDIA's H100 datasheet): the midpoint
# taken, FP8 twice it as on both (the benchmark's MFU is counted against the SXM's 989); the H800 is an H100 whose
# NVLink is cut to 400 GB/s both ways (DeepSeek-V3, section 3.1: 160 GB/s reached).
GRAND_TETON_PEAK = (989.4e12 + 835.5e12) / 2
GPUS = {
    "A100-40GB": ("A100 80GB", {"memory_bytes": 40 * GIB}),
    "A100-80GB": ("A100 80GB", {}),
    "H100-80GB": ("H100 SXM", {}),
    "H100-96GB": ("H100 SXM", {"memory_bytes": 96 * GIB, "hbm_bandwidth": 2.4e12, "peak_flops": GRAND_TETON_PEAK,
                               "fp8_flops": 2 * GRAND_TETON_PEAK}),
    "H800-80GB": ("H100 SXM", {"intra": pl.Link(alpha=pl.H100_SXM.intra.alpha, beta=0.8 * 200e9)}),
}
# DeepSeek-V3's all-to-all kernels run on SMs of their own, beside the computation: "only 20 SMs are sufficient to fully
# utilize the bandwidths of IB and NVLink" (section 3.2.2), "we allocate 20 out of the 132 SMs available in the H800
# GPU for this purpose, which will limit the computational throughput" (section 3.5.1). DualPipe pairs every forward
# chunk with a backward chunk whose all-to-all it hides (3.2.1), so its products run on 112 SMs all step: at 112/132 of
# the share of peak the planner's H100 reaches (matmul_efficiency; its peak, and so MFU, unchanged).
H800_SMS, DEEPSEEK_COMMUNICATION_SMS = 132, 20
GPUS["H800-80GB, 20 SMs communicating"] = ("H100 SXM", GPUS["H800-80GB"][1] | {
    "matmul_efficiency": pl.H100_SXM.matmul_efficiency * (H800_SMS - DEEPSEEK_COMMUNICATION_SMS) / H800_SMS})
ALPHA_INTER = pl.H100_SXM.inter.alpha  # seconds per step between nodes, as the planner's devices take it


# ---------------------------------------------------------------- a record

@dataclasses.dataclass(frozen=True)
class Shape:
    """The model. mlp: 'gelu' (two matrices, Megatron's GPT), 'relu' (two: OPT), 'relu2' (two, squared ReLU:
    Nemotron-4) or 'swiglu' (three: Llama). tied: the output layer shares tok_embeddings' weight."""

    num_layers: int
    dim: int
    num_heads: int
    ffn_dim: int
    vocab_size: int
    seq_len: int
    num_kv_heads: int = 0  # 0: as many as num_heads
    mlp: str = "gelu"
    tied: bool = False
    num_experts: int = 1
    top_k: int = 1
    name: str = "model"
    gpt3: bool = False  # GPT-3's layer as Megatron ran it in 2021-22: biases, learned positions, dropout, no flash
    # DeepSeek-V2/V3's further fields, as (name, value) pairs named as their config.json names them (the planner's
    # Model takes the same names): latent attention, shared experts, dense first layers, node-limited routing
    deepseek: tuple = ()
    grad_bytes: int = 2  # bytes of a gradient as kept and reduced: 4 where Megatron-LM trains in bf16 (MEGATRON_BF16)


@dataclasses.dataclass(frozen=True)
class Layout:
    """How the run was split. None: not stated by the source (validate() takes the planner's best)."""

    dp: int
    tp: int = 1
    pp: int = 1
    cp: int = 1
    ep: int = 1
    global_batch: int = 1  # sequences per step
    micro_batch_size: int | None = None
    recompute: str | None = None  # 'none', 'selective' or 'full'
    zero_stage: int | None = None  # 0 plain data parallel; 1 distributed optimizer; 2; 3 FSDP (reshard after forward)
    virtual_stages: int | None = 1  # pieces per pipeline rank: > 1 is interleaved 1F1B
    stage_layers: tuple | None = None  # layers of each pipeline stage, where the source gives an uneven split
    float8: bool = False  # matrix products in float8 (torchtitan's Float8, DeepSeek-V3's FP8)
    sequence_parallel: bool = True  # False: Megatron-LM before Korthikanti et al. 2022, and the frameworks built on it
    tp_overlap: bool = False  # tensor-parallel collectives overlapped with the products (AsyncTP, TE's userbuffers)
    prefetch: bool = True  # ZeRO-3/FSDP gathers the next layer's weights during this one's compute
    distribute_saved_activations: bool = False  # Megatron's --distribute-checkpointed-activations (without SP)
    pp_scatter_gather: bool = True  # False: every tensor-parallel rank sends the activations whole
    pp_whole_grads: bool = False  # their gradients sent back whole (DeepSpeed's pipeline engine before v0.6)
    pp_blocking: bool = False  # DeepSpeed's pipeline engine: blocking sends and receives in turn (Config.pp_blocking)
    gather_copies: bool = False  # DeepSpeed 0.3's ZeRO-3: each weight tensor gathered apart (Config.gather_copies)
    accumulate_fp32: bool = False  # DeepSpeed's BF16_Optimizer: gradients added into fp32 ones per micro-batch
    fused: bool = True  # element-wise work fused (Megatron's kernels, torch.compile); False: PyTorch eager
    logit_bytes: int = 4  # bytes per logit at the loss's peak: 4 fused (Megatron), 12 F.cross_entropy (torchtitan)
    loss_parallel: bool = False  # with tensor parallel, PyTorch's loss_parallel (torchtitan): 16 bytes per logit
    zero_stages: tuple = (0, 1, 2, 3)  # the ZeRO stages the run's framework offers, where zero_stage is not stated
    schedule: str | None = None  # the pipeline schedule where not 1F1B or interleaved (virtual_stages): 'ZB-H1'
    ep_overlap: bool = False  # the expert all-to-all hidden behind another micro-batch's compute (DualPipe)
    keep_stage_outputs: bool = False  # Megatron-LM of 2021: in-flight stage outputs kept (Config.keep_stage_outputs)
    uncounted_activations: float = 0.0  # held beyond the counted activations without recomputation (UNCOUNTED_2021)
    framework: str = ""  # a key of FRAMEWORKS: the recomputation modes and schedules the search offers ('': all)


@dataclasses.dataclass(frozen=True)
class Run:
    name: str
    source: str  # paper, table, row; or the repository, file and commit
    shape: Shape
    gpu: str  # a key of GPUS
    num_devices: int
    inter_gbps: float  # the network between nodes, Gb/s per GPU (NICs per node x their rate / GPUs per node)
    layout: Layout
    reported: float | None  # the throughput in the source's unit; None: no throughput published
    unit: str = "tflops_per_gpu"  # or 'step_seconds', 'tokens_per_s_per_gpu', 'gpu_hours_per_1e12_tokens'
    flops: str = "none"  # the source's FLOP formula, a key of FLOP_FORMULAS ('none': the unit needs none)
    memory_bytes: float | None = None  # per GPU, where published (the largest over ranks)
    oom: bool = False  # the source reports this layout out of memory
    devices_per_node: int = 8
    unmodelled: str = ""  # what of the run the record's shape cannot say (the row is then not compared)
    assumptions: tuple = ()  # what the record took from elsewhere than its source, one sentence each
    disagreement: str = ""  # why the planner and this run still disagree, where they do (format_disagreements)


UNITS = ("tflops_per_gpu", "step_seconds", "tokens_per_s_per_gpu", "gpu_hours_per_1e12_tokens")


# ---------------------------------------------------------------- the sources' FLOP formulas, per step (whole batch)

def narayanan_flops(shape, batch):
    """Narayanan et al. 2021, eq. (3): 96 B s l h^2 (1 + s/6h + V/16lh) per iteration, which counts the forward
    recomputed in backward (4 passes of 24 B s h^2 each): GPT with a 4h GELU MLP and tied embeddings."""
    s, l, h, v = shape.seq_len, shape.num_layers, shape.dim, shape.vocab_size
    return 96 * batch * s * l * h**2 * (1 + s / (6 * h) + v / (16 * l * h))


def megatron_model_flops(shape, batch):
    """Megatron-LM's num_floating_point_operations (megatron/training/training.py, 2024): model FLOPs, no
    recomputation: 12 B s L h^2 [(1 + g/a + s/h) + f/h k (3/2 if gated) + V/(2Lh)] (query projection = h).
    For GPT (g = a, f = 4h) it is 72 B s l h^2 (1 + s/6h + V/12lh): Korthikanti et al. 2022's model FLOPs."""
    s, l, h, v = shape.seq_len, shape.num_layers, shape.dim, shape.vocab_size
    groups = (shape.num_kv_heads or shape.num_heads) / shape.num_heads
    gated = 3 / 2 if shape.mlp == "swiglu" else 1
    per_layer = (1 + groups + s / h) + shape.ffn_dim / h * shape.top_k * gated + v / (2 * l * h)
    return 12 * batch * s * l * h**2 * per_layer


def num_params(shape):
    """The model's parameters, as the planner counts them (GPT-3's biases and learned positions included where the
    record is GPT-3-shaped), the output layer once if tied."""
    return planner_model(shape).num_params


def six_p_flops(shape, batch):
    """torchtitan's get_num_flop_per_token (torchtitan/utils.py, 2024-12): 6 P + 12 l h s per token, P every
    parameter but tok_embeddings, attention's two products over the whole sequence (no causal halving)."""
    params = num_params(shape) - shape.vocab_size * shape.dim
    return batch * shape.seq_len * (6 * params + 12 * shape.num_layers * shape.dim * shape.seq_len)


def bloom_hardware_flops(shape, batch):
    """BigScience's TFLOPs (bigscience/math/README.md, 'Calculate TFLOPs'): 4 x 2 x P per token, P the model size,
    recomputation counted ('hardware FLOPs'), attention's products left out."""
    return 8 * num_params(shape) * shape.seq_len * batch


FLOP_FORMULAS = {"narayanan2021": narayanan_flops, "megatron_model": megatron_model_flops, "6p": six_p_flops,
                 "bloom_hfu": bloom_hardware_flops}


def step_flops(run):
    return FLOP_FORMULAS[run.flops](run.shape, run.layout.global_batch)


def reported_step_seconds(run):
    """The reported throughput as seconds per step: with the source's own FLOP formula for TFLOP/s per GPU."""
    if run.reported is None:
        return None
    n, tokens = run.num_devices, run.layout.global_batch * run.shape.seq_len
    if run.unit == "step_seconds":
        return run.reported
    if run.unit == "tflops_per_gpu":
        return step_flops(run) / (n * run.reported * 1e12)
    if run.unit == "tokens_per_s_per_gpu":
        return tokens / (n * run.reported)
    if run.unit == "gpu_hours_per_1e12_tokens":
        return tokens * run.reported * 3600 / (1e12 * n)
    raise ValueError(f"unit must be one of {UNITS}, got {run.unit!r}")


def tflops_per_gpu(run, step_seconds):
    """Per-GPU TFLOP/s of a step of `step_seconds`, counted with the run's FLOP formula."""
    return step_flops(run) / (run.num_devices * step_seconds) / 1e12


# ---------------------------------------------------------------- the record as the planner's arguments

def _known(cls, **values):
    """An instance of the planner's dataclass `cls` from the values it has fields for, and the names of the values
    it has none for, where they are not their default (what the record says that this planner cannot take)."""
    names = {f.name for f in dataclasses.fields(cls)}
    return cls(**{k: v for k, v in values.items() if k in names}), [k for k in values if k not in names]


MLP_MATRICES = {"gelu": 2, "relu": 2, "relu2": 2, "swiglu": 3}


def planner_model(shape, with_missing=False):
    gpt3 = {"biases": True, "learned_positions": True, "dropout": True, "flash_attention": False} if shape.gpt3 else {}
    model, missing = _known(pl.Model, num_layers=shape.num_layers, dim=shape.dim, num_heads=shape.num_heads,
                            ffn_dim=shape.ffn_dim, seq_len=shape.seq_len, vocab_size=shape.vocab_size,
                            num_kv_heads=shape.num_kv_heads, num_experts=shape.num_experts, top_k=shape.top_k,
                            ffn_matrices=MLP_MATRICES[shape.mlp], name=shape.name, tied=shape.tied, **gpt3,
                            grad_bytes=shape.grad_bytes, **dict(shape.deepseek))
    return (model, missing) if with_missing else model


def planner_cluster(run, with_missing=False):
    """The planner's cluster of the record's GPUs, with the record's own network between nodes (Gb/s per GPU,
    0.9 of it reached by collectives, as the planner assumes of InfiniBand)."""
    name, changes = GPUS[run.gpu]
    inter = pl.Link(ALPHA_INTER, 0.9 * run.inter_gbps * 1e9 / 8)
    cluster = pl.cluster(name, run.num_devices, devices_per_node=run.devices_per_node, inter=inter, **changes)
    return (cluster, []) if with_missing else cluster


# ---------------------------------------------------------------- what each run's framework offered the search

@dataclasses.dataclass(frozen=True)
class Framework:
    """The recomputation modes and pipeline schedules a framework offered at the run's date (the search takes only
    those: an alternative layout is one its authors could have run), each with its source."""

    recomputes: tuple
    schedules: tuple  # names of the planner's schedules (SCHEDULES); 1F1B always
    source: str
    even_stages: bool = False  # as many layers on every (virtual) stage (Megatron-LM)
    interleaved_from: int = 2  # the fewest pipeline stages it interleaves
    zero_under_pipeline: int = 3  # the highest ZeRO stage it runs with a pipeline


NONE_OR_FULL = ("none", "full")  # activation checkpointing of whole layers, or none
MEGATRON_SCHEDULES = ("1F1B", "interleaved")
# Megatron-LM splits the layers evenly: megatron/model/transformer.py asserts 'num_layers must be divisible by
# transformer_pipeline_model_parallel_size', and arguments.py that the layers per pipeline stage divide by
# --num-layers-per-virtual-pipeline-stage: L % (p v) == 0, so its interleaving degrees are those that divide L / p
# (Korthikanti et al. 2022 ran v = 3 at 105 layers on 35 stages). Until --overlap-p2p-comm (2023) arguments.py also
# refused interleaving on 2 stages: "pipeline-model-parallel size should be greater than 2 with interleaved schedule".
MEGATRON_EVEN = ("megatron/model/transformer.py, ParallelTransformer's number of layers per stage, and "
                 "megatron/arguments.py's virtual pipeline stages: layers split evenly over (virtual) stages")
MEGATRON_3_STAGES = ("; megatron/arguments.py before --overlap-p2p-comm: 'pipeline-model-parallel size should be "
                     "greater than 2 with interleaved schedule'")
DEEPSPEED_PIPE = ("DeepSpeed's pipeline engine runs one schedule, TrainSchedule, a 1F1B without interleaving "
                  "(deepspeed/runtime/pipe/schedule.py); its activation checkpointing recomputes whole layers "
                  "(deepspeed/runtime/activation_checkpointing/checkpointing.py, Megatron's checkpoint_activations); "
                  "its engine asserts 'ZeRO-2 and ZeRO-3 are incompatible with pipeline parallelism'")
FRAMEWORKS = {
    "Megatron-LM 2021": Framework(NONE_OR_FULL, MEGATRON_SCHEDULES, (
        "Narayanan et al. 2021 section 2.2 (the interleaved schedule, --num-layers-per-virtual-pipeline-stage) and "
        "section 3.5 (--checkpoint-activations: whole layers); selective recomputation came with Korthikanti et al. "
        "2022 (--recompute-granularity selective, Megatron-LM 2022), ZB-H1 with Qi et al. 2023 (arXiv 2401.10241); "
        + MEGATRON_EVEN + MEGATRON_3_STAGES), even_stages=True, interleaved_from=3),
    "Megatron-LM 2022": Framework(("none", "selective", "full"), MEGATRON_SCHEDULES, (
        "Korthikanti et al. 2022 (arXiv 2205.05198) section 5 (selective recomputation, Megatron-LM's "
        "--recompute-granularity selective); no zero-bubble schedule before Qi et al. 2023; " + MEGATRON_EVEN
        + MEGATRON_3_STAGES), even_stages=True, interleaved_from=3),
    "Megatron-LM 2024": Framework(("none", "selective", "full"), MEGATRON_SCHEDULES, (
        "megatron/training/arguments.py of 2024 (--recompute-granularity full|selective, "
        "--num-layers-per-virtual-pipeline-stage); megatron/core/pipeline_parallel/schedules.py has 1F1B with and "
        "without interleaving, no zero-bubble schedule; " + MEGATRON_EVEN), even_stages=True),
    "DeepSpeed 2021": Framework(NONE_OR_FULL, ("1F1B",), DEEPSPEED_PIPE + " (MT-NLG, DeepSpeed 0.3's ZeRO-3)",
                                zero_under_pipeline=1),
    "DeepSpeed 2022": Framework(NONE_OR_FULL, ("1F1B",), DEEPSPEED_PIPE + " (GPT-NeoX's DeeperSpeed, BLOOM's "
                                "Megatron-DeepSpeed, forked from Megatron-LM before its selective recomputation)",
                                zero_under_pipeline=1),
    "metaseq 2022": Framework(NONE_OR_FULL, ("1F1B",), (
        "facebookresearch/metaseq: --checkpoint-activations wraps whole layers (fairscale's checkpoint_wrapper); "
        "it has no pipeline parallel (Reason.offered keeps pp 1)")),
    "torchtitan 2024-06": Framework(("none", "selective", "full"), MEGATRON_SCHEDULES, (
        "torchtitan at 041336434916 (2024-06): activation_checkpoint.mode none|selective|full; "
        "torch.distributed.pipelining's Schedule1F1B and ScheduleInterleaved1F1B (zero bubble came later: "
        "pytorch/pytorch PR 133467, 2024-08)")),
    "torchtitan 2024-12": Framework(("none", "selective", "full"), MEGATRON_SCHEDULES + ("ZB-H1",), (
        "torchtitan at 9dec370 (2024-12): activation_checkpoint.mode none|selective|full; pipelining's 1F1B, "
        "Interleaved1F1B and, since pytorch/pytorch PR 133467 (2024-08), ScheduleInterleavedZeroBubble, whose "
        "split of the backward into input and weight gradients does not run under torch.compile "
        "(pytorch/pytorch issue 161904): offered only to eager runs (framework_offers)")),
    "DeepSeek-V3": Framework(pl.RECOMPUTE + ("norms_up_fp8",), pl.SCHEDULES, (
        "DeepSeek-AI 2024 (arXiv 2412.19437v2) section 3.2.3: every RMSNorm and MLA's up-projections recomputed, "
        "section 3.3.3: activations cached in FP8 and E5M6 (the planner's norms_up_fp8, utils/planner/memory.py); "
        "its other recomputation modes and schedules are not published: the planner's offered; DualPipe (3.2.1), "
        "not among them, extends ZB-H1")),
    "Llama 3": Framework(("none", "selective", "full"), MEGATRON_SCHEDULES, (
        "Llama Team 2024 (arXiv 2407.21783) section 3.3.2: Meta's pipeline runs an interleaved schedule (after "
        "Narayanan et al.) with the micro-batches per round tunable, no zero-bubble schedule")),
}


def framework_offers(layout):
    """{plan() choice: values}: the recomputation modes and the (schedule, v) choices the run's framework offered
    (FRAMEWORKS; all the planner's where the record names none). torch.compile rules out PyTorch's zero-bubble
    schedule (FRAMEWORKS['torchtitan 2024-12'])."""
    framework = FRAMEWORKS.get(layout.framework, Framework(pl.RECOMPUTE, pl.SCHEDULES, ""))
    schedules = framework.schedules
    if layout.framework.startswith("torchtitan") and layout.fused:
        schedules = tuple(s for s in schedules if s != "ZB-H1")
    choices = pl.SCHEDULE_CHOICES + ((("interleaved", 3),) if framework.even_stages else ())  # v = 3: Korthikanti's
    return {"recomputes": framework.recomputes, "even_stages": framework.even_stages,
            "schedules": tuple(c for c in choices if c[0] in schedules)}


def runs_split(layout, num_layers, pp, v, zero_stage=0):
    """Whether the run's framework can split num_layers layers over pp stages of v pieces each, at that ZeRO stage
    (Framework.even_stages, interleaved_from, zero_under_pipeline)."""
    framework = FRAMEWORKS.get(layout.framework)
    if pp == 1 or framework is None:
        return True
    return ((v == 1 or pp >= framework.interleaved_from) and zero_stage <= framework.zero_under_pipeline
            and (not framework.even_stages or num_layers % (pp * v) == 0))


SETTINGS = ("float8", "sequence_parallel", "tp_overlap", "prefetch", "distribute_saved_activations",
            "pp_scatter_gather", "pp_whole_grads", "pp_blocking", "gather_copies", "accumulate_fp32", "fused",
            "ep_overlap", "logit_bytes", "loss_parallel", "keep_stage_outputs", "uncounted_activations")


def framework_settings(layout):
    """{Config field: value} of what the run's framework did, whatever the split: the planner prices the published
    layout and, in the search, every alternative with them (an alternative is what the same framework would have
    run)."""
    return {name: getattr(layout, name) for name in SETTINGS}


def planner_config(layout, micro_batch_size, recompute, zero_stage, virtual_stages, with_missing=False):
    """The planner's Config; an uneven split of layers other than the planner's own rule is what the planner
    cannot take (listed with with_missing=True)."""
    interleaved = {"schedule": "interleaved", "v": virtual_stages} if virtual_stages and virtual_stages > 1 else {}
    if layout.schedule and not interleaved:
        interleaved = {"schedule": layout.schedule}
    config = pl.Config(dp=layout.dp, tp=layout.tp, pp=layout.pp, cp=layout.cp, ep=layout.ep,
                       micro_batch_size=micro_batch_size, recompute=recompute, zero_stage=zero_stage,
                       **framework_settings(layout), **interleaved)
    missing = []
    if layout.stage_layers and layout.stage_layers != pl.stage_layer_counts(sum(layout.stage_layers), layout.pp):
        missing.append("stage_layers")
    return (config, missing) if with_missing else config


def knob_choices(layout, num_layers, micro_batch_sizes=(1, 2, 4, 8), recomputes=None, zero_stages=None):
    """Every (micro-batch size, recompute, ZeRO stage, interleaving) the record allows: its own where stated (ZeRO
    stages, recomputation modes and interleaving degrees: those its framework offers, layout.zero_stages and
    framework_offers, for its num_layers layers; with Megatron-LM's even stages, every v dividing the layers per
    stage, as --num-layers-per-virtual-pipeline-stage allows, where the search takes 2 to 4)."""
    offers = framework_offers(layout)
    zero_stages = layout.zero_stages if zero_stages is None else zero_stages
    recomputes = offers["recomputes"] if recomputes is None else recomputes
    interleavings = {v for _, v in offers["schedules"]}
    if offers["even_stages"] and "interleaved" in {s for s, _ in offers["schedules"]}:  # any v dividing L / p
        interleavings |= set(pl.divisors(num_layers // layout.pp))
    interleavings = [v for v in sorted(interleavings) if runs_split(layout, num_layers, layout.pp, v)]
    def stated(value, choices):
        return (value,) if value is not None else tuple(choices)
    return [(m, r, z, v) for m in stated(layout.micro_batch_size, micro_batch_sizes)
            for r in stated(layout.recompute, recomputes) for z in stated(layout.zero_stage, zero_stages)
            for v in stated(layout.virtual_stages, interleavings)]


def lacking_fields(run):
    """What the record holds that this planner's Model, Cluster and Config have no field for (at the record's
    stated values: a tied output layer, interleaving, uneven stages, float8...)."""
    lacks = set(planner_model(run.shape, with_missing=True)[1]) | set(planner_cluster(run, with_missing=True)[1])
    for mbs, recompute, zero, v in knob_choices(run.layout, run.shape.num_layers):
        lacks |= set(planner_config(run.layout, mbs, recompute, zero, v, with_missing=True)[1])
    return sorted(lacks)


def estimate_published(run):
    """The planner's row for the published layout, its unstated knobs at the planner's best: the fastest that fits,
    or the smallest in memory if none fits. A ValueError (the planner's message) if it can express none of them."""
    model, cluster, rows = planner_model(run.shape), planner_cluster(run), []
    for mbs, recompute, zero, v in knob_choices(run.layout, run.shape.num_layers):
        try:
            rows.append(pl.estimate(model, cluster, run.layout.global_batch,
                                    planner_config(run.layout, mbs, recompute, zero, v)))
        except ValueError as error:
            refusal = error
    if not rows:
        raise refusal
    fitting = [r for r in rows if r["fits"]]
    return min(fitting, key=lambda r: r["step_s"]) if fitting else min(rows, key=lambda r: r["memory_gb"])


LAYOUT_AXES = ("dp", "tp", "pp", "cp", "ep")


def layout_rank(run, offered=None, **choices):
    """(rank, gap, best): where the published split (dp, tp, pp, cp, ep) stands among the planner's fitting splits,
    each at its best knobs (1: the planner's first choice), its best step over the planner's best, and the planner's
    best row; (None, None, best) if the planner lists no fitting configuration of that split. offered: {column:
    allowed values}, the search kept to what the run's framework offered (Reason.offered)."""
    rows = search_plan(run, **choices)
    return _rank(run, rows, offered)


def search_plan(run, **choices):
    """The planner's plan for the run's model, cluster and batch, every layout priced with the run's framework
    settings (framework_settings) and given only the ZeRO stages, recomputation modes and pipeline schedules that
    framework offers (Layout.zero_stages, framework_offers; ZeRO-1 standing for 0 and 2 where offered, as the
    planner's search takes them, ZeRO-1 being as fast as 0 in less memory), and only the splits of layers over
    stages it could run (runs_split: Megatron-LM's are even). The knobs the run states are searched
    too, where the planner's choices lack them (Llama 3's ZeRO-2, with less memory than ZeRO-1; torchtitan's
    selective_op recomputation and local batch of 16): the published split is ranked at its own knobs or better."""
    layout, offered, offers = run.layout, run.layout.zero_stages, framework_offers(run.layout)
    searched = {"zero_stages": tuple(z for z in (1, 3) if z in offered) or (max(offered),),
                "recomputes": offers["recomputes"], "micro_batch_sizes": (1, 2, 4, 8)}
    choices.setdefault("schedules", offers["schedules"])
    zero = 1 if layout.zero_stage == 0 and 1 in searched["zero_stages"] else layout.zero_stage  # 1 as fast, smaller
    for name, stated in (("zero_stages", zero), ("recomputes", layout.recompute),
                         ("micro_batch_sizes", layout.micro_batch_size)):
        if name not in choices:
            choices[name] = searched[name] + ((stated,) if stated is not None and stated not in searched[name] else ())
    rows = pl.plan(planner_model(run.shape), planner_cluster(run), run.layout.global_batch,
                   settings=framework_settings(run.layout), **choices)
    return [r for r in rows if runs_split(layout, run.shape.num_layers, r["pp"], r["v"], r["zero_stage"])]


def _rank(run, rows, offered=None):
    rows = [r for r in rows if all(r[k] in allowed for k, allowed in (offered or {}).items())]
    best = {}
    for row in rows:  # fastest first: the first row of a split is its best
        best.setdefault(tuple(row[a] for a in LAYOUT_AXES), row["step_s"])
    published = best.get(tuple(getattr(run.layout, a) for a in LAYOUT_AXES))
    if published is None:
        return None, None, rows[0] if rows else None
    return 1 + sum(step < published for step in best.values()), published / min(best.values()), rows[0]


def published_row(run, rows):
    """The plan's row of the published split at its best knobs (the fastest of that split), or None."""
    split = tuple(getattr(run.layout, a) for a in LAYOUT_AXES)
    return next((r for r in rows if tuple(r[a] for a in LAYOUT_AXES) == split), None)


TERMS = ("compute_s", "tp_s", "cp_s", "ep_s", "pp_s", "dp_s", "bubble_s", "optimizer_s", "step_s")


def _knobs(row):
    split = " ".join(f"{a}{row[a]}" for a in LAYOUT_AXES)
    schedule = "" if row["pp"] == 1 else f"interleaved v{row['v']}" if row["v"] > 1 else row["schedule"]
    return (f"{split} mbs{row['micro_batch_size']} {schedule} {row['recompute']} zero{row['zero_stage']} "
            f"{row['memory_gb']:.0f} GB").replace("  ", " ")


def format_layout_terms(rows, within=0.10):
    """For each searched run whose published split is more than `within` behind the planner's best: both rows'
    knobs and memory, and their step times term by term (seconds per step: compute with its recomputation, each
    group's exposed communication, the bubble, the optimizer), published minus best: the term that makes the
    alternative cheaper stands out."""
    heads = [t[:-2] for t in TERMS]
    lines = []
    for row in rows:
        published, best = row.get("published"), row.get("best")
        if not row.get("searched") or published is None or row["gap"] <= 1 + within:
            continue
        lines.append(f"{row['name']} (gap {row['gap']:.2f}): published {_knobs(published)}; best {_knobs(best)}")
        lines.append("  " + " ".join(f"{h:>9}" for h in heads))
        lines.append("  " + " ".join(f"{published[t] - best[t]:+9.2f}" for t in TERMS))
    return "\n".join(lines)


# ---------------------------------------------------------------- validation

def validate(runs, search=True):
    """A row per run: reported and predicted step seconds and memory (GB), the ratios of predicted to reported
    throughput and memory, whether the planner fits it (and whether the source says it ran out of memory), the
    published split's rank and gap in the planner's search, with the search's best row and the published split's
    ('best', 'published': format_layout_terms; search=False skips the search: the whole table in under a second),
    the knobs the planner chose where the source is silent, and what the record holds that the planner lacks. A run
    the planner refuses, or cannot express, has the reason in 'error' and is not compared."""
    rows = []
    for run in runs:
        row = {"name": run.name, "reported_s": reported_step_seconds(run), "predicted_s": None, "ratio": None,
               "reported_gb": run.memory_bytes / 1e9 if run.memory_bytes else None, "predicted_gb": None,
               "memory_ratio": None, "fits": None, "oom": run.oom, "rank": None, "gap": None,
               "lacks": lacking_fields(run), "error": run.unmodelled, "disagreement": run.disagreement}
        if not run.unmodelled:
            try:
                estimate = estimate_published(run)
            except ValueError as error:
                row["error"] = str(error)
            else:
                row |= {"predicted_s": estimate["step_s"], "predicted_gb": estimate["memory_gb"],
                        "fits": estimate["fits"], "micro_batch_size": estimate["micro_batch_size"],
                        "recompute": estimate["recompute"], "zero_stage": estimate["zero_stage"]}
                if row["reported_s"] is not None:
                    row["ratio"] = row["reported_s"] / row["predicted_s"]  # predicted throughput / reported
                if row["reported_gb"] is not None:
                    row["memory_ratio"] = row["predicted_gb"] / row["reported_gb"]
                if search and not run.oom:
                    plan = search_plan(run)
                    row["rank"], row["gap"], row["best"] = _rank(run, plan)
                    row["published"] = published_row(run, plan)
                    reason = LAYOUT_REASONS.get(run.name)
                    if reason and reason.offered:  # the gap among what the run's framework offered
                        row["offered_gap"] = _rank(run, plan, reason.offered)[1]
                    row["searched"] = True
        rows.append(row)
    return rows


def _offered_gap(row):
    return row["offered_gap"] if row.get("offered_gap") is not None else row["gap"]


def layout_was_chosen(name):
    """Whether the run's layout was a choice made to train fast, not a benchmark's condition (Reason.benchmark)."""
    reason = _family_reason(name)
    return reason is None or not reason.benchmark


def agreement(rows, throughput_within=0.15, layout_within=0.10):
    """The shares the targets of issue 41 are stated in, over the rows each applies to (None where none does):
    throughput within 15%; published split within 10% of the planner's best (and, layout_offered, of its best among
    what the run's framework offered, where LAYOUT_REASONS says; layout_chosen, over the runs whose layout was a
    choice, not a benchmark's condition: Reason.benchmark); trained layouts that fit; reported out-of-memory layouts
    predicted out of memory."""
    def share(flags):
        flags = list(flags)
        return sum(flags) / len(flags) if flags else None
    compared = [r for r in rows if r["fits"] is not None]
    return {"throughput": share(abs(r["ratio"] - 1) <= throughput_within for r in compared if r["ratio"]),
            "layout": share(r["gap"] is not None and r["gap"] <= 1 + layout_within for r in rows if r.get("searched")),
            "layout_offered": share(_offered_gap(r) is not None and _offered_gap(r) <= 1 + layout_within
                                    for r in rows if r.get("searched")),
            "layout_chosen": share(r["gap"] is not None and r["gap"] <= 1 + layout_within
                                   for r in rows if r.get("searched") and layout_was_chosen(r["name"])),
            "trained_fit": share(r["fits"] for r in compared if not r["oom"]),
            "oom_predicted": share(not r["fits"] for r in compared if r["oom"]),
            "expressed": share(r["fits"] is not None for r in rows)}


VALIDATION_COLUMNS = ("name", "reported_s", "predicted_s", "ratio", "reported_gb", "predicted_gb", "memory_ratio",
                      "fits", "oom", "rank", "gap")


def format_validation(rows, columns=VALIDATION_COLUMNS):
    """The validation table, fixed width (the planner's format_rows), '-' where nothing is known; then each refused
    or unmodelled run with the reason, and what the records hold that the planner cannot take."""
    shown = [{c: "-" if r.get(c) is None else r[c] for c in columns} for r in rows]
    lines = [pl.format_rows(shown, columns)]
    lines += [f"{r['name']}: not compared: {r['error']}" for r in rows if r["error"]]
    lacks = sorted({field for r in rows for field in r["lacks"]})
    if lacks:
        lines.append(f"the planner has no field for: {', '.join(lacks)}")
    return "\n".join(lines)


def disagrees(row, within=0.15):
    """Whether the planner and the run disagree: throughput off by more than `within`, a layout that trained called
    out of memory, or one reported out of memory called a fit."""
    off = row["ratio"] is not None and abs(row["ratio"] - 1) > within
    return off or (row["fits"] is False and not row["oom"]) or (row["fits"] is True and row["oom"])


def format_disagreements(rows, within=0.15):
    """One line per run the planner disagrees with: its ratio (and fit), then why, from its record."""
    lines = []
    for row in (r for r in rows if disagrees(r, within)):
        ratio = f"ratio {row['ratio']:.2f}" if row["ratio"] is not None else "no throughput"
        fit = ", predicted out of memory" if row["fits"] is False and not row["oom"] else ""
        lines.append(f"{row['name']} ({ratio}{fit}): {row['disagreement'] or 'no cause found yet.'}")
    return "\n".join(lines)


def format_by_source(rows, within=0.15):
    """One line per source (a run's name starts with its source's tag): the runs compared, the predicted-over-
    reported throughput (median and range), how many within `within`, the memory ratio's range, and the trained
    layouts the planner calls out of memory."""
    by_source = {}
    for row in rows:
        by_source.setdefault(row["name"].split()[0], []).append(row)
    lines = [f"{'source':>14} {'runs':>4} {'compared':>8} {'median':>6} {'range':>11} {'within':>6} "
             f"{'memory':>11} {'trained, predicted OOM':>22}"]
    for source, group in by_source.items():
        ratios = sorted(r["ratio"] for r in group if r["ratio"])
        memory = sorted(r["memory_ratio"] for r in group if r["memory_ratio"])
        lost = sum(r["fits"] is False and not r["oom"] for r in group)
        median = f"{ratios[len(ratios) // 2]:.2f}" if ratios else "-"
        spread = f"{ratios[0]:.2f}-{ratios[-1]:.2f}" if ratios else "-"
        near = sum(abs(r - 1) <= within for r in ratios)
        mem = f"{memory[0]:.2f}-{memory[-1]:.2f}" if memory else "-"
        lines.append(f"{source:>14} {len(group):>4} {len(ratios):>8} {median:>6} {spread:>11} {near:>6} {mem:>11} "
                     f"{lost:>22}")
    return "\n".join(lines)


# ---------------------------------------------------------------- the runs
#
# Each family's rows are the source's table rows as printed; what a row leaves unstated is None in its Layout, and
# what a family took from elsewhere is in its `assumptions`.

NARAYANAN = ("Narayanan et al. 2021, 'Efficient Large-Scale Language Model Training on GPU Clusters Using "
             "Megatron-LM' (arXiv 2104.04473)")
SELENE = 200  # Gb/s per GPU: "eight NVIDIA Mellanox 200Gbps HDR Infiniband HCAs" per 8-GPU node (MT-NLG, section 2)


# Megatron-LM in bf16 accumulates and reduces gradients in fp32: megatron/training/arguments.py, "bfloat16 requires
# gradient accumulation and all-reduce to be done in fp32" (accumulate_allreduce_grads_in_fp32 forced on, unless
# --grad-reduce-in-bf16, which neither the README's table nor Nemotron-4's report names): 4 bytes per gradient,
# in memory and on the data axis.
MEGATRON_BF16 = ("Megatron-LM in bf16 keeps and reduces gradients in fp32 (megatron/training/arguments.py forces "
                 "accumulate_allreduce_grads_in_fp32 for bf16): 4 bytes per gradient.")


def gpt(name, heads, dim, layers, seq_len=2048, vocab_size=51200, tied=True, gpt3=True):
    """Megatron's GPT: a 4h GELU MLP, learned positions, tied embeddings; sequence 2048, vocabulary 51,200 (all of
    Narayanan et al. 2021's and Korthikanti et al. 2022's models). gpt3=False: Megatron-Core's of 2024, whose
    attention is flash attention (Transformer Engine), trained in bf16 (gradients in fp32: MEGATRON_BF16)."""
    return Shape(layers, dim, heads, 4 * dim, vocab_size, seq_len, tied=tied, gpt3=gpt3, name=name,
                 grad_bytes=2 if gpt3 else 4)


# Megatron-LM before its distributed optimizer (--use-distributed-optimizer, later in 2022) sharded no optimizer
# state, gradient or weight: ZeRO 0 only, so that no alternative is given ZeRO-1's sharded optimizer states, which
# its authors did not have; ZeRO-3 was DeepSpeed's, the paper's baseline.
MEGATRON_LM_2021_2022_ZERO = (0,)
# Megatron-LM of 2021 without recomputation held at least 1.27 times the counted activations in flight: Figure 17
# (FIGURE_17; memory.activation_bytes, Config.uncounted_activations). The bound, rounded up.
UNCOUNTED_2021 = 0.3
MEGATRON_2021_MEMORY = ("Megatron-LM of 2021 kept each in-flight stage output whole until its backward "
                        "(deallocate_output_tensor came in 2022-01) and, without recomputation, held at least 1.27 "
                        "times the counted activations (Figure 17: 16 micro-batches of t 8 x p 16 did not fit, 8 did): "
                        "keep_stage_outputs, uncounted_activations 0.3, for every layout of these runs' searches.")

def _narayanan_table1():
    # (model, attention heads, hidden, layers, tensor-parallel, pipeline-parallel, GPUs, batch, TFLOP/s per GPU)
    rows = [("1.7B", 24, 2304, 24, 1, 1, 32, 512, 137), ("3.6B", 32, 3072, 30, 2, 1, 64, 512, 138),
            ("7.5B", 32, 4096, 36, 4, 1, 128, 512, 142), ("18.4B", 48, 6144, 40, 8, 1, 256, 1024, 135),
            ("39.1B", 64, 8192, 48, 8, 2, 512, 1536, 138), ("76.1B", 80, 10240, 60, 8, 4, 1024, 1792, 140),
            ("145.6B", 96, 12288, 80, 8, 8, 1536, 2304, 148), ("310.1B", 128, 16384, 96, 8, 16, 1920, 2160, 155),
            ("529.6B", 128, 20480, 105, 8, 35, 2520, 2520, 163), ("1008.0B", 160, 25600, 128, 8, 64, 3072, 3072, 163)]
    return [Run(f"megatron21 {name}", f"{NARAYANAN}, Table 1, row {name} (also Megatron-LM's README of 2021-04, "
                                      "images/cases_april2021.png, commit 50a4b5fa02)",
                gpt(name, heads, dim, layers), "A100-80GB", gpus, SELENE,
                Layout(dp=gpus // (tp * pp), tp=tp, pp=pp, global_batch=batch, recompute="full", zero_stage=0,
                       virtual_stages=None, sequence_parallel=False, zero_stages=MEGATRON_LM_2021_2022_ZERO,
                       keep_stage_outputs=True, uncounted_activations=UNCOUNTED_2021, framework="Megatron-LM 2021"),
                tflops, flops="narayanan2021",
                assumptions=("The micro-batch size and the interleaving of each row are not printed: left to the "
                             "planner.", "The README's image prints the model-parallel size t x p; the split into "
                             "t and p and the attention heads are the paper's Table 1 columns.",
                             "Sequence parallelism came after this paper (Korthikanti et al. 2022): off, so norms, "
                             "dropout and residuals run whole on every tensor-parallel rank.", MEGATRON_2021_MEMORY))
            for name, heads, dim, layers, tp, pp, gpus, batch, tflops in rows]


# Narayanan et al. 2021, Figure 17 (section 5.8), as NVIDIA/Megatron-LM's examples/sc21/run_figure_17.sh (2021-08)
# ran it: the 145.6B model (80 layers, hidden 12288, 96 heads) on 128 A100s (16 nodes), t 8 x p 16, micro-batch 1,
# global batches 1 to 256, with and without --checkpoint-activations. The paper (section 5.8, quoted from the paper as
# read before this session: its text is not in the stored sources, the script is): recomputation "is needed to
# support larger batch sizes", and with it large batches run "up to 2x" faster "than the best throughput achieved
# without activation recomputation (for a smaller batch size) due to a smaller pipeline bubble". 1F1B holds min(p, m)
# micro-batches, as many from batch 16 on: had batch 16 fit without recomputation, every larger one would have, with
# less compute than with it. So 16 micro-batches in flight did not fit; and 2x is the bubble's (m + p - 1) / m of
# batch 256 with recomputation over batch 8 without (1.37 over batch 16): batch 8 was the largest that ran.
FIGURE_17 = ("Narayanan et al. 2021, Figure 17 and section 5.8; NVIDIA/Megatron-LM examples/sc21/run_figure_17.sh "
             "at 6985e58938 (2021-08): TP 8, PP 16, micro-batch 1, 80 layers, hidden 12288, 96 heads, 16 nodes")


def figure_17_run(global_batch, recompute):
    """Figure 17's run at a global batch, without or with full recomputation (Megatron-LM of 2021's settings)."""
    return Run(f"megatron21 Figure 17 145.6B {global_batch} {recompute}", FIGURE_17, gpt("145.6B", 96, 12288, 80),
               "A100-80GB", 128, SELENE,
               Layout(dp=1, tp=8, pp=16, global_batch=global_batch, micro_batch_size=1, recompute=recompute,
                      zero_stage=0, sequence_parallel=False, keep_stage_outputs=True,
                      uncounted_activations=UNCOUNTED_2021, framework="Megatron-LM 2021"),
               None)


TABLE2_IMAGE = "the table and caption as printed: cli99/llm-analysis, figures/megatron-lm-2nd-table-2.png"


def _narayanan_table2():
    # (scheme, model, GPUs, batch, micro-batch, TFLOP/s per GPU); the 175B: 96 heads, 12288, 96 layers; the 530B:
    # 128, 20480, 105. Model-parallel size 96 is t 8 x p 12 (96 layers), 280 is t 8 x p 35 (105 layers).
    shapes = {"174.6B": gpt("174.6B", 96, 12288, 96), "529.6B": gpt("529.6B", 128, 20480, 105)}
    splits = {("ZeRO-3", "174.6B"): (1, 1), ("ZeRO-3", "529.6B"): (1, 1), ("PTD-P", "174.6B"): (8, 12),
              ("PTD-P", "529.6B"): (8, 35)}
    rows = [("ZeRO-3", "174.6B", 384, 1536, 4, 144), ("ZeRO-3", "174.6B", 768, 1536, 2, 88),
            ("ZeRO-3", "174.6B", 1536, 1536, 1, 44), ("ZeRO-3", "529.6B", 640, 2560, 4, 138),
            ("ZeRO-3", "529.6B", 1120, 2240, 2, 98), ("ZeRO-3", "529.6B", 2240, 2240, 1, 48),
            ("PTD-P", "174.6B", 384, 1536, 1, 153), ("PTD-P", "174.6B", 768, 1536, 1, 149),
            ("PTD-P", "174.6B", 1536, 1536, 1, 141), ("PTD-P", "529.6B", 560, 2240, 1, 171),
            ("PTD-P", "529.6B", 1120, 2240, 1, 167), ("PTD-P", "529.6B", 2240, 2240, 1, 159)]
    runs = []
    for scheme, model, gpus, batch, mbs, tflops in rows:
        tp, pp = splits[scheme, model]
        runs.append(Run(f"megatron21 {scheme} {model} {gpus}", f"{NARAYANAN}, Table 2, {scheme} {model} on {gpus} GPUs "
                        f"({TABLE2_IMAGE})",
                        shapes[model], "A100-80GB", gpus, SELENE,
                        Layout(dp=gpus // (tp * pp), tp=tp, pp=pp, global_batch=batch, micro_batch_size=mbs,
                               recompute="full", zero_stage=3 if scheme == "ZeRO-3" else 0, virtual_stages=None,
                               sequence_parallel=False, prefetch=scheme != "ZeRO-3",
                               gather_copies=scheme == "ZeRO-3",
                               zero_stages=(0, 1, 2, 3) if scheme == "ZeRO-3" else MEGATRON_LM_2021_2022_ZERO,
                               keep_stage_outputs=scheme == "PTD-P",
                               uncounted_activations=UNCOUNTED_2021 if scheme == "PTD-P" else 0.0,
                               framework="DeepSpeed 2021" if scheme == "ZeRO-3" else "Megatron-LM 2021"),
                        tflops, flops="narayanan2021",
                        assumptions=("The paper counts FLOPs with recomputation for both schemes; full "
                                     "recomputation assumed for both.",
                                     "Sequence parallelism came after this paper (Korthikanti et al. 2022): off.",
                                     *((MEGATRON_2021_MEMORY,) if scheme == "PTD-P" else ()),
                                     "ZeRO-3 is DeepSpeed's of early 2021, whose parameter prefetch did not work: "
                                     "'the forward phase is largely bounded by the parameter gathering' "
                                     "(deepspeedai/DeepSpeed issue 1174, June 2021; the tracing fix, PR 1170, "
                                     "landed after the paper): gathers on demand, exposed (prefetch=False).",
                                     "DeepSpeed 0.3's ZeRO-3 (v0.3.15, April 2021) gathers each weight tensor apart, "
                                     "after a torch.cuda.synchronize(), through PyTorch's list all_gather, which "
                                     "copies the n ranks' shards out one by one (gather_copies); it holds one "
                                     "weight tensor whole at a time, and whole gradients until their list "
                                     "reduce_scatter's turn (memory.deepspeed03_buffer_bytes): the 530B on 640 "
                                     "GPUs at 84.4 GB of 85.9, its neighbour on 560 at 86.4 (out of memory).")))
    # Table 2's caption: "The 530-billion-parameter GPT model did not fit on 560 GPUs when using a microbatch size of
    # 4 with ZeRO-3, so we increased the number of GPUs used to 640 and global batch size to 2560"
    runs.append(Run("megatron21 ZeRO-3 529.6B 560 (OOM)", f"{NARAYANAN}, Table 2's caption ({TABLE2_IMAGE})",
                    shapes["529.6B"], "A100-80GB", 560, SELENE,
                    Layout(dp=560, global_batch=2240, micro_batch_size=4, recompute="full", zero_stage=3,
                           prefetch=False, gather_copies=True, framework="DeepSpeed 2021"),
                    None, oom=True,
                    assumptions=("The batch of the run that did not fit is not printed: 2240, its PTD-P "
                                 "neighbour's on 560 GPUs.",
                                 "Predicted at 86.4 GB of 85.9, its neighbour on 640 GPUs at 84.4: the 2.0 GB of "
                                 "optimizer shards between them is less than the planner's assumed fragmentation "
                                 "(5%, 4 GB here), so which side each falls on rests on that assumption.")))
    return runs


def _megatron_readme_gpt3():
    # Megatron-LM's README, 'GPT-3 Example' (in it since 2021 and still): "With full global batch size of 1536 on 1024
    # A100 GPUs, each iteration takes around 32 seconds resulting in 138 teraFLOPs per GPU"; the script it names, as
    # of 2021 (examples/pretrain_gpt3_175B.sh at 090e141cc4): tensor 8, pipeline 16, micro-batch 1, batch 1536,
    # --fp16, --checkpoint-activations, no --num-layers-per-virtual-pipeline-stage (1F1B without interleaving)
    return [Run("megatron21 175B README 1024", "NVIDIA/Megatron-LM, README.md, 'GPT-3 Example', and "
                "examples/pretrain_gpt3_175B.sh at 090e141cc4 (2021), the script it names",
                gpt("175B", 96, 12288, 96), "A100-80GB", 1024, SELENE,
                Layout(dp=8, tp=8, pp=16, global_batch=1536, micro_batch_size=1, recompute="full", zero_stage=0,
                       virtual_stages=1, sequence_parallel=False, zero_stages=MEGATRON_LM_2021_2022_ZERO,
                       keep_stage_outputs=True, uncounted_activations=UNCOUNTED_2021),
                138, flops="narayanan2021",
                assumptions=("138 TFLOP/s per GPU is Narayanan et al.'s formula (recomputation counted) at 32 s: "
                             "the README's two numbers agree with it.",
                             "Selene's DGX A100s (80 GB, eight 200 Gb/s HCAs per node), as Narayanan et al. 2021 "
                             "ran on; the README does not name the cluster.",
                             "Megatron-LM of 2021: no sequence parallelism, no distributed optimizer.",
                             MEGATRON_2021_MEMORY))]


def _korthikanti():
    # Table 3 (model, heads, hidden, layers, tensor-parallel, pipeline-parallel, GPUs, global batch, micro-batch,
    # interleaving: None where not printed) and Table 5's end-to-end iteration times in seconds: full recomputation,
    # then the present work (sequence parallelism + selective recomputation). Table 4 is the 22B's per-layer timing.
    rows = [("22B", 64, 6144, 48, 8, 1, 8, 4, 4, 1, 1.42, 1.10),
            ("175B", 96, 12288, 96, 8, 8, 64, 64, 1, 3, 18.13, 13.75),
            ("530B", 128, 20480, 105, 8, 35, 280, 280, 1, 3, 49.05, 37.83),
            ("1T", 160, 25600, 128, 8, 64, 512, 512, 1, None, 94.42, 71.49)]
    source = ("Korthikanti et al. 2022, 'Reducing Activation Recomputation in Large Transformer Models' "
              "(arXiv 2205.05198), Tables 3 and 5")
    return [Run(f"korthikanti22 {name} {recompute}", f"{source}, row {name}, "
                f"{'full recompute' if recompute == 'full' else 'present work'}; its MFU and HFU columns also in "
                "NVIDIA/Megatron-LM's README at 2e90a342f5 (2022-05-19, 'data parallel size of one')",
                gpt(name, heads, dim, layers), "A100-80GB", gpus, SELENE,
                Layout(dp=gpus // (tp * pp), tp=tp, pp=pp, global_batch=batch, micro_batch_size=mbs,
                       recompute=recompute, zero_stage=0, virtual_stages=v, zero_stages=MEGATRON_LM_2021_2022_ZERO,
                       framework="Megatron-LM 2022"),
                seconds, unit="step_seconds", flops="megatron_model",
                assumptions=("Tables 3 and 5 as transcribed in a stored structured summary of the paper (with its "
                             "micro-batch column and 'interleaving stages m=3 for 175B and 530B'); the 1T's "
                             "interleaving is not printed. The tests check the times against Table 5's MFU and "
                             "HFU columns, which Megatron-LM's README prints too.",
                             "'Present work' is sequence parallelism with selective recomputation: recorded as "
                             "'selective'; whether the full-recompute rows used sequence parallelism is not said."))
            for name, heads, dim, layers, tp, pp, gpus, batch, mbs, v, full, selective in rows
            for recompute, seconds in (("full", full), ("selective", selective))]


def _mt_nlg():
    # (DGX A100 nodes, seconds per iteration, TFLOP/s per GPU): batch 1920, 8-way tensor x 35-way pipeline
    rows = [(280, 60.1, 126), (350, 50.2, 121), (420, 44.4, 113)]
    source = ("Smith et al. 2022, 'Using DeepSpeed and Megatron to Train Megatron-Turing NLG 530B' (arXiv 2201.11990), "
              "section 2.4: iteration time and TFLOP/s at {} nodes, as cli99/llm-analysis quotes them "
              "(examples/megatron-turing-nlg/README.md); section 2.2: 'each 530 billion parameter model replica spans "
              "280 NVIDIA A100 GPUs, with 8-way tensor-slicing within a node and 35-way pipeline parallelism'")
    return [Run(f"mt-nlg 530B {nodes * 8}", source.format(nodes), gpt("530B", 128, 20480, 105), "A100-80GB",
                nodes * 8, SELENE,
                Layout(dp=nodes * 8 // 280, tp=8, pp=35, global_batch=1920, recompute="full", virtual_stages=1,
                       sequence_parallel=False, pp_whole_grads=True, pp_blocking=True, zero_stages=(0, 1),
                       framework="DeepSpeed 2021"),
                seconds, unit="step_seconds", flops="narayanan2021",
                assumptions=("Vocabulary 51,200 (GPT-2's 50,257 padded as Megatron pads it): the printed TFLOP/s "
                             "follow from the times with Narayanan et al.'s formula at that size.",
                             "Full recomputation: the printed TFLOP/s count it (4 passes); micro-batch and ZeRO "
                             "stage not printed.",
                             "DeepSpeed's pipeline engine of 2021 (section 2.2: 'DeepSpeed and Megatron'): plain "
                             "1F1B, no interleaving; each stage's output split over the tensor-parallel ranks "
                             "(is_pipe_partitioned, a PartitionedTensor) but its gradient sent back whole by each "
                             "(is_grad_partitioned False until v0.6.0: deepspeed/runtime/pipe/engine.py at v0.5.0), "
                             "which takes ZeRO 0 or 1 ('ZeRO-2 and ZeRO-3 are incompatible with pipeline "
                             "parallelism', its assertion); no sequence parallelism (2021). Its TrainSchedule "
                             "receives and sends in turn, each blocking until the neighbour's pair posts: two "
                             "hand-offs in series per pass (pp_blocking; deepspeed/runtime/pipe/schedule.py)."),
                disagreement=("Ran 1.23-1.28x slower than the planner predicts for its split, with DeepSpeed's "
                              "pipeline engine modelled (1F1B without interleaving, activations split over the "
                              "tensor-parallel ranks and gradients sent whole, blocking sends and receives in turn), "
                              "at the planner's best micro-batch of 1 (240, 192, 160 per step). The time missing per "
                              "step (11.2, 9.8, 9.7 s) stays nearly level while the compute falls by a third (37.8 to "
                              "25.2 s): a second bubble's size (6.0 s). At micro-batch 2, which the paper does not "
                              "print, the rows come out at 1.10, 1.09, 1.10, level with Narayanan et al.'s PTD-P rows "
                              "of the same model, split and cluster (1.06-1.09); the planner has no cause of its own."))
            for nodes, seconds, _ in rows]


def _nemotron4():
    # Table 2: (data-parallel, GPUs, batch, seconds per iteration, MFU %): tensor 8, pipeline 12, interleaved
    rows = [(16, 1536, 768, 10.3, 42.4), (32, 3072, 1536, 10.3, 42.3), (64, 6144, 2304, 8.0, 41.0)]
    shape = Shape(96, 18432, 96, 73728, 256000, 4096, num_kv_heads=8, mlp="relu2", name="Nemotron-4 340B",
                  grad_bytes=4)
    return [Run(f"nemotron4 340B {gpus}", f"NVIDIA 2024, 'Nemotron-4 340B Technical Report', Table 2, row DP {dp}",
                shape, "H100-80GB", gpus, 400,
                Layout(dp=dp, tp=8, pp=12, global_batch=batch, zero_stage=1, virtual_stages=None,
                       framework="Megatron-LM 2024"),
                seconds, unit="step_seconds", flops="megatron_model",
                assumptions=("Table 2 and section 3.1 ('8-way tensor parallelism, 12-way pipeline parallelism with "
                             "interleaving', a distributed optimizer sharding the optimizer state over the data-"
                             "parallel replicas, eight 400 Gbps HCAs per 8-GPU node) as transcribed in a stored copy "
                             "of the report; the 6,144-GPU row (8.0 s at batch 2304) is also quoted by Epoch AI's "
                             "notes (aiportalx.com/nvidia/nemotron-4-340b). The tests check the times against Table "
                             "2's MFU column.",
                             "The interleaving degree, micro-batch and recomputation are not printed: left to the "
                             "planner.", "bf16 assumed (Megatron-LM on H100s without FP8). " + MEGATRON_BF16))
            for dp, gpus, batch, seconds, _ in rows]


LLAMA3_405B = Shape(126, 16384, 128, 53248, 128256, 8192, num_kv_heads=8, mlp="swiglu", name="Llama 3 405B")


LLAMA3_REDUCE = ("Meta accumulates a step's gradients in FP32 and reduce-scatters them once (section 3.3.2); the "
                 "planner's ZeRO-2 reduce-scatters every micro-batch's 4-byte gradients, exposed on the network "
                 "(with 2-byte gradients it predicts 0.84 and 1.12 of the 8K rows), and its ZeRO-1, which reduces "
                 "once, holds whole FP32 gradients beside the activations it counts, more than fit. Each piece's "
                 "gradients reduced once a round of p micro-batches, asynchronously (FSDP 'asynchronously ... "
                 "reducing gradients'), was tried: 0.87 on 8,192 GPUs (full recomputation), 1.18 on 16,384 (none).")
LLAMA3_SCHEDULE = (" At 32 micro-batches per step, V = 8 and no recomputation, rank 1 holds 2 (p - 2) + (v - 1) p + 1 "
                   "= 141 one-layer pieces at its peak (Korthikanti et al. 2022's L (1 + (p - 1) / (p v)) for "
                   "interleaving), 75.1 GB of activations at 65 KB per token and layer (Q, K, V, the attention's "
                   "output, SwiGLU's three ffn-wide tensors and the norms' inputs over tp 8, with flash attention): "
                   "88.7 GB with the model states and the assumed 5% fragmentation and 2 GB runtime, 3.2 GB over 80 "
                   "GiB; the count without those two assumed margins (82.6 GB) fits, so the planner keeps full "
                   "recomputation here. Meta's own schedule (micro-batches per round chosen freely, stage inputs and "
                   "outputs freed once used, TORCH_NCCL_AVOID_RECORD_STREAMS) holds less than the planner counts, "
                   "by an amount the paper does not give.")


def _llama3():
    # Table 4: (GPUs, TP, CP, PP, DP, sequence, TFLOP/s per GPU); 16M tokens per batch
    rows = [(8192, 8, 1, 16, 64, 8192, 430), (16384, 8, 1, 16, 128, 8192, 400), (16384, 8, 16, 16, 8, 131072, 380)]
    return [Run(f"llama3 405B {gpus} cp{cp}", f"Llama Team 2024, 'The Llama 3 Herd of Models' (arXiv 2407.21783), "
                f"Table 4, row {gpus} GPUs, CP {cp}", dataclasses.replace(LLAMA3_405B, seq_len=seq, grad_bytes=4),
                "H100-80GB",
                gpus, 400,
                Layout(dp=dp, tp=tp, pp=pp, cp=cp, global_batch=2**24 // seq, zero_stage=2, virtual_stages=8,
                       stage_layers=(7,) + (8,) * 14 + (7,), framework="Llama 3"),
                tflops, flops="6p",
                assumptions=("The paper does not print its FLOP formula: torchtitan's 6 P + 12 l h s per token "
                             "assumed (at 131,072 tokens its attention term outweighs 6 P).",
                             "FSDP 'shards optimizer states and gradients' and keeps the weights after forward: "
                             "counted as ZeRO-2; the first and last stages hold one layer fewer (section 3.3.2).",
                             "Micro-batch and recomputation not printed; section 3.3.2 says the 8K runs needed no "
                             "activation checkpointing, with an interleaved schedule.",
                             "V = 8 pieces of one layer per rank: section 3.3.2 takes one layer from the first and "
                             "the last stage, and 'this means that the first model chunk on the first stage has only "
                             "the embedding, and the last model chunk on the last stage has only output projection "
                             "and loss calculation': a chunk is one layer's place, 128 places (126 layers, the "
                             "embedding, the head) on 16 ranks. The interleaving degree is not printed otherwise.",
                             "Section 3.3.2 accumulates gradients over micro-batches and reduce-scatters them in "
                             "FP32: 4-byte gradients.",
                             "Table 4 as arXiv 2407.21783v3 (p. 10) prints it, quoted in stored notes; v1's text "
                             "prints DP 4 in the CP row, which neither 16,384 GPUs nor 16M tokens per batch (16 "
                             "sequences per DP rank) allow."),
                disagreement=LLAMA3_REDUCE + (LLAMA3_SCHEDULE if gpus == 8192 else "") if cp == 1 else "")
            for gpus, tp, cp, pp, dp, seq, tflops in rows]


def llama3(size, seq_len=8192):
    return {"8B": Shape(32, 4096, 32, 14336, 128256, seq_len, num_kv_heads=8, mlp="swiglu", name="Llama 3.1 8B"),
            "70B": Shape(80, 8192, 64, 28672, 128256, seq_len, num_kv_heads=8, mlp="swiglu", name="Llama 3.1 70B"),
            "405B": dataclasses.replace(LLAMA3_405B, seq_len=seq_len)}[size]


# torchtitan's FSDP2 reduces gradients in fp32 by default (its job config's training.mixed_precision_reduce,
# "float32", into MixedPrecisionPolicy's reduce_dtype; parameters gathered in bf16): 4 bytes per reduced gradient.
TORCHTITAN_REDUCE = ("FSDP2 reduces gradients in fp32, torchtitan's default (training.mixed_precision_reduce "
                     "'float32'): 4-byte gradients.")

# torchtitan's loss is PyTorch's F.cross_entropy on the model's fp32 logits (Transformer.forward's
# self.output(h).float(), train.py's loss_fn at 9dec370): 12 bytes per logit at its backward's peak
# (memory.logits_bytes).
TORCHTITAN_LOSS = ("The loss is PyTorch's F.cross_entropy on fp32 logits (torchtitan/models/llama/model.py's "
                   "self.output(h).float(), train.py's loss_fn): in its backward the log-probabilities, their "
                   "gradient and the logits' gradient, 12 bytes per logit (Layout.logit_bytes), where Megatron's "
                   "fused cross entropy keeps Korthikanti et al.'s 4. With tensor parallel, on the vocabulary-sharded "
                   "logits under PyTorch's loss_parallel (torchtitan's ParallelDims: with tensor parallel unless "
                   "training.disable_loss_parallel, False by default), whose backward holds 16 "
                   "(Layout.loss_parallel; memory.LOSS_PARALLEL_BYTES).")


def titan(size, seq_len=8192):
    """A Llama 3.1 shape as torchtitan trains it: gradients reduced in fp32 (TORCHTITAN_REDUCE)."""
    return dataclasses.replace(llama3(size, seq_len), grad_bytes=4)


def _torchtitan():
    source = ("pytorch/torchtitan, benchmarks/llama3_h100_202412_torchtitan.md (torchtitan 9dec370, 2024-12-26), "
              "Table {}")
    common = ("Sequence 8192 unless printed: the train_configs of torchtitan 9dec370.",
              "FSDP reshards after forward (ZeRO-3) without a pipeline, and not with one: "
              "torchtitan/parallelisms/parallelize_llama.py at 9dec370. With one, PyTorch's pipelining also "
              "turns FSDP's gradient reduction off for every micro-batch but the last "
              "(torch/distributed/pipelining/stage.py, backward_maybe_with_nosync: set_requires_gradient_sync("
              "False), set_reshard_after_backward(False)), and FSDP2 then keeps each parameter's whole gradient, "
              "upcast to the fp32 reduce dtype, until that last reduce-scatter "
              "(torch/distributed/fsdp/_fully_shard/_fsdp_param.py, to_accumulated_grad_if_needed): whole bf16 "
              "weights, whole fp32 gradients, sharded optimizer states, one reduce-scatter and one all-gather a "
              "step, which is ZeRO-1 in memory and traffic. Counted as ZeRO-2 (gradients sharded), the planner "
              "put these rows at 0.52-0.63 of the reserved memory; as ZeRO-1, 0.77-0.93.",
              "Memory is the peak the caching allocator reserved (torchtitan logs max_reserved_gib), with "
              "expandable segments (run_llama_train.sh at 9dec370: PYTORCH_CUDA_ALLOC_CONF="
              "'expandable_segments:True'), which map memory as tensors need it: the tensors' peak, rounded to "
              "pages, without the CUDA context or NCCL's buffers. The planner's tensors (its total without its "
              "fragmentation and runtime margins) are 0.96-0.98 of it on the compiled FSDP rows at selective "
              "recomputation, 0.89-0.91 eager, and 0.71-0.90 on the full-recomputation rows (9-26 GB short; the 70B 2D "
              "rows 0.79 and 0.84 with loss_parallel's 16 bytes per logit, 0.68 and 0.73 before): what "
              "torchtitan's full recomputation holds beyond one recomputed layer has no term yet, and the "
              "count without it (the search's alternatives) is not contradicted.",
              TORCHTITAN_REDUCE, TORCHTITAN_LOSS)
    cp_rows = ("At 32K-64K tokens attention is most of the step, and the planner times flash attention through the "
               "roofline with the s x s scores as memory traffic: that matches the 128K-256K rows but not these. "
               "No one attention efficiency fits all four: each GPU holds 32K tokens, and each further 32K keys "
               "cost 137 us per token from 32K to 64K, then 270 and 223: attention's cost per key doubled once "
               "PyTorch's ring had 4 or 8 ranks. The causal half at FlashAttention-2's efficiency puts the 8K rows "
               "1.2-1.35x too fast (compute.py).")
    runs = []

    def add(table, label, size, gpus, layout, tps, gib, seq_len=8192, extra=(), disagreement=""):
        runs.append(Run(f"torchtitan {size} {label}", source.format(table) + f", row {label}",
                        titan(size, seq_len), "H100-96GB", gpus, 400,
                        dataclasses.replace(layout, logit_bytes=12, loss_parallel=True, framework="torchtitan 2024-12"),
                        tps, unit="tokens_per_s_per_gpu",
                        memory_bytes=gib * GIB, assumptions=common + extra, disagreement=disagreement))

    # Table 1 and 3: FSDP, local batch 2, selective (op) recomputation; bf16 eager, then torch.compile, then Float8
    for table, gpus, rows in ((1, 8, ((5762, 82.4), (6667, 77.0), (8532, 76.8))),
                              (3, 128, ((5605, 67.0), (6514, 62.0), (8380, 61.8)))):
        for (tps, gib), label, fused, float8 in zip(rows, ("", " + torch.compile", " + torch.compile + Float8"),
                                                    (False, True, True), (False, False, True)):
            add(table, f"FSDP {gpus}{label}", "8B", gpus,
                Layout(dp=gpus, global_batch=2 * gpus, micro_batch_size=2, recompute="selective_op", zero_stage=3,
                       fused=fused, float8=float8), tps, gib,
                extra=("Selective recomputation is torchtitan's 'op' policy (its train_configs at 9dec370: "
                       "selective_ac_option 'op'): the outputs of every other matrix product are kept.",))
    # Table 2: FSDP + CP, torch.compile + Float8, local batch 1, full recomputation
    for dp, cp, seq, tps, gib in ((8, 1, 32768, 3890, 83.9), (4, 2, 65536, 2540, 84.2), (2, 4, 131072, 1071, 84.0),
                                  (1, 8, 262144, 548, 84.5)):
        add(2, f"FSDP {dp} CP {cp}", "8B", 8, Layout(dp=dp, cp=cp, global_batch=dp, micro_batch_size=1,
                                                     recompute="full", zero_stage=3, float8=True), tps, gib, seq,
            disagreement=cp_rows)
    # Table 4: FSDP 32 x TP 8, local batch 16, full recomputation, torch.compile + Float8 (AsyncTP overlaps TP)
    for label, tps, gib in (("2D", 829, 71.9), ("2D + AsyncTP", 876, 67.6)):
        add(4, label, "70B", 256, Layout(dp=32, tp=8, global_batch=512, micro_batch_size=16, recompute="full",
                                         zero_stage=3, float8=True, tp_overlap="AsyncTP" in label), tps, gib)
    # Table 5: FSDP 8 x TP 8 x PP 8, local batch 32, full recomputation, torch.compile + Float8 + AsyncTP (tp_overlap,
    # as Tables 5 and 6's titles say)
    for label, v, tps, gib in (("1F1B", 1, 100, 82.5), ("Interleaved 1F1B", 2, 128, 72.7)):
        add(5, label, "405B", 512, Layout(dp=8, tp=8, pp=8, global_batch=256, micro_batch_size=4, recompute="full",
                                          zero_stage=1, virtual_stages=v, float8=True, tp_overlap=True), tps, gib,
            extra=("8 micro-batches (torchtitan's default: the pipeline degree), so 4 sequences each; interleaved "
                   "with 2 stages per rank.",))
    # Table 6: TP 8 x PP 8 (1F1B) with FSDP x CP, local batch 8, full recomputation, torch.compile + Float8 + AsyncTP
    for dp, cp, seq, tps, gib in ((8, 1, 32768, 76, 75.3), (4, 2, 65536, 47, 75.9), (2, 4, 131072, 31, 77.1),
                                  (1, 8, 262144, 16, 84.9)):
        add(6, f"FSDP {dp} CP {cp}", "405B", 512, Layout(dp=dp, tp=8, pp=8, cp=cp, global_batch=8 * dp,
                                                         micro_batch_size=1, recompute="full", zero_stage=1,
                                                         float8=True, tp_overlap=True), tps, gib, seq,
            extra=("8 micro-batches of 1 (torchtitan's default: the pipeline degree).",), disagreement=cp_rows)
    # docs/performance.md (2024-06): Llama 3 on 64 A100 80GB, FSDP, local batch 1
    older = ("pytorch/torchtitan, docs/performance.md at 041336434916 (2024-06), 'Llama 3 performance numbers', "
             "row {}")
    for size, recompute, wps in (("8B", "selective", 2973), ("70B", "full", 331)):
        runs.append(Run(f"torchtitan {size} A100 FSDP 64", older.format(f"{size} {recompute}"), titan(size),
                        "A100-80GB", 64, 200,
                        Layout(dp=64, global_batch=64, micro_batch_size=1, zero_stage=3, logit_bytes=12,
                               loss_parallel=True, framework="torchtitan 2024-06",
                               recompute="selective_op" if recompute == "selective" else recompute),
                        wps, unit="tokens_per_s_per_gpu",
                        assumptions=("Sequence 8192 (its train_configs); the A100 cluster's network is not "
                                     "described: 200 Gb/s per GPU assumed.", common[1], TORCHTITAN_REDUCE,
                                     TORCHTITAN_LOSS,
                                     "Whether torch.compile was on is not said: fused element-wise work assumed.")))
    return runs


def _megatron_core_h100():
    # Megatron-LM's README (commit 937571cfd4, 2024-07), images/model_table.png: (model, heads, hidden, layers,
    # tensor, pipeline, data, GPUs, batch, TFLOP/s per GPU); vocabulary 131,072, sequence 4096
    rows = [("1.7B", 16, 2048, 24, 1, 1, 48, 48, 192, 408.8), ("7.1B", 32, 4096, 30, 2, 1, 48, 96, 192, 465.9),
            ("16B", 48, 6144, 32, 4, 1, 48, 192, 192, 489.1), ("32B", 56, 7168, 48, 8, 1, 48, 384, 192, 459.6),
            ("70B", 64, 8192, 84, 8, 2, 48, 768, 384, 419.7), ("119B", 80, 10240, 92, 8, 4, 48, 1536, 768, 420.5),
            ("177B", 96, 12288, 96, 8, 6, 48, 2304, 1152, 432.8),
            ("314B", 128, 16384, 96, 8, 8, 48, 3072, 1536, 474.4),
            ("462B", 144, 18432, 112, 8, 16, 48, 6144, 3072, 459.9)]
    return [Run(f"megatron24 {name}", f"NVIDIA/Megatron-LM README at 937571cfd4, 'Training Speed and Scalability', "
                f"images/model_table.png, row {name}",
                gpt(name, heads, dim, layers, seq_len=4096, vocab_size=131072, gpt3=False), "H100-80GB", gpus, 400,
                Layout(dp=dp, tp=tp, pp=pp, global_batch=batch, virtual_stages=None, zero_stages=(0, 1),
                       framework="Megatron-LM 2024"),
                tflops, flops="megatron_model",
                assumptions=("GPT with a 4h GELU MLP and tied embeddings (Megatron's defaults; the README names "
                             "neither).", "Micro-batch, recomputation, optimizer sharding and interleaving not "
                             "printed; data-, tensor- and pipeline-parallel communication overlapped (the README).",
                             "400 Gb/s per GPU between nodes assumed (a DGX H100's eight ConnectX-7).",
                             "Megatron-LM at that commit shards data-parallel state only with its distributed "
                             "optimizer (--use-distributed-optimizer, ZeRO-1; FSDP came later): ZeRO 0 or 1.",
                             MEGATRON_BF16,
                             "The README's tensor-parallel overlap is not given to the planner: its tp_overlap prices "
                             "PyTorch's AsyncTP (each collective behind the products it is fused with: 1.08-1.20x the "
                             "measured throughput at TP 8; hiding every collective behind all of the layer's products "
                             "gave 1.2-1.3x), not Transformer Engine's userbuffers; exposed is the nearer bound."),
                disagreement=("The smallest model (hidden 2048, no model parallelism) runs 1.14x slower than the "
                              "roofline's efficiency curve allows: at 2048 the products reach less of the peak "
                              "than the stated curve (compute.py) gives." if name == "1.7B" else ""))
            for name, heads, dim, layers, tp, pp, dp, gpus, batch, tflops in rows]


def _others():
    neox = Run("gpt-neox 20B", "Black et al. 2022, 'GPT-NeoX-20B' (arXiv 2204.06745), section 3; EleutherAI/gpt-neox "
               "configs/20B.yml ('as it was trained on 96x 40GB A100')",
               Shape(44, 6144, 64, 4 * 6144, 50432, 2048, name="GPT-NeoX-20B"), "A100-40GB", 96, 100,
               Layout(dp=12, tp=2, pp=4, global_batch=1536, micro_batch_size=4, recompute="full", zero_stage=1,
                      sequence_parallel=False, pp_whole_grads=True, pp_blocking=True, framework="DeepSpeed 2022"),
               None,
               assumptions=("Batch 4 x 32 accumulation x 12 replicas = 1536 (configs/20B.yml; the paper says "
                            "1538).", "Four HDR (200 Gb/s) ConnectX-6 per 8 GPUs: 100 Gb/s per GPU.",
                            "DeepSpeed's pipeline engine, as EleutherAI's DeeperSpeed fork of it (assumed before "
                            "v0.6.0): activations split over the tensor-parallel ranks, their gradients sent whole, "
                            "blocking sends and receives in turn; no sequence parallelism (2022).",
                            "No per-GPU throughput found in the stored sources: left out rather than recalled."))
    bloom = Run("bloom 176B", "BigScience, bigscience-workshop/bigscience train/tr11-176B-ml/README.md (layout, "
                "'Throughput'); BigScience's 176B model page (about 150 TFLOPs; 60 GB on each GPU)",
                Shape(70, 14336, 112, 4 * 14336, 250880, 2048, tied=True, name="BLOOM-176B", grad_bytes=4),
                "A100-80GB", 384, 50,
                Layout(dp=8, tp=4, pp=12, global_batch=2048, micro_batch_size=2, recompute="full", zero_stage=1,
                       sequence_parallel=False, pp_blocking=True, accumulate_fp32=True,
                       stage_layers=(5,) + (6,) * 10 + (5,), framework="DeepSpeed 2022"),
                150, flops="bloom_hfu", memory_bytes=60e9,
                assumptions=("'About 150 TFLOPs', counted as 8 P s B per step (recomputation included).",
                             "Four 100 Gb/s Omni-Path links per node of 8 GPUs: 50 Gb/s per GPU.",
                             "The embedding sits with 5 layers on the first and last stage, 6 layers elsewhere.",
                             "Megatron-DeepSpeed of 2022: DeepSpeed's pipeline engine (1F1B, activations and their "
                             "gradients split over the tensor-parallel ranks as since v0.6.0, is_pipe_partitioned "
                             "and is_grad_partitioned; blocking sends and receives in turn), no sequence "
                             "parallelism.",
                             "bf16 with DeepSpeed's BF16_Optimizer (the README's 'Data type' and 'Deepspeed config': "
                             "'--bf16', 'The new BF16_Optimizer implements its own ZeRO Stage 1'): gradients kept and "
                             "reduced in fp32 (4 bytes), each micro-batch's added into them after its backward "
                             "(accumulate_fp32)."))
    metaseq = "facebookresearch/metaseq at f7ffa5fd61 (2023-06)"
    opt = Run("opt 175B", f"Zhang et al. 2022, 'OPT' (arXiv 2205.01068), section 2.4 ('utilization of up to 147 "
              f"TFLOP/s per GPU'); {metaseq}: projects/OPT/download_opt175b.md "
              "('trained OPT-175B on 124 hosts', '8x tensor parallelism'), "
              "projects/OPT/chronicles/10_percent_update.md ('Batch-size of 2M'), metaseq/launcher/opt_baselines.py "
              "and opt_job_constants.py (row '175b')",
              Shape(96, 12288, 96, 4 * 12288, 50272, 2048, mlp="relu", tied=True, name="OPT-175B"),
              "A100-80GB", 992, 200,
              Layout(dp=124, tp=8, global_batch=992, micro_batch_size=8, recompute="full", zero_stage=2,
                     sequence_parallel=False, distribute_saved_activations=True, prefetch=False,
                     framework="metaseq 2022"), 147,
              flops="narayanan2021",
              assumptions=("The layout as metaseq's launcher sets it (opt_baselines.py): --batch-size (2M tokens // "
                           "124 replicas) // 2048 = 8 sequences, --update-freq 1, so 992 a step; "
                           "--checkpoint-activations with --distribute-checkpointed-activations (the saved layer "
                           "inputs split over the 8 tensor-parallel ranks); FSDP with --no-reshard-after-forward "
                           "(ZeRO-2); no sequence parallelism (2022).",
                           "Inter-node network not described in the stored sources: 200 Gb/s per GPU assumed.",
                           "147 TFLOP/s counts recomputation (Narayanan et al.'s formula): 'we need 33 days to fully "
                           "train at this scale with 1024 80GB A100s' (chronicles/10_percent_update.md, 300B tokens) "
                           "is 147 TFLOP/s per GPU in it, 111 without recomputation. 'Up to': the best it reached.",
                           "FSDP is FairScale's (metaseq's fsdp_wrap), which gathers a unit's weights as its forward "
                           "starts and waits for them (fully_sharded_data_parallel.py, forward -> "
                           "_rebuild_full_params): no prefetch (prefetch=False), so the weights updated each step "
                           "are gathered layer by layer, exposed."))
    deepseek = Run("deepseek-v3 671B", "DeepSeek-AI 2024, 'DeepSeek-V3 Technical Report' (arXiv 2412.19437), "
                   "sections 3.2 (16-way pipeline, 64-way expert parallel over 8 nodes, ZeRO-1 data parallel) and "
                   "1 (180K H800 GPU hours per trillion tokens)",
                   Shape(61, 7168, 128, 2048, 129280, 4096, num_experts=256, top_k=8, mlp="swiglu",
                         name="DeepSeek-V3", deepseek=(("q_lora_rank", 1536), ("kv_lora_rank", 512),
                                                       ("qk_nope_head_dim", 128), ("qk_rope_head_dim", 64),
                                                       ("v_head_dim", 128), ("n_shared_experts", 1),
                                                       ("first_k_dense_replace", 3), ("intermediate_size", 18432),
                                                       ("topk_group", 4))),
                   "H800-80GB, 20 SMs communicating", 2048, 400,
                   Layout(dp=128, pp=16, ep=64, global_batch=15360, recompute="norms_up_fp8", zero_stage=1,
                          float8=True, schedule="ZB-H1", ep_overlap=True, framework="DeepSeek-V3"),
                   180e3, unit="gpu_hours_per_1e12_tokens",
                   assumptions=("Batch 15,360 sequences of 4096, its value after the first 469B tokens "
                                "(section 4.2).",
                                "DualPipe (section 3.2.1) is not one of the planner's schedules: ZB-H1, the "
                                "zero-bubble schedule it extends, stands for it (DualPipe's bubble is about half "
                                "of it, its activations p + 1 micro-batches and its parameters twice); its "
                                "overlap of the expert all-to-all with another chunk's computation is "
                                "Config.ep_overlap.",
                                "Node-limited routing: each token's experts on at most 4 nodes (section 2.1.2; "
                                "config.json's topk_group 4), so at most 4 copies cross InfiniBand; the dispatch in "
                                "FP8 (section 3.3.3) is not modelled (16 bits both ways).",
                                "Recomputation as section 3.2.3 says it ran: 'We recompute all RMSNorm operations "
                                "and MLA up-projections during back-propagation'; the activations cached in FP8, "
                                "attention's output in E5M6, the MoE SwiGLU's inputs cached and its output "
                                "recomputed (3.3.3): the planner's norms_up_fp8 (utils/planner/memory.py), 53 GB "
                                "at micro-batch 1 (101 GB without recomputation, 19 GB with full, which the record "
                                "took before: 0.93 of the reported throughput, its split 1.31 behind the planner's "
                                "best). The report publishes no memory per GPU.",
                                "Its all-to-all kernels hold 20 of the H800's 132 SMs beside the computation "
                                "(sections 3.2.2 and 3.5.1): the products at 112/132 of the planner's efficiency "
                                "(GPUS); without, 1.22 of the reported throughput.",
                                "Not counted: multi-token prediction (one more MoE layer, and the output head run "
                                "again, on the rank holding the embedding and head, section 3.2.3), which would "
                                "slow the predicted step; DualPipe's second copy of the parameters (3.2.1); BF16 "
                                "Adam moments beside FP32 master weights and gradients (3.3.3: 8 + 4 bytes per "
                                "parameter against the planner's 12 + 2); the EMA of the weights, kept in CPU "
                                "memory (3.2.3), takes none of the GPU's.",
                                "Sections 1, 3.1, 3.2 and 4.2 as transcribed in stored copies of the report (its "
                                "links: NVLink 160 GB/s, InfiniBand 50 GB/s per GPU); the shape from the released "
                                "config.json (61 layers, 7168, 128 heads, 256 routed experts of 2048, top 8, "
                                "vocabulary 129,280)."))
    return [neox, bloom, opt, deepseek]


RUNS = (_narayanan_table1() + _narayanan_table2() + _megatron_readme_gpt3() + _korthikanti() + _mt_nlg()
        + _nemotron4() + _llama3() + _torchtitan() + _megatron_core_h100() + _others())


# ---------------------------------------------------------------- where the planner prefers another layout, and why
#
# For the runs whose published split the planner ranks more than 10% behind its best: what the practitioners knew,
# or had, that the planner does not, with the source that says so. `offered` keeps the search to the choices the
# run's framework offered at the time (validate() then reports the gap among those, 'offered_gap').

@dataclasses.dataclass(frozen=True)
class Reason:
    text: str  # one short line: what the run's authors knew or had that the planner does not
    source: str
    offered: dict = dataclasses.field(default_factory=dict)  # {plan column: allowed values}
    benchmark: bool = False  # the layout was the experiment's condition (a table measuring one technique, a
    #                          baseline), not a choice made to train fast: agreement's layout_chosen leaves it out


MEGATRON_2021 = {"cp": {1}}  # its ZeRO stages, recomputation and schedules: in the search itself (framework_offers)
TORCHTITAN = "pytorch/torchtitan, benchmarks/llama3_h100_202412_torchtitan.md (torchtitan 9dec370), Table {}"
LLAMA3_SOURCE = "Llama Team 2024, 'The Llama 3 Herd of Models' (arXiv 2407.21783), section 3.3.2 and Table 4"
_FAMILY_REASONS = {  # a pattern of run names (the first that matches): the reason of every run it names
    r"megatron21 ZeRO-3 ": Reason(
        "a baseline, not a choice: the paper ran ZeRO-3 without model parallelism to compare it with PTD-P",
        f"{NARAYANAN}, section 5.2 and Table 2", {"tp": {1}, "pp": {1}, "cp": {1}}, benchmark=True),
    r"megatron21 (145\.6B|PTD-P 174\.6B)": Reason(
        "t 8 x p 16 without recomputation (16 micro-batches in flight) ran out of memory in Figure 17",
        f"{FIGURE_17}; counted without Layout.uncounted_activations, 72 GB (tests/test_planner_runs.py)",
        MEGATRON_2021),
    r"megatron21 ": Reason(
        "Megatron's rules: TP up to the 8 GPUs of a node, then the smallest t x p that fits, at full recomputation",
        f"{NARAYANAN}, section 3.3 (Takeaways #1 and #2) and section 3.5 (activation recomputation)",
        MEGATRON_2021),
    r"mt-nlg ": Reason(
        "Megatron's rules: 8-way tensor slicing in a node, a 35-way pipeline (280 GPUs a replica), full recomputation",
        "Smith et al. 2022 (arXiv 2201.11990), section 2.2; Narayanan et al. 2021, section 3.3 (Takeaways #1, #2)"),
    r"korthikanti22 ": Reason(
        "one model-parallel replica (data parallel 1) to measure sequence parallel; no context parallel or ZeRO yet",
        "Korthikanti et al. 2022 (arXiv 2205.05198), section 6 and Table 3",
        {"cp": {1}}),
    r"llama3 405B 16384 cp16": Reason(
        "the long-context stage kept the 8K runs' TP 8 x PP 16 and added CP 16 to fit 131K tokens",
        LLAMA3_SOURCE, {"tp": {8}, "pp": {16}}),
    r"llama3 ": Reason(
        "CP only to reach 131K tokens; at 8K, TP 8 in a node and Meta's interleaving (beyond the planner's memory)",
        LLAMA3_SOURCE, {"cp": {1}}),
    r"torchtitan 8B FSDP \d+( \+|$)": Reason(
        "a benchmark of FSDP alone (Tables 1 and 3: eager, torch.compile, Float8), at selective recomputation",
        TORCHTITAN.format(1), {"tp": {1}, "pp": {1}, "cp": {1}}, benchmark=True),
    r"torchtitan \d+B A100": Reason(
        "a benchmark of FSDP alone on 64 A100s ('infra metrics achieved by FSDP2 (1D parallelism)'; 2D as loss only)",
        "pytorch/torchtitan, docs/performance.md at 041336434916 (2024-06)", {"tp": {1}, "pp": {1}, "cp": {1}},
        benchmark=True),
    # The CP rows' gaps are recomputation, not context parallel's price: at each row's own full recomputation the
    # published split is the planner's best (1.00; 405B at Table 6's 1F1B and 8 micro-batches too: DP over CP at equal
    # work; 1.08-1.09 without them, CP giving more micro-batches of the global batch, a smaller bubble); the best
    # overall drops recomputation, which s / cp tokens per rank let fit.
    # Both sides pay attention alike: PyTorch's load-balanced ring (torch 1963fc8, which the table names;
    # _context_parallel/_attention.py, _is_causal_behavior) runs the causal half of each rank's s/cp x s, as flash
    # attention's causal kernel does at CP 1, and the planner times both as the full square (compute.py).
    r"torchtitan 8B FSDP \d+ CP ": Reason(
        "a benchmark of FSDP x CP on 8 GPUs as the sequence grows, all at full recomputation (its Table 2's title)",
        TORCHTITAN.format(2), {"tp": {1}, "pp": {1}, "recompute": {"full"}}, benchmark=True),
    r"torchtitan 70B 2D": Reason(
        "a benchmark of 2D (FSDP x TP 8) with Float8 and torch.compile, its TP exposed without AsyncTP",
        TORCHTITAN.format(4), {"pp": {1}, "cp": {1}}, benchmark=True),
    r"torchtitan 405B FSDP \d+ CP ": Reason(
        "a benchmark of CP as the sequence grows at TP 8 x PP 8: 1F1B, 8 micro-batches, full recomputation",
        TORCHTITAN.format(6),
        {"tp": {8}, "pp": {8}, "recompute": {"full"}, "schedule": {"1F1B"}, "micro_batches": {8}}, benchmark=True),
    r"torchtitan 405B (1F1B|Interleaved)": Reason(
        "a benchmark of pipeline schedules at one 3D layout (FSDP 8 x TP 8 x PP 8), Float8, full recomputation",
        TORCHTITAN.format(5), {"dp": {8}, "tp": {8}, "pp": {8}, "cp": {1}}, benchmark=True),
    r"opt 175B": Reason(
        "metaseq ran FSDP beside Megatron's tensor parallel, with no pipeline and no context parallel",
        "facebookresearch/metaseq at f7ffa5fd61, metaseq/launcher/opt_baselines.py", {"pp": {1}, "cp": {1}}),
    r"deepseek-v3 ": Reason(
        "TP avoided by design: memory optimised 'to train DeepSeek-V3 without using costly Tensor Parallelism'",
        "DeepSeek-AI 2024, 'DeepSeek-V3 Technical Report' (arXiv 2412.19437), sections 3.2 and 3.2.3",
        {"tp": {1}, "cp": {1}}),
    r"megatron24 ": Reason(
        "a weak-scaling table: data parallel 48 for every size, the model-parallel size grown with the model",
        "NVIDIA/Megatron-LM README at 937571cfd4, 'Training Speed and Scalability'", {"dp": {48}}),
}


def _family_reason(name):
    return next((reason for pattern, reason in _FAMILY_REASONS.items() if re.match(pattern, name)), None)


LAYOUT_REASONS = {run.name: _family_reason(run.name) for run in RUNS if _family_reason(run.name)}


def format_layout_ranks(rows, within=0.10):
    """One line per searched run: the published split's rank and gap to the planner's best, the best split, and,
    where the gap exceeds `within`, what the practitioners knew (LAYOUT_REASONS) and the gap among what their
    framework offered."""
    lines = [f"{'run':>34} {'rank':>4} {'gap':>5}  {'planner best (dp tp pp cp ep)':<30} {'offered':>7}  why"]
    for row in rows:
        if not row.get("searched"):
            continue
        best = row["best"]
        split = " ".join(str(best[a]) for a in LAYOUT_AXES) if best else "-"
        near = row["gap"] is not None and row["gap"] <= 1 + within
        reason = LAYOUT_REASONS.get(row["name"])
        why = "" if near else reason.text if reason else "not explained yet"
        offered = row.get("offered_gap")
        cells = ["-" if v is None else f"{v:.2f}" for v in (row["gap"], None if near else offered)]
        lines.append(f"{row['name']:>34} {row['rank'] or '-':>4} {cells[0]:>5}  {split:<30} {cells[1]:>7}  {why}")
    return "\n".join(lines)
