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
