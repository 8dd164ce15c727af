"""PNG plots for the client benchmarks (matplotlib, Agg backend: no display needed)."""

from __future__ import annotations

from pathlib import Path


def _pyplot():
    import matplotlib

    matplotlib.use("Agg")  # headless machines and CI have no display
    import matplotlib.pyplot as plt

    return plt


def _models(report: dict) -> str:
    return ", ".join(
        dict.fromkeys(
            str(ep.get("model") or ep["endpoint"].get("model_id") or "?")
            for ep in report["endpoints"]
        )
    )


def _caption(report: dict, n: str) -> str:
    """Model, machine and sample size: every figure names what it measured, where, and how often."""
    return f"{_models(report)} | {report.get('machine') or 'machine not recorded'} | {n}"


def _label_points(ax, xs, ys, fmt: str = "{:.2f}") -> None:
    for x, y in zip(xs, ys):
        ax.annotate(
            fmt.format(y),
            (x, y),
            textcoords="offset points",
            xytext=(0, 5),
            ha="center",
            fontsize=7,
        )


def plot_ttft(report: dict, path: Path) -> None:
    """Grouped bars: one group per scenario, one bar per endpoint (p50), whisker up to p95."""
    plt = _pyplot()
    endpoints = report["endpoints"]
    scenarios = list(dict.fromkeys(s for ep in endpoints for s in ep["scenarios"]))
    width = 0.8 / max(1, len(endpoints))
    fig, ax = plt.subplots(figsize=(7, 4))
    for i, ep in enumerate(endpoints):
        xs, p50, err = [], [], []
        for j, s in enumerate(scenarios):
            t = ep["scenarios"].get(s, {}).get("ttft_ms", {})
            if t.get("p50") is None:
                continue
            xs.append(j + (i - (len(endpoints) - 1) / 2) * width)
            p50.append(t["p50"])
            err.append(t["p95"] - t["p50"])
        bars = ax.bar(
            xs, p50, width, yerr=[[0] * len(err), err], capsize=3, label=ep["endpoint"]["name"]
        )
        ax.bar_label(bars, labels=[f"{v:.0f}" for v in p50], fontsize=7, padding=2)
    ax.set_xticks(range(len(scenarios)), scenarios)
    ax.set_ylabel("TTFT ms (bar and label p50, whisker p95)")
    cfg = report["config"]
    ax.set_title(
        "Time to first token by cache scenario\n"
        + _caption(report, f"n = {cfg.get('rounds')} rounds x {cfg.get('docs')} docs"),
        fontsize=9,
    )
    ax.legend()
    fig.tight_layout()
    fig.savefig(path, dpi=120)
    plt.close(fig)


def plot_quality_vs_ttft(report: dict, path: Path) -> None:
    """Mean TTFT against task F1 (left) and against Rouge-L of the answer vs full prefill's (right),
    one point per (endpoint, mode), values printed. Where the model cannot answer the task (F1 near
    0 for every mode) the right panel is what tells the modes apart."""
    plt = _pyplot()
    fig, axes = plt.subplots(1, 2, figsize=(11, 4))
    panels = (("f1", "task F1"), ("agree_rougeL", "answer Rouge-L vs full prefill"))
    for ax, (metric, label) in zip(axes, panels):
        for ep in report["endpoints"]:
            pts = [
                (m["ttft_ms"]["mean"], m.get(metric), name)
                for name, m in ep["modes"].items()
                if m["ttft_ms"]["mean"] is not None and m.get(metric) is not None
            ]
            if not pts:
                continue
            ax.plot([p[0] for p in pts], [p[1] for p in pts], "o", label=ep["endpoint"]["name"])
            for x, y, name in pts:
                ax.annotate(
                    f"{name} {y:.2f}", (x, y), textcoords="offset points", xytext=(4, 4), fontsize=7
                )
        ax.set_xlabel("mean TTFT (ms)")
        ax.set_ylabel(label)
        ax.set_ylim(-0.05, 1.1)
    if _all_near_zero(report, "f1"):
        axes[0].set_title("F1 ~ 0 for every mode: the model cannot answer this data", fontsize=9)
    axes[1].set_title("agreement with full prefill (1 = same answer)", fontsize=9)
    axes[0].legend(fontsize=8)
    n = report["config"].get("examples")
    fig.suptitle(
        f"Quality vs TTFT ({report['config'].get('data', '')}) | "
        + _caption(report, f"n = {n} examples"),
        fontsize=9,
    )
    fig.tight_layout()
    fig.savefig(path, dpi=120)
    plt.close(fig)


def _all_near_zero(report: dict, metric: str, eps: float = 0.05) -> bool:
    values = [m.get(metric) for ep in report["endpoints"] for m in ep["modes"].values()]
    values = [v for v in values if v is not None]
    return bool(values) and max(values) < eps


def plot_load(report: dict, path: Path) -> None:
    """Two panels against offered rate: achieved throughput, and TTFT p50/p95, one line per mode."""
    plt = _pyplot()
    fig, (ax_tp, ax_lat) = plt.subplots(1, 2, figsize=(10, 4))
    for ep in report["endpoints"]:
        for mode, runs in ep["modes"].items():
            label = f"{ep['endpoint']['name']} {mode}" if len(report["endpoints"]) > 1 else mode
            rates = [r["rate"] for r in runs]
            ax_tp.plot(rates, [r["throughput_rps"] for r in runs], "o-", label=label)
            p50 = [r["ttft_ms"]["p50"] for r in runs]
            (line,) = ax_lat.plot(rates, p50, "o-", label=f"{label} p50")
            _label_points(ax_lat, rates, p50, "{:.0f}")
            _label_points(ax_tp, rates, [r["throughput_rps"] for r in runs])
            ax_lat.plot(
                rates,
                [r["ttft_ms"]["p95"] for r in runs],
                "s--",
                color=line.get_color(),
                label=f"{label} p95",
            )
            knee = ep["knees"].get(mode)
            if knee is not None:
                ax_tp.axvline(knee, color=line.get_color(), alpha=0.3)
    top = max(
        (r["rate"] for ep in report["endpoints"] for runs in ep["modes"].values() for r in runs),
        default=1,
    )
    ax_tp.plot([0, top], [0, top], ":", color="grey", label="offered")
    ax_tp.set_xlabel("offered rate (req/s)")
    ax_tp.set_ylabel("throughput (req/s)")
    ax_lat.set_xlabel("offered rate (req/s)")
    ax_lat.set_ylabel("TTFT ms")
    ax_lat.set_yscale("log")
    ax_tp.legend(fontsize=8)
    ax_lat.legend(fontsize=8)
    cfg = report["config"]
    fig.suptitle(
        "Open-loop load (vertical line: knee) | "
        + _caption(
            report,
            f"n = {cfg.get('requests', '?')} requests a rate, {cfg.get('n_docs', '?')} docs each",
        ),
        fontsize=9,
    )
    fig.tight_layout()
    fig.savefig(path, dpi=120)
    plt.close(fig)


def _data_name(result: dict) -> str:
    data = result.get("data") or "musique"
    return "MuSiQue" if data == "musique" else Path(str(data)).stem


def _blend_label(selection: str) -> str:
    return "blend" if selection == "deviation" else f"blend/{selection}"


def plot_engine(result: dict, path: Path) -> None:
    """`bench engine` against the recompute ratio (reuse at 0, full at 1): left, speedup over full
    prefill; right, first-token agreement and F1 as a share of full's."""
    plt = _pyplot()
    curve = result["quality_vs_ratio"]
    blend_points = [
        p for p in curve if p["mode"] == "blend"
    ]  # quality_curve gives each its selection
    lines = {
        sel: [p for p in blend_points if p["selection"] == sel]
        for sel in dict.fromkeys(p["selection"] for p in blend_points)
    }  # one line per token selection
    ends = [p for p in curve if p["mode"] != "blend"]
    fig, (left, right) = plt.subplots(1, 2, figsize=(10, 4))
    for sel, blend in lines.items():
        xs, ys = [p["ratio"] for p in blend], [p["speedup_vs_full"] for p in blend]
        left.plot(xs, ys, "o-", label=_blend_label(sel))
        _label_points(left, xs, ys, "{:.1f}x")
    for p in ends:
        left.plot([p["ratio"]], [p["speedup_vs_full"]], "s", label=p["name"])
    left.set_yscale("log")
    left.set_xlabel("recompute ratio")
    left.set_ylabel("median TTFT speedup vs full (log)")
    left.legend()
    for metric, label, color in (
        ("first_token_agreement", "first-token agreement", "tab:blue"),
        ("f1_share_of_full", "F1 / full's F1", "tab:green"),
    ):
        pts = [p for p in curve if p[metric] is not None]
        for sel, style in zip(lines, ("o-", "^--", "v:")):
            blend = [p for p in lines[sel] if p[metric] is not None]
            xs, ys = [p["ratio"] for p in blend], [p[metric] for p in blend]
            right.plot(xs, ys, style, color=color, label=f"{_blend_label(sel)}: {label}")
            _label_points(right, xs, ys)
        for mode, marker in (("reuse", "x"), ("full", "s")):
            at = [p for p in pts if p["mode"] == mode]
            if at:  # a mode the run left out gets no legend entry
                right.plot(
                    [p["ratio"] for p in at],
                    [p[metric] for p in at],
                    marker,
                    color=color,
                    markersize=8,
                    label=f"{mode}: {label}",
                )
    right.axhline(0.9, color="grey", linestyle=":", linewidth=1)
    right.set_xlabel("recompute ratio")
    right.set_ylabel("vs full prefill")
    right.legend(fontsize=8)
    where = result.get("device_name") or result.get("device", "cpu")
    threads = f", {result['threads']} threads" if result.get("threads") else ""
    fig.suptitle(
        f"bench engine: {result['model']} ({result['dtype']}) | {where}{threads} | "
        f"n = {result['examples']} {_data_name(result)} examples",
        fontsize=9,
    )
    fig.tight_layout()
    fig.savefig(path, dpi=120)
    plt.close(fig)


def plot_pareto(runs: list[dict], path: Path) -> None:
    """The TTFT-vs-fidelity front of `bench engine` runs, one panel per run (model and data): x the
    paired median speed-up over full prefill, y the mean first-token KL vs full (log; lower is
    better), each point labelled with its policy and first-token agreement."""
    plt = _pyplot()
    fig, axes = plt.subplots(1, len(runs), figsize=(5.2 * len(runs), 4.4), squeeze=False)
    for ax, result in zip(axes[0], runs):
        rows = [
            r
            for r in result["modes"]
            if r["mode"] != "full" and r.get("first_token_kl_vs_full") is not None
        ]
        for sel in dict.fromkeys(_row_sel(r) for r in rows):
            pts = sorted((r for r in rows if _row_sel(r) == sel), key=lambda r: r["ratio"])
            xs = [r.get("speedup_paired_median") or r["speedup_vs_full"] for r in pts]
            ys = [max(r["first_token_kl_vs_full"], 1e-4) for r in pts]
            ax.plot(xs, ys, "o-" if sel != "reuse" else "x", label=sel)
            for x, y, r in zip(xs, ys, pts):
                ax.annotate(
                    f"{r['name']}\n{r['first_token_agreement']:.0%} agree",
                    (x, y),
                    textcoords="offset points",
                    xytext=(4, 4),
                    fontsize=6,
                )
        ax.axvline(3.0, color="grey", linestyle=":", linewidth=1)
        ax.axhline(0.1, color="grey", linestyle=":", linewidth=1)
        ax.set_xscale("log")
        ax.set_yscale("log")
        ax.set_xlabel("paired TTFT speed-up vs full prefill (log)")
        ax.set_ylabel("mean first-token KL vs full (log)")
        where = result.get("device_name") or result.get("device", "cpu")
        ax.set_title(
            f"{result['model']} ({result['dtype']})\n{where}, {result.get('threads', '?')} threads"
            f" | n = {result['examples']} {_data_name(result)}"
            f" | {len(result.get('files', [1]))} run(s)",
            fontsize=8,
        )
        ax.legend(fontsize=7)
    fig.tight_layout()
    fig.savefig(path, dpi=120)
    plt.close(fig)


def _row_sel(row: dict) -> str:
    if row["mode"] != "blend":
        return row["mode"]
    return _blend_label(row.get("selection") or "deviation")
