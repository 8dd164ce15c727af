"""PNG plots for the client benchmarks (matplotlib, Agg backend: no display needed)."""

from __future__ import annotations

from pathlib import Path


def _pyplot():
    import matplotlib

    matplotlib.use("Agg")  # headless machines and CI have no display
    import matplotlib.pyplot as plt

    return plt


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
        ax.bar(xs, p50, width, yerr=[[0] * len(err), err], capsize=3, label=ep["endpoint"]["name"])
    ax.set_xticks(range(len(scenarios)), scenarios)
    ax.set_ylabel("TTFT ms (bar p50, whisker p95)")
    ax.set_title("Time to first token by cache scenario")
    ax.legend()
    fig.tight_layout()
    fig.savefig(path, dpi=120)
    plt.close(fig)


def plot_quality_vs_ttft(report: dict, path: Path) -> None:
    """One point per (endpoint, mode): mean TTFT against F1, labelled with the mode."""
    plt = _pyplot()
    fig, ax = plt.subplots(figsize=(6, 4))
    for ep in report["endpoints"]:
        pts = [(m["ttft_ms"]["mean"], m["f1"], name) for name, m in ep["modes"].items()
               if m["ttft_ms"]["mean"] is not None and m["f1"] is not None]
        if not pts:
            continue
        ax.plot([p[0] for p in pts], [p[1] for p in pts], "o", label=ep["endpoint"]["name"])
        for x, y, name in pts:
            ax.annotate(name, (x, y), textcoords="offset points", xytext=(4, 4), fontsize=8)
    ax.set_xlabel("mean TTFT (ms)")
    ax.set_ylabel("F1")
    ax.set_title(f"Quality vs TTFT ({report['config'].get('data', '')})")
    ax.legend()
    fig.tight_layout()
    fig.savefig(path, dpi=120)
    plt.close(fig)


def plot_load(report: dict, path: Path) -> None:
    """Two panels against offered rate: achieved throughput, and TTFT p50/p95, one line per mode."""
    plt = _pyplot()
    fig, (ax_tp, ax_lat) = plt.subplots(1, 2, figsize=(10, 4))
    for ep in report["endpoints"]:
        for mode, runs in ep["modes"].items():
            label = f"{ep['endpoint']['name']} {mode}" if len(report["endpoints"]) > 1 else mode
            rates = [r["rate"] for r in runs]
            ax_tp.plot(rates, [r["throughput_rps"] for r in runs], "o-", label=label)
            line, = ax_lat.plot(rates, [r["ttft_ms"]["p50"] for r in runs], "o-", label=f"{label} p50")
            ax_lat.plot(rates, [r["ttft_ms"]["p95"] for r in runs], "s--", color=line.get_color(),
                        label=f"{label} p95")
            knee = ep["knees"].get(mode)
            if knee is not None:
                ax_tp.axvline(knee, color=line.get_color(), alpha=0.3)
    top = max((r["rate"] for ep in report["endpoints"] for runs in ep["modes"].values() for r in runs), default=1)
    ax_tp.plot([0, top], [0, top], ":", color="grey", label="offered")
    ax_tp.set_xlabel("offered rate (req/s)")
    ax_tp.set_ylabel("throughput (req/s)")
    ax_lat.set_xlabel("offered rate (req/s)")
    ax_lat.set_ylabel("TTFT ms")
    ax_lat.set_yscale("log")
    ax_tp.legend(fontsize=8)
    ax_lat.legend(fontsize=8)
    fig.suptitle("Open-loop load (vertical line: knee)")
    fig.tight_layout()
    fig.savefig(path, dpi=120)
    plt.close(fig)


def _blend_label(selection: str) -> str:
    return "blend" if selection == "deviation" else f"blend/{selection}"


def plot_engine(result: dict, path: Path) -> None:
    """`bench engine` against the recompute ratio (reuse at 0, full at 1): left, speedup over full
    prefill; right, first-token agreement and F1 as a share of full's."""
    plt = _pyplot()
    curve = result["quality_vs_ratio"]
    blend_points = [p for p in curve if p["mode"] == "blend"]  # quality_curve gives each its selection
    lines = {sel: [p for p in blend_points if p["selection"] == sel]
             for sel in dict.fromkeys(p["selection"] for p in blend_points)}  # one line per token selection
    ends = [p for p in curve if p["mode"] != "blend"]
    fig, (left, right) = plt.subplots(1, 2, figsize=(10, 4))
    for sel, blend in lines.items():
        left.plot([p["ratio"] for p in blend], [p["speedup_vs_full"] for p in blend], "o-", label=_blend_label(sel))
    for p in ends:
        left.plot([p["ratio"]], [p["speedup_vs_full"]], "s", label=p["name"])
    left.set_yscale("log")
    left.set_xlabel("recompute ratio")
    left.set_ylabel("median TTFT speedup vs full (log)")
    left.legend()
    for metric, label, color in (("first_token_agreement", "first-token agreement", "tab:blue"),
                                 ("f1_share_of_full", "F1 / full's F1", "tab:green")):
        pts = [p for p in curve if p[metric] is not None]
        for sel, style in zip(lines, ("o-", "^--", "v:")):
            blend = [p for p in lines[sel] if p[metric] is not None]
            right.plot([p["ratio"] for p in blend], [p[metric] for p in blend], style, color=color,
                       label=f"{_blend_label(sel)}: {label}")
        for mode, marker in (("reuse", "x"), ("full", "s")):
            at = [p for p in pts if p["mode"] == mode]
            if at:  # a mode the run left out gets no legend entry
                right.plot([p["ratio"] for p in at], [p[metric] for p in at], marker, color=color, markersize=8,
                           label=f"{mode}: {label}")
    right.axhline(0.9, color="grey", linestyle=":", linewidth=1)
    right.set_xlabel("recompute ratio")
    right.set_ylabel("vs full prefill")
    right.legend(fontsize=8)
    fig.suptitle(f"bench engine: {result['model']} ({result['dtype']}), {result['examples']} MuSiQue examples")
    fig.tight_layout()
    fig.savefig(path, dpi=120)
    plt.close(fig)
