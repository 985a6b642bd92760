"""The course's plots, one function each: notebooks call them, tests never look at them.

Each draws a new figure and returns None, so that a notebook cell shows it once (Jupyter's inline
backend displays the figures a cell made).
"""
from utils.bench import format_bytes


def _subplots(*args, **kwargs):
    import matplotlib.pyplot as plt  # here: 0.5 s to import, and most plots are of timings, which the default run skips

    return plt.subplots(*args, **kwargs)


def _size_axis(ax, sizes):
    ax.set_xscale("log", base=2)
    ax.set_xticks(sizes, [format_bytes(s) for s in sizes], rotation=45)
    ax.minorticks_off()


def plot_bandwidth(rows, ceiling=None):
    """rows: (op, world_size, size_bytes, bus_bytes_per_s, wire_bytes_per_s). Two log-log panels side by
    side: bus bandwidth by the nccl-tests convention, and the bytes really written to the sockets per
    second; one line per (op, world size), the memory-copy ceiling dotted on both."""
    fig, axes = _subplots(1, 2, figsize=(11, 4.5), sharey=True)
    colors = {}
    for panel, (ax, title) in enumerate(zip(axes, ("bus bandwidth (nccl-tests convention)",
                                                   "measured: bytes sent per rank / time"))):
        for op, world_size in sorted({(r[0], r[1]) for r in rows}):
            points = sorted((r[2], r[3 + panel]) for r in rows if (r[0], r[1]) == (op, world_size))
            line, = ax.plot([p[0] for p in points], [p[1] / 1e9 for p in points], marker="o",
                            color=colors.get(op), linestyle="-" if world_size == 2 else "--",
                            label=f"{op}, {world_size} ranks")
            colors[op] = line.get_color()
        if ceiling:
            ax.axhline(ceiling / 1e9, color="gray", linestyle=":", label="memory copy (ceiling)")
        _size_axis(ax, sorted({r[2] for r in rows}))
        ax.set_yscale("log")
        ax.set_xlabel("tensor size S")
        ax.set_title(title, fontsize=10)
    axes[0].set_ylabel("GB/s (log scale)")
    axes[1].legend(fontsize=7)
    fig.suptitle("gloo collectives on this machine", fontsize=11)
    fig.tight_layout()  # shown by Jupyter at the end of the cell; a script draws nothing


def plot_alpha_beta(sizes, seconds, alpha, beta):
    """Measured one-way times of send/recv against the fitted t = alpha + size / beta."""
    fig, ax = _subplots(figsize=(7, 4.5))
    ax.plot(sizes, [s * 1e6 for s in seconds], "o", label="measured (half a round trip)")
    fine = [sizes[0] * (sizes[-1] / sizes[0]) ** (k / 100) for k in range(101)]
    ax.plot(fine, [(alpha + s / beta) * 1e6 for s in fine], "-",
            label=f"alpha + size/beta: alpha = {alpha * 1e6:.0f} us, beta = {beta / 1e9:.2f} GB/s")
    _size_axis(ax, sizes)
    ax.set_yscale("log")
    ax.set_xlabel("message size")
    ax.set_ylabel("time (microseconds)")
    ax.set_title("point-to-point: latency, then bandwidth")
    ax.legend(fontsize=8)
    fig.tight_layout()  # shown by Jupyter at the end of the cell; a script draws nothing


def plot_step_times(seconds, title):
    """seconds: {version: [step times]}. One bar per version, in the order given: the median, with the
    range of the steps as an error bar, labelled with its ratio to the first version's median."""
    import statistics

    fig, ax = _subplots(figsize=(6, 3.5))
    ms = [sorted(s * 1e3 for s in times) for times in seconds.values()]
    medians = [statistics.median(m) for m in ms]
    spread = [[m - low[0] for m, low in zip(medians, ms)], [high[-1] - m for m, high in zip(medians, ms)]]
    bars = ax.bar(list(seconds), medians, yerr=spread, capsize=4,
                  color=["gray", "tab:blue", "tab:green", "tab:orange"][:len(ms)])
    ax.bar_label(bars, [f"{m / medians[0]:.2f}x" for m in medians], label_type="center", fontsize=8)
    ax.set_ylabel("step time (ms): median and range")
    ax.set_title(title)
    fig.tight_layout()


def plot_communication_bytes(batch_sizes, tensor_parallel, data_parallel, crossover, title, measured=None):
    """Bytes each rank sends per step against the batch size: TP grows with it, DP does not. `measured`: the same two
    series as written to the sockets, drawn dotted next to the formula's."""
    fig, ax = _subplots(figsize=(7, 4.5))
    ax.plot(batch_sizes, tensor_parallel, "o-", color="tab:blue", label="tensor parallel (activations), ring formula")
    ax.plot(batch_sizes, data_parallel, "s--", color="tab:orange", label="data parallel (gradients), ring formula")
    if measured is not None:
        ax.plot(batch_sizes, measured[0], "o:", color="tab:blue", alpha=0.5, label="tensor parallel, at the sockets")
        ax.plot(batch_sizes, measured[1], "s:", color="tab:orange", alpha=0.5, label="data parallel, at the sockets")
    ax.axvline(crossover, color="gray", linestyle=":", label=f"crossover by the formula: batch {crossover:.2f}")
    ax.set_xscale("log", base=2)
    ax.set_yscale("log", base=2)
    ax.set_xticks(batch_sizes, [str(b) for b in batch_sizes])
    ax.minorticks_off()
    ax.set_xlabel("batch size (rows, whole batch)")
    ax.set_ylabel("bytes sent per rank per step")
    ax.set_title(title)
    ax.legend(fontsize=8)
    fig.tight_layout()  # shown by Jupyter at the end of the cell; a script draws nothing


def plot_pipeline_timelines(timelines, title):
    """timelines: {schedule name: events by stage}, each a utils.pipeline.Event (kind "F"/"B"/"W", micro-batch,
    start, end in seconds, piece). One Gantt chart per schedule: stages as rows, forwards blue, backwards
    orange (weight gradients green), labelled by micro-batch (and piece); the gaps are the idle time."""
    from matplotlib.colors import to_rgba
    from matplotlib.patches import Rectangle

    fig, axes = _subplots(len(timelines), 1, figsize=(9, 1.2 + 0.6 * sum(len(t) for t in timelines.values())),
                          squeeze=False)
    colors = {"F": "tab:blue", "B": "tab:orange", "W": "tab:green"}
    for ax, (name, events_by_stage) in zip(axes[:, 0], timelines.items()):
        t0 = min(e.start for events in events_by_stage for e in events)
        for stage, events in enumerate(events_by_stage):
            ax.barh([stage] * len(events), [(e.end - e.start) * 1e3 for e in events],
                    left=[(e.start - t0) * 1e3 for e in events], edgecolor="white",
                    color=[to_rgba(colors[e.kind], 1 / (1 + 0.6 * e.piece)) for e in events])
            for e in events:
                ax.text((e.start + e.end - 2 * t0) / 2 * 1e3, stage, str(e.micro_batch), ha="center", va="center",
                        fontsize=7, color="white")
        ax.set_yticks(range(len(events_by_stage)), [f"stage {s}" for s in range(len(events_by_stage))])
        ax.invert_yaxis()
        ax.set_title(name, fontsize=9)
        ax.set_xlabel("time (ms)")
    kinds = [k for k in colors if any(e.kind == k for t in timelines.values() for es in t for e in es)]
    names = {"F": "forward", "B": "backward" + (" (B)" if "W" in kinds else ""), "W": "weight gradient (W)"}
    fig.legend(handles=[Rectangle((0, 0), 1, 1, color=colors[k]) for k in kinds],
               labels=[names[k] for k in kinds], fontsize=7, loc="upper right")
    fig.suptitle(title, fontsize=10)
    fig.tight_layout()  # shown by Jupyter at the end of the cell; a script draws nothing


def plot_stream_timelines(clocks, title):
    """clocks: {version: utils.modeled_clock.StreamClock}. One Gantt chart per version, two rows: the rank's
    computations (forwards blue, backwards orange, labelled by layer) and its collectives (green, labelled by their
    order, or their name); the gaps in the first row are the exposed communication."""
    fig, axes = _subplots(len(clocks), 1, figsize=(9, 0.6 + 1.1 * len(clocks)), squeeze=False, sharex=True)
    colors = {"F": "tab:blue", "B": "tab:orange"}
    for ax, (name, clock) in zip(axes[:, 0], clocks.items()):
        rows = [(0, [(str(label), s, e, colors.get(str(label)[0], "tab:blue")) for label, s, e in clock.compute]),
                (1, [(str(label), s, e, "tab:green") for label, s, e in clock.communication])]
        for row, bars in rows:
            ax.barh([row] * len(bars), [(e - s) * 1e3 for _, s, e, _ in bars], left=[s * 1e3 for _, s, _, _ in bars],
                    color=[c for *_, c in bars], edgecolor="white")
            for label, s, e, _ in bars:
                ax.text((s + e) / 2 * 1e3, row, label, ha="center", va="center", fontsize=7, color="white")
        ax.set_yticks([0, 1], ["compute", "collectives"])
        ax.invert_yaxis()
        ax.set_title(f"{name}: step {clock.step * 1e3:.1f} ms, {clock.exposed * 1e3:.1f} ms exposed", fontsize=9)
    axes[-1, 0].set_xlabel("time (ms)")
    fig.suptitle(title, fontsize=10)
    fig.tight_layout()  # shown by Jupyter at the end of the cell; a script draws nothing


def plot_idle_shares(rows, title):
    """rows: {schedule: {label: share, or [share by rank]}}, the same labels in each row (e.g. "formula", "modeled",
    "measured"). Grouped bars per schedule, in the labels' order; the shares of each rank as dots over their bar
    (their mean)."""
    fig, ax = _subplots(figsize=(7, 3.2))
    labels = list(next(iter(rows.values())))
    width = 0.8 / len(labels)
    for k, label in enumerate(labels):
        xs = [i + (k - (len(labels) - 1) / 2) * width for i in range(len(rows))]
        values = [row[label] for row in rows.values()]
        means = [sum(v) / len(v) if isinstance(v, list) else v for v in values]
        ax.bar(xs, means, width, label=label)
        for x, v in zip(xs, values):
            if isinstance(v, list):
                ax.plot([x] * len(v), v, "k.", markersize=4)
    ax.set_xticks(range(len(rows)), list(rows))
    ax.set_ylabel("idle share of a step")
    ax.set_title(title, fontsize=10)
    ax.legend(fontsize=8)
    fig.tight_layout()


def plot_memory(rows, title):
    """rows: {version: (measured peak bytes by group, formula bytes)}. Stacked bars, the formula as a black tick."""
    fig, ax = _subplots(figsize=(7, 4.5))
    names = list(rows)
    bottoms = [0.0] * len(names)
    for group, color in (("parameters", "tab:blue"), ("gradients", "tab:orange"), ("optimizer state", "tab:green"),
                         ("gathered", "tab:red")):
        heights = [rows[name][0][group] / 1024 for name in names]
        ax.bar(names, heights, bottom=bottoms, color=color, label=group)
        bottoms = [b + h for b, h in zip(bottoms, heights)]
    ax.scatter(names, [rows[name][1] / 1024 for name in names], marker="_", s=2000, color="black", zorder=3,
               label="formula, fp32 Adam (16, 8+8/N, 4+12/N, 16/N bytes per parameter)")
    ax.set_ylabel("model state at the peak of a step (KB, one rank)")
    ax.set_title(title)
    ax.legend(fontsize=8)
    fig.tight_layout()  # shown by Jupyter at the end of the cell; a script draws nothing


def plot_running_sum_errors(counts, errors):
    """errors: {format: [relative error of a running sum of counts[i] values]}, on log-log axes (notebook 06)."""
    fig, ax = _subplots(figsize=(5, 3))
    for name, e in errors.items():
        ax.loglog(counts, e, "o-", label=name)
    ax.set_xlabel("values summed, one at a time")
    ax.set_ylabel("relative error")
    ax.legend()
    fig.tight_layout()


def plot_reduce_error(world_sizes, errors):
    """The bf16 all-reduce's largest error relative to the largest gradient entry, against the world size."""
    fig, ax = _subplots(figsize=(5, 3))
    ax.plot(world_sizes, errors, "o-")
    ax.set_xlabel("ranks")
    ax.set_xticks(world_sizes)
    ax.set_ylabel("max |bf16 mean - exact| / max |g|")
    ax.set_title("bf16 all-reduce error vs world size")
    fig.tight_layout()


def plot_milliseconds(seconds, ylabel, title, figsize=(5, 3), colors=None):
    """seconds: {name: median seconds}. One bar each, in milliseconds, in the order given."""
    fig, ax = _subplots(figsize=figsize)
    ax.bar(list(seconds), [s * 1e3 for s in seconds.values()], color=colors)
    ax.set_ylabel(ylabel)
    ax.set_title(title)
    fig.tight_layout()


def plot_bytes_per_parameter(rows, title):
    """rows: [(label, state formula, state measured or None, {recompute: activations formula},
    {recompute: activations measured})], in bytes per parameter. For each label two stacked bars, without and
    with recomputation (model state, then activations, by the formula); the measured totals as black dots."""
    fig, ax = _subplots(figsize=(9, 4))
    width = 0.38
    for k, recompute in enumerate((False, True)):
        xs = [i + (k - 0.5) * width for i in range(len(rows))]
        states = [row[1] for row in rows]
        activations = [row[3][recompute] for row in rows]
        ax.bar(xs, states, width, color="tab:blue", label="model state (formula)" if k == 0 else None)
        ax.bar(xs, activations, width, bottom=states, color="tab:orange" if recompute else "tab:red",
               label=f"activations, {'with' if recompute else 'without'} recomputation (formula)")
        measured = [(x, row[2] + row[4][recompute]) for x, row in zip(xs, rows) if row[2] is not None]
        ax.scatter([x for x, _ in measured], [y for _, y in measured], color="black", zorder=3, s=18,
                   label="measured (tracker + saved tensors)" if k == 0 else None)
    ax.set_xticks(range(len(rows)))
    ax.set_xticklabels([row[0] for row in rows], fontsize=8)
    ax.set_ylabel("bytes per parameter, one rank")
    ax.set_title(title)
    ax.legend(fontsize=8)
    fig.tight_layout()  # shown by Jupyter at the end of the cell; a script draws nothing


def plot_gpipe_saved_bytes(micro_batch_counts, peaks, title):
    """peaks: {(stage, recomputed): [peak saved bytes for each micro-batch count]}. One line per stage and variant
    (solid: every activation saved; dashed: each layer recomputed), against m (notebook 06, section 5)."""
    fig, ax = _subplots(figsize=(5.5, 3.5))
    colors = ["tab:blue", "tab:orange", "tab:green", "tab:red"]
    for (stage, recomputed), values in sorted(peaks.items()):
        ax.plot(micro_batch_counts, [v / 1024 for v in values], "o" + ("--" if recomputed else "-"),
                color=colors[stage % len(colors)],
                label=f"stage {stage}, {'each layer recomputed' if recomputed else 'all saved'}")
    ax.set_xticks(micro_batch_counts)
    ax.set_xlabel("micro-batches m (each of the same rows)")
    ax.set_ylim(bottom=0)
    ax.set_ylabel("saved for backward at the peak (KB)")
    ax.set_title(title, fontsize=10)
    ax.legend(fontsize=8)
    fig.tight_layout()  # shown by Jupyter at the end of the cell; a script draws nothing


def plot_units(rows, title):
    """rows: {unit: (collectives per step, bytes per all-gather, peak gathered bytes, peak total bytes)} (notebook 07):
    collectives per step and peak memory, side by side, one bar per unit size."""
    fig, (calls_ax, memory_ax) = _subplots(1, 2, figsize=(8, 3.2))
    names = list(rows)
    calls_ax.bar(names, [rows[n][0] for n in names], color="tab:blue")
    calls_ax.set_ylabel("collectives per step")
    memory_ax.bar(names, [rows[n][3] / 1024 for n in names], color="tab:gray", label="total")
    memory_ax.bar(names, [rows[n][2] / 1024 for n in names], color="tab:red", label="gathered")
    memory_ax.set_ylabel("peak model state (KB, one rank)")
    memory_ax.legend(fontsize=8)
    for ax in (calls_ax, memory_ax):
        ax.set_xlabel("one unit per")
    fig.suptitle(title, fontsize=10)
    fig.tight_layout()  # shown by Jupyter at the end of the cell; a script draws nothing


def plot_plan(cases, memory_gb, title):
    """cases: {label: every estimate of utils.planner (rows)}. Left: memory per device against step time, one dot
    per configuration, those that do not fit faded, the fastest that fits circled, the memory limit dashed. Right:
    the fastest split that fits for each tensor-parallel size, relative to the fastest of all (notebook 12)."""
    fig, (scatter_ax, tp_ax) = _subplots(1, 2, figsize=(12, 4.5), gridspec_kw={"width_ratios": [3, 2]})
    for k, (label, rows) in enumerate(cases.items()):
        color = f"C{k}"
        fits, too_big = [r for r in rows if r["fits"]], [r for r in rows if not r["fits"]]
        scatter_ax.scatter([r["step_s"] for r in too_big], [r["memory_gb"] for r in too_big], s=4, color=color,
                           alpha=0.12)
        scatter_ax.scatter([r["step_s"] for r in fits], [r["memory_gb"] for r in fits], s=6, color=color, label=label)
        best = min(fits, key=lambda r: r["step_s"])
        scatter_ax.scatter([best["step_s"]], [best["memory_gb"]], s=90, facecolors="none", edgecolors="black")
        sizes = sorted({r["tp"] for r in fits})
        fastest = [min(r["step_s"] for r in fits if r["tp"] == tp) / best["step_s"] for tp in sizes]
        tp_ax.plot(sizes, fastest, "o-", color=color, label=label)
    scatter_ax.axhline(memory_gb, color="gray", linestyle="--", label=f"{memory_gb:g} GB per device")
    scatter_ax.set_xscale("log")
    scatter_ax.set_yscale("log")
    scatter_ax.set_xlabel("estimated step time (s, log scale)")
    scatter_ax.set_ylabel("memory per device (GB, log scale)")
    scatter_ax.legend(fontsize=7, markerscale=3, loc="upper right")  # "best" is slow (and warns) on many dots
    tp_ax.set_xscale("log", base=2)
    tp_ax.set_yscale("log")
    tp_ax.set_xlabel("tensor-parallel size tp (beyond 8: across nodes)")
    tp_ax.set_ylabel("fastest split with this tp / fastest of all")
    tp_ax.legend(fontsize=7)
    fig.suptitle(title, fontsize=11)
    fig.tight_layout()  # shown by Jupyter at the end of the cell; a script draws nothing
