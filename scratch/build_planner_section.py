import nbformat as nbf

cells = []
md = lambda s: cells.append(nbf.v4.new_markdown_cell(s.strip("\n")))
code = lambda s, tags=None: cells.append(nbf.v4.new_code_cell(s.strip("\n"), metadata={"tags": tags} if tags else {}))

md(r"""
## 5. The planner: which split for a model that is not on this laptop

Sections 1-4 composed the parallelisms on 8 CPU ranks and counted every byte. A real run asks the question
the other way round: given a model, a cluster and a batch, **which** `(dp, tp, pp, cp, ep)`, micro-batch size,
recomputation and ZeRO stage? `utils/planner.py` answers with the formulas notebooks 01-11 verified, one small
function each: for every split that divides evenly it computes the **memory per device** and an estimated
**step time**, drops the splits that do not fit, and ranks the rest.

It is an estimate, and says what it assumes: communication follows notebook 01's alpha-beta model on the link
the group runs on; compute is FLOPs at an assumed MFU; data-parallel collectives hide behind the compute and
ring attention's hops behind the attention, while tensor-parallel, expert and pipeline transfers are on the
critical path, except one layer's share of each (the first gather precedes any compute, the last gradients
follow it all). Every number below is computed, none measured: on this laptop there is no H100.
""")

code(r"""
import dataclasses

from utils import planner as pl
from utils.checks.planner import check_memory_per_device
from utils.plots import plot_plan
from utils.transformer import TransformerSizes
""")

md(r"""
### Memory per device

Ψ parameters; `p`, `g`, `o` bytes per parameter of weights, gradients and optimizer states (mixed-precision Adam:
2, 2, 12, notebook 05); the **data axis** `N = dp · cp` (context-parallel ranks hold the same weights as their
data-parallel peers and sum their gradients with them); experts have `N / ep` copies.

| | formula, one device of the first pipeline stage | source |
|---|---|---|
| this device's weights | dense `Ψ_stage / tp`, experts `Ψ_experts,stage / ep`; a stage holds `L / pp` layers | notebooks 03, 04, 10 |
| ZeRO-1 / 2 / 3 | optimizer states / gradients too / weights too, divided by `N` | notebook 05 |
| activations per layer | `s b h (34 + 5 a s / h) / t` bytes at 2 bytes per element, `s = S / cp`, `t = tp` with sequence parallel | Korthikanti et al. 2022 |
| selective / full recomputation | `34 s b h / t` / `2 s b h / t` (+ one layer recomputed) | Korthikanti et al. 2022, notebook 06 |
| micro-batches in flight | `min(pp, m)` on 1F1B's first stage | notebook 04 |

**Exercise.** Write the memory per device, without recomputation, by group. `pl.stage_params(model, config)` gives
this device's parameters before any sharding over the data axis: `(dense, experts)`, already divided by `tp` and
`ep` respectively, for the `L / pp` layers of the first stage (and its embedding).
""")

code(r'''
def memory_per_device(model, config, num_micro_batches):
    """Bytes on one device of the first pipeline stage: {parameters, gradients, optimizer states, activations}."""
    dense, experts = pl.stage_params(model, config)
    # TODO: shard each state over the data axis from its ZeRO stage on; the activations per layer (Korthikanti et
    # al.), times the layers of a stage, times the micro-batches 1F1B keeps in flight
    ### BEGIN SOLUTION
    data = config.dp * config.cp  # cp ranks hold the same weights as their dp peers: one data axis
    expert_data = data // config.ep  # each expert's copies

    def state(bytes_per_param, stage):  # sharded from ZeRO stage `stage` on
        if config.zero_stage >= stage:
            return bytes_per_param * (dense / data + experts / expert_data)
        return bytes_per_param * (dense + experts)

    s = model.seq_len / config.cp  # this rank's tokens of each sequence
    b, h, a = config.micro_batch_size, model.dim, model.num_heads
    per_layer = s * b * h * (34 + 5 * a * s / h) / config.tp * model.activation_bytes / 2
    in_flight = min(config.pp, num_micro_batches)  # 1F1B's first stage
    layers = model.num_layers // config.pp
    return {"parameters": state(model.param_bytes, 3), "gradients": state(model.grad_bytes, 2),
            "optimizer states": state(model.optimizer_bytes, 1), "activations": in_flight * layers * per_layer}
    ### END SOLUTION
''')

code(r"""
check_memory_per_device(memory_per_device)
""")

md(r"""
### Communication per step, per group, and where each group runs

The mesh is `(pp, dp, cp, tp)`, `tp` innermost: the planner fills a node from the inside (tp, then cp and the
expert group, then dp), and a group whose ranks span more than one node runs at the inter-node bandwidth. Per
step, on one device, with `M = b (S/cp) h e` the bytes of a micro-batch's activations:

| group | what moves | per | source |
|---|---|---|---|
| tp | an all-gather and a reduce-scatter of `M` per column/row pair (2 per dense layer, 1 per MoE layer), forward, backward and the recomputed forward | layer, micro-batch | notebooks 03, 09 |
| cp | keys and values `2 b (S/cp) kv_dim/tp e`: `cp-1` hops forward, `2cp-1` backward; hidden behind the attention's compute | layer, micro-batch | notebook 09 |
| ep | two all-to-alls of the rank's tokens' `k` copies (`k h e` each), each pass | MoE layer, micro-batch | notebook 10 |
| pp | the activations forward and their gradient backward, `M / tp` | micro-batch | notebook 04 |
| bubble | `(pp - 1) / m` of the micro-batches' time: 1F1B's `(p-1)/(m+p-1)` of the step | step | notebook 04 |
| dp | ZeRO-0: an all-reduce of the gradients; ZeRO-1/2: a reduce-scatter and an all-gather; ZeRO-3: two all-gathers and a reduce-scatter; hidden behind the compute | step | notebook 05 |
| compute | `(6 P_active + 12 L S h)` FLOPs per token over `devices x peak x MFU`; 4/3 with full recomputation | step | notebook 12's handout |

A collective costs `steps · α + bytes / β` (ring: `2(N-1)` steps for an all-reduce, `N-1` for the others;
notebook 01). The cluster assumed below is stated once: H100-like devices of 80 GB, 989 TFLOP/s dense bf16 at an
assumed **MFU of 50%**, nodes of 8 on NVLink (β = 300 GB/s, α = 5 µs per message) and InfiniBand between nodes
(β = 40 GB/s per device, α = 15 µs). The models are Llama-2-like (7B, 70B with grouped-query attention) and
Mixtral-8x7B-like, with the shapes their configurations publish, sequences of 4096 tokens and a global batch of
1024 sequences (4M tokens).
""")

code(r"""
NODE = {"devices_per_node": 8, "memory_bytes": 80e9, "intra": pl.Link(alpha=5e-6, beta=300e9),
        "inter": pl.Link(alpha=15e-6, beta=40e9), "peak_flops": 989e12, "mfu": 0.5}
MODELS = {
    "7B dense": pl.Model(num_layers=32, dim=4096, num_heads=32, ffn_dim=11008, seq_len=4096, vocab_size=32000,
                         ffn_matrices=3),
    "70B dense": pl.Model(num_layers=80, dim=8192, num_heads=64, ffn_dim=28672, seq_len=4096, vocab_size=32000,
                          num_kv_heads=8, ffn_matrices=3),
    "8x7B MoE": pl.Model(num_layers=32, dim=4096, num_heads=32, ffn_dim=14336, seq_len=4096, vocab_size=32000,
                         num_kv_heads=8, num_experts=8, top_k=2, ffn_matrices=3),
}
GLOBAL_BATCH = 1024  # sequences of 4096 tokens
for name, model in MODELS.items():
    print(f"{name:>9}: {model.num_params / 1e9:6.2f} B parameters, {model.active_params / 1e9:6.2f} B per token; "
          f"16 bytes each = {16 * model.num_params / 1e9:6.0f} GB of model state")
""")

md(r"""
Two splits of the 70B model on 64 devices, side by side: Megatron's habit (tensor parallel across the node,
pipeline across nodes, ZeRO-1) and FSDP alone with full recomputation. The columns are seconds per step, per
device; `exposed` is the data- and context-parallel time the compute did not hide.
""")

code(r"""
cluster_64 = pl.Cluster(num_devices=64, **NODE)
two = [pl.estimate(MODELS["70B dense"], cluster_64, GLOBAL_BATCH, config)
       for config in (pl.Config(dp=2, tp=8, pp=4, micro_batch_size=1, recompute="selective", zero_stage=1),
                      pl.Config(dp=64, micro_batch_size=1, recompute="full", zero_stage=3))]
print(pl.format_rows(two))
""")

md(r"""
Tensor parallel's all-gathers and reduce-scatters are on the critical path: every layer, every micro-batch,
three passes with recomputation. FSDP's collectives are larger but once per step and hidden behind 80 seconds of
compute; it pays a third more compute for recomputing everything. Now every split, for each model, on 64 and
512 devices: the fastest three that fit, and the fastest without context parallel (at 4096 tokens, `cp` is a way
to split activations, not a necessity).
""")

code(r"""
COLUMNS = ("dp", "tp", "pp", "cp", "ep", "micro_batch_size", "micro_batches", "recompute", "zero_stage",
           "memory_gb", "step_s", "compute_s", "tp_s", "ep_s", "pp_s", "bubble_s", "exposed_s")
every = {}
for num_devices in (64, 512):
    cluster = pl.Cluster(num_devices=num_devices, **NODE)
    for name, model in MODELS.items():
        rows = pl.estimates(model, cluster, GLOBAL_BATCH)
        every[num_devices, name] = rows
        fits = sorted((r for r in rows if r["fits"]), key=lambda r: (r["step_s"], r["memory_gb"]))
        no_cp = [r for r in fits if r["cp"] == 1 and r not in fits[:3]][:1]
        print(f"{name} on {num_devices} devices: {len(rows)} valid splits, {len(fits)} fit in 80 GB; "
              f"MFU of the fastest {fits[0]['compute_s'] / fits[0]['step_s'] * NODE['mfu']:.0%}")
        tp8 = [r["step_s"] for r in fits if r["tp"] == 8]
        print(pl.format_rows(fits[:3] + no_cp, COLUMNS))
        print(f"the fastest with tp = 8 takes {min(tp8) / fits[0]['step_s']:.2f} times as long" if tp8 else
              "no split with tp = 8 fits: the experts are not split by tp, and ep leaves them too few copies to shard")
        print()
""")

code(r"""
for num_devices in (64, 512):
    plot_plan({f"{name}, {num_devices} devices": every[num_devices, name] for name in MODELS}, 80,
              f"every split on {num_devices} devices of 80 GB (H100-like, MFU 50% assumed)")
""")

md(r"""
### What the planner says, and what published runs chose

- **Data parallel first, sharded.** On 64 devices every fastest split is data-parallel at heart: ZeRO-1 over 64
  ranks for the 7B model, ZeRO-3 (FSDP) for the 70B (with `cp = 2`, or `tp = 2` without context parallel, to
  halve its activations) and for the 8x7B. torchtitan published the same shape of answer: Llama 2 70B and Llama 3
  8B and 70B on 64 A100s of 80 GB with FSDP2 alone, at 50-58% MFU (`pytorch/torchtitan`, `docs/performance.md`,
  its 2024 version).
- **Tensor parallel when the batch per device runs out.** On 512 devices a global batch of 1024 sequences leaves
  2 per rank at `dp = 512`; for the 70B model the planner then spends a factor 2 on `tp`, within a node. The
  right-hand plots show the price of more: the fastest split with `tp = 8` takes 1.2 to 1.5 times as long (printed
  above), because every layer's all-gathers and reduce-scatters wait on NVLink; beyond a node, 10 to 20 times.
- **Experts on their own axis, inside a node.** For the 8x7B model on 512 devices the planner borrows `ep = 8`
  from the data axis, one node wide, where the all-to-alls run on NVLink; on 64 devices it prefers FSDP over the
  whole model (`ep = 2` is 1% slower). Megatron-LM recommends TP1 EP8 PP4 to train Mixtral 8x7B
  (`NVIDIA/Megatron-LM`, `examples/mixtral/README.md`): `tp = 1` and `ep = 8` as here, with pipeline stages
  where the planner, assuming the data-parallel traffic hidden, shards with ZeRO instead. On 64 devices no
  split with `tp = 8` fits: the planner never splits an expert by `tp` (Megatron-Core's expert tensor parallel
  does), so `tp = 8` leaves each expert too few data-parallel copies to shard its state over.
- **Needs checking against the papers themselves** (only secondary sources were at hand): Llama 3 405B on
  8,192-16,384 H100s as TP 8, PP 16, CP 1 (CP 16 for 128K-token sequences) (Dubey et al. 2024, Table 4, as quoted
  from an SC'24 talk); DeepSeek-V3 with 16-way pipeline, 64-way expert parallel and ZeRO-1 data parallel, no tensor
  parallel (DeepSeek-AI 2024, section 3.2). Narayanan et al. 2021's 1-trillion-parameter run reached 502 PFLOP/s
  on 3072 A100s (its abstract); its table of `(t, p, d)` per model size is not reproduced here.

torchtitan also publishes the memory its runs took. The planner's memory per device for the same splits (Llama
3.1 shapes: vocabulary 128256, sequences of 8192 tokens; Llama 2 70B: 4096):
""")

code(r"""
LLAMA31_8B = pl.Model(num_layers=32, dim=4096, num_heads=32, ffn_dim=14336, seq_len=8192, vocab_size=128256,
                      num_kv_heads=8, ffn_matrices=3)
LLAMA31_70B = dataclasses.replace(MODELS["70B dense"], seq_len=8192, vocab_size=128256)
GIB = 2**30 / 1e9
published = [  # (run, model, devices, global batch, split, published peak memory in GB or what happened)
    ("Llama 3.1 8B, FSDP 128, local batch 2, selective AC", LLAMA31_8B, 128, 256,
     pl.Config(dp=128, micro_batch_size=2, recompute="selective", zero_stage=3), f"{67.0 * GIB:.1f} GB"),
    ("Llama 3.1 70B, FSDP 32 x TP 8, local batch 16, full AC", LLAMA31_70B, 256, 512,
     pl.Config(dp=32, tp=8, micro_batch_size=16, recompute="full", zero_stage=3), f"{71.9 * GIB:.1f} GB"),
    ("Llama 2 70B, FSDP 64, local batch 2, full AC", MODELS["70B dense"], 64, 128,
     pl.Config(dp=64, micro_batch_size=2, recompute="full", zero_stage=3), "fits in 80 GB"),
    ("Llama 2 70B, FSDP 64, local batch 2, selective AC", MODELS["70B dense"], 64, 128,
     pl.Config(dp=64, micro_batch_size=2, recompute="selective", zero_stage=3), "out of memory (80 GB)"),
    ("Llama 2 70B, FSDP 64, local batch 1, selective AC", MODELS["70B dense"], 64, 64,
     pl.Config(dp=64, micro_batch_size=1, recompute="selective", zero_stage=3), "fits in 80 GB"),
]
print(f"{'torchtitan run':>55} {'planner':>9}  published")
for run, model, devices, batch, config, reported in published:
    row = pl.estimate(model, pl.Cluster(num_devices=devices, **NODE), batch, config)
    print(f"{run:>55} {row['memory_gb']:6.1f} GB  {reported}")
""")

md(r"""
Within 5% of the two measured peaks (the 70B row ran with torch.compile and Float8, which the planner does not
model), and right on which 70B runs fit, except the last: torchtitan's *selective op* checkpointing recomputes a
different set of operations than Korthikanti et al.'s *selective* (their 34 bytes per `s b h` count GPT-3's layer:
a GELU MLP of 4h and dropout masks that Llama does not have), so for Llama layers the formula is an upper bound.

What else the model leaves out, and why real runs use more tensor parallel than it does: per-device efficiency
falls as each device's matrices shrink (MFU is a constant here), FSDP's overlap is never perfect on a congested
network, the logits (`b s V` in fp32) and fragmentation take memory the formulas omit, and the global batch is a
training decision, not a free parameter.
""")

md(r"""
### The same formulas, on the course's small model and gloo

`pl.small_model_bytes` predicts what each rank sends per step on each group of sections 2-4's runs (float64,
gloo: its reduce-scatter costs an all-reduce, notebook 01). The notebooks already measured most of the pieces;
the prediction against their stored measurements:
""")

code(r"""
units = {i: [(16, 16)] for i in range(4)}  # notebook 05: 4 layers of 16x16, float32, 4 ranks
rows = [("05 FSDP, one step, in S (4 ranks)", pl.fsdp_bytes(units, 4, 4, "gloo") / (4 * 256 * 4), 3.01),
        ("09 tensor parallel block, bytes (4 ranks)",
         pl.tensor_parallel_layer_bytes(2, 240, 96, 4, 8, "gloo", sequence_parallel=False), 2218752),
        ("09 sequence parallel block, bytes (4 ranks)", pl.tensor_parallel_layer_bytes(2, 240, 96, 4, 8, "gloo"),
         3354624),
        ("09 ring attention forward, bytes (4 ranks)", pl.ring_attention_bytes(1, 4, 48, 8, 4, 8, backward=False),
         18432),
        ("10 all-to-all bytes per token (counted)", pl.expert_dispatch_bytes_per_token(16, 2, 8), 1024)]
print(f"{'':>45} {'predicted':>10} {'measured':>10} {'ratio':>6}")
for name, predicted, measured in rows:
    print(f"{name:>45} {predicted:>10.6g} {measured:>10.6g} {measured / predicted:>6.3f}")
SMALL = TransformerSizes(seq_len=16, batch_size=4)
for stage in (0, 1):
    sent = pl.small_model_bytes(SMALL, dp=2, tp=2, pp=2, num_micro_batches=2, stage=stage)
    print(f"(dp, pp, tp) = (2, 2, 2), 2 micro-batches, stage {stage}: bytes each rank sends per step "
          + ", ".join(f"{group} {value:.0f}" for group, value in sent.items()))
""")

md(r"""
The socket counts exceed the prediction by gloo's message headers (under 2%); the counts at the calls equal it.
`tests/test_planner.py` also runs FSDP2 on this transformer and finds, call by call, the bytes the prediction
says its all-gathers return (each layer twice, the root's own weights once) and its reduce-scatters keep.

### What you saw

- Memory per device is a sum of a few products, each divided by the axis that splits it: ZeRO over `dp x cp`,
  weights over `tp` and `pp`, experts over `ep`, activations over `tp` (with sequence parallel) and `cp`, times
  the micro-batches in flight.
- Ranking by step time needs where each group runs: tensor parallel belongs on NVLink, data parallel can cross
  nodes because it overlaps with compute, and the bubble shrinks as micro-batches grow.

Questions: (1) At what global batch does the planner switch the 70B model on 512 devices from pure FSDP to tensor
parallel? (2) Halve the inter-node bandwidth: which answers change? (3) Which assumption would you test first on
a real cluster, and with which of this course's measurements?
""")

nb = nbf.v4.new_notebook(cells=cells, metadata={"kernelspec": {"display_name": "Python 3", "language": "python",
                                                                "name": "python3"}})
nbf.write(nb, "/work/wt-30p/scratch/planner_section.ipynb")
