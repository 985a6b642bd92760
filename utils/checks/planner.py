"""Check for notebook 12's planner exercise: the memory per device of a split, against utils.planner's.

The student writes memory_per_device(model, config, num_micro_batches) -> {"parameters", "gradients",
"optimizer states", "activations"} in bytes (no recomputation, no buffers), from pl.stage_params and the model's
sizes; the activations counted as the planner counts them (utils/planner/memory.py, after Korthikanti et al.
2022) for the check's layer, a GELU MLP of 4h, no dropout, attention's scores kept: per token 16 h-wide tensors and
a s scores, e bytes each. The check runs it on a few
splits of a small mixture-of-experts model, at every activation size the planner takes (2 and 4 bytes per
element), chosen so that every mistake of the catalogue changes at least one number, and names a mistake only
when recomputing it gives the student's numbers on every split.
"""
import dataclasses

from utils import planner as pl

GROUPS = ("parameters", "gradients", "optimizer states", "activations")

# A small MoE model whose sizes all differ, so that no two mistakes give the same numbers; a GELU MLP of 4h per
# expert, one expert per token, no dropout, attention's scores kept (no flash attention)
MODEL = pl.Model(num_layers=8, dim=64, num_heads=8, ffn_dim=256, seq_len=128, vocab_size=100, num_experts=4, top_k=1,
                 flash_attention=False, name="check")
ACTIVATION_BYTES = (2, 4)  # what the planner takes: 16-bit and 32-bit activations
# (config, micro-batches): every axis > 1 somewhere, each ZeRO stage, micro-batches fewer and more than pp
CASES = [(pl.Config(dp=2, tp=2, pp=2, cp=2, ep=2, micro_batch_size=2, zero_stage=1), 4),
         (pl.Config(dp=4, tp=2, pp=4, cp=2, ep=4, micro_batch_size=1, zero_stage=3), 2),
         (pl.Config(dp=2, tp=4, pp=2, cp=1, ep=1, micro_batch_size=1, zero_stage=2), 8),
         (pl.Config(dp=1, tp=1, pp=1, cp=4, ep=2, micro_batch_size=3, zero_stage=0), 1),
         (pl.Config(dp=3, tp=1, pp=1, cp=1, ep=3, micro_batch_size=1, zero_stage=3), 2)]


def reference(model, config, num_micro_batches):
    """utils.planner's numbers for the groups the exercise computes."""
    memory = pl.memory_per_device(model, config, num_micro_batches)
    return {group: memory[group] for group in GROUPS}


def _with(model, config, m, *, data=None, expert_data=None, stages=None, activation_config=None, in_flight=None,
          layers=None, element=1.0, per_layer=None):
    """The exercise's numbers with one piece computed wrongly (each argument a mistake; None: right)."""
    dense, experts = pl.stage_params(model, config)
    data = data if data is not None else config.dp * config.cp
    expert_data = expert_data if expert_data is not None else config.dp * config.cp // config.ep
    stages = stages or {"parameters": 3, "gradients": 2, "optimizer states": 1}
    per_param = {"parameters": model.param_bytes, "gradients": model.grad_bytes,
                 "optimizer states": model.optimizer_bytes}
    out = {}
    for group, stage in stages.items():
        sharded = config.zero_stage >= stage
        out[group] = per_param[group] * (dense / (data if sharded else 1) + experts / (expert_data if sharded else 1))
    kept = per_layer if per_layer is not None else pl.layer_activation_bytes(model, activation_config or config)
    kept *= element
    in_flight = in_flight if in_flight is not None else pl.micro_batches_in_flight(config, m)
    out["activations"] = in_flight * (layers or model.num_layers // config.pp) * kept
    return out


def _korthikanti(model, config):
    """Korthikanti et al. 2022's count with dropout, sbh(34 + 5as/h)/t at 2 bytes per element, scaled to e."""
    s, b, h, a = model.seq_len / config.cp, config.micro_batch_size, model.dim, model.num_heads
    return s * b * h * (34 + 5 * a * s / h) / config.tp * model.activation_bytes / 2


def mistakes(model, config, m):
    """[(hint, numbers)] for the catalogue of wrong answers, on one case."""
    c, r = config, dataclasses.replace
    none = {"parameters": 99, "gradients": 99, "optimizer states": 99}
    return [
        ("the optimizer states are not divided by the data axis: ZeRO-1 and above shard them over dp x cp",
         _with(model, c, m, stages=none | {"parameters": 3, "gradients": 2})),
        ("nothing is sharded over the data axis: ZeRO shards the optimizer states (stage 1), the gradients (2) and "
         "the parameters (3) over dp x cp", _with(model, c, m, stages=none)),
        ("the ZeRO stages are off by one: stage 1 shards the optimizer states only, stage 2 the gradients too, "
         "stage 3 the parameters too", _with(model, c, m, stages={"parameters": 2, "gradients": 1,
                                                                    "optimizer states": 0})),
        ("the weights are sharded over dp only: the cp ranks hold the same weights and share the data axis, "
         "dp x cp ranks", _with(model, c, m, data=c.dp, expert_data=max(1, c.dp // c.ep))),
        ("the experts' states are sharded over the whole data axis: each expert has dp x cp / ep copies, its "
         "expert-data group", _with(model, c, m, expert_data=c.dp * c.cp)),
        ("the activations are not divided by tp: with sequence parallel every activation is split over tp",
         _with(model, c, m, activation_config=r(c, tp=1))),
        ("the activations are not divided by cp: each context-parallel rank holds seq_len / cp tokens",
         _with(model, c, m, activation_config=r(c, cp=1))),
        ("only one micro-batch's activations are counted: 1F1B keeps min(pp, micro-batches) in flight on the "
         "first stage", _with(model, c, m, in_flight=1)),
        ("every micro-batch's activations are counted (GPipe's memory): 1F1B keeps min(pp, micro-batches)",
         _with(model, c, m, in_flight=m)),
        ("pp micro-batches are counted in flight even when there are fewer: min(pp, micro-batches)",
         _with(model, c, m, in_flight=c.pp)),
        ("the activations of every layer are counted: a stage holds num_layers / pp of them",
         _with(model, c, m, layers=model.num_layers)),
        ("model.activation_bytes is ignored: each kept element takes activation_bytes bytes (2 in 16-bit, 4 in "
         "fp32)", _with(model, c, m, element=2 / model.activation_bytes)),
        ("Korthikanti et al.'s 34 + 5as/h count dropout's masks and outputs: this model has no dropout, so a token "
         "keeps 16 h-wide tensors and a s scores", _with(model, c, m, per_layer=_korthikanti(model, c))),
    ]


def _same(got, want):
    return all(abs(got[g] - want[g]) <= 1e-9 * max(1.0, abs(want[g])) for g in GROUPS)


def check_memory_per_device(memory_per_device, model=MODEL, cases=CASES, activation_bytes=ACTIVATION_BYTES):
    """memory_per_device(model, config, num_micro_batches) against utils.planner on every case, at every activation
    size."""
    runs = [(dataclasses.replace(model, activation_bytes=e), config, m) for e in activation_bytes
            for config, m in cases]
    answers = []
    for run in runs:
        got = memory_per_device(*run)
        if not isinstance(got, dict) or set(GROUPS) - set(got):
            raise AssertionError(f"memory_per_device must return a dict with the keys {GROUPS}, got {got!r}")
        answers.append({g: float(got[g]) for g in GROUPS})
    wants = [reference(*run) for run in runs]
    if all(_same(got, want) for got, want in zip(answers, wants)):
        print(f"memory per device: right on {len(cases)} splits of a mixture of experts with {model.num_layers} "
              f"layers (every ZeRO stage; dp, tp, pp, cp and ep > 1), at "
              f"{' and '.join(map(str, activation_bytes))} bytes per activation")
        return
    wrong = [[hint for hint, numbers in mistakes(*run) if _same(got, numbers)] for run, got in zip(runs, answers)]
    confirmed = [hint for hint in wrong[0] if all(hint in hints for hints in wrong)]
    for (run_model, config, m), got, want in zip(runs, answers, wants):
        for group in GROUPS:
            if abs(got[group] - want[group]) > 1e-9 * max(1.0, abs(want[group])):
                hint = f" Likely: {confirmed[0]}." if confirmed else ""
                raise AssertionError(f"{group} of {config} with {m} micro-batches, {run_model.activation_bytes} bytes "
                                     f"per activation: got {got[group]:.6g} bytes, expected {want[group]:.6g}.{hint}")
