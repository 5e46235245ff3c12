"""PNG figures for simulator results (matplotlib, headless)."""

from __future__ import annotations

from pathlib import Path
from typing import Any

import matplotlib

matplotlib.use("Agg")
import matplotlib.pyplot as plt  # noqa: E402

__all__ = ["plot_result", "plot_speed"]

_METRICS = [
    ("P99 TTFT (s)", lambda o: o["ttft_s"]["p99"]),
    ("P99 TBT (s)", lambda o: o["tbt_s"]["p99"]),
    ("SLO attainment", lambda o: o["slo"]["attainment"]),
    ("throughput (tok/s)", lambda o: o["throughput_tokens_per_s"]),
]


def _v(x):
    return float("nan") if x is None else x


def plot_result(obj: dict[str, Any], png: Path) -> None:
    """Metrics per variant (bars, or lines against the arrival rate when the
    scenario sweeps rates) and KV utilisation / queue length over time."""
    results = obj["results"]
    fig, axes = plt.subplots(2, 3, figsize=(15, 8))
    sweep = any(len(per) > 1 for per in results.values())
    for ax, (label, get) in zip(axes.flat[:4], _METRICS):
        if sweep:
            for name, per in results.items():
                ax.plot(
                    [p["total_rate_rps"] for p in per], [_v(get(p["overall"])) for p in per], marker="o", label=name
                )
            ax.set_xlabel("arrival rate (req/s)")
        else:
            names = list(results)
            ax.bar(
                names,
                [_v(get(results[n][0]["overall"])) for n in names],
                color=[f"C{i % 10}" for i in range(len(names))],
            )
            if len(names) > 4:  # many variants: slanted labels
                ax.tick_params(axis="x", labelrotation=35, labelsize=7)
                for t in ax.get_xticklabels():
                    t.set_horizontalalignment("right")
        ax.set_title(label)
        ax.grid(alpha=0.3)
    if sweep:
        axes.flat[0].legend()
    for ax, key, label in ((axes.flat[4], "kv_util", "KV utilisation"), (axes.flat[5], "waiting", "waiting requests")):
        for vi, (name, tl) in enumerate(obj["timeline"].items()):
            for ii, (inst, series) in enumerate(tl["instances"].items()):
                ax.plot(
                    tl["t"],
                    series[key],
                    color=f"C{vi % 10}",
                    alpha=max(1.0 - 0.25 * ii, 0.2),
                    lw=0.8,
                    label=f"{name}/{inst}",
                )
        ax.set_title(label + (" (highest rate)" if sweep else ""))
        ax.set_xlabel("simulated time (s)")
        ax.grid(alpha=0.3)
    n_lines = sum(len(tl["instances"]) for tl in obj["timeline"].values())
    if n_lines <= 12:
        axes.flat[4].legend(fontsize=7)
    else:  # one entry per variant (colour); models are shades of it, in file order
        from matplotlib.lines import Line2D

        tls = obj["timeline"]
        handles = [Line2D([], [], color=f"C{vi % 10}", lw=1.5) for vi in range(len(tls))]
        models = next(iter(tls.values()))["instances"]
        axes.flat[4].legend(
            handles, list(tls), fontsize=6, ncol=2, title="shade: " + ", ".join(models), title_fontsize=6
        )
    fig.suptitle(f"{obj['scenario']} — {obj['where']}\n{obj['command']}", fontsize=9)
    fig.tight_layout()
    png.parent.mkdir(parents=True, exist_ok=True)
    fig.savefig(png, dpi=90)
    plt.close(fig)


def plot_speed(obj: dict[str, Any], png: Path) -> None:
    fig, axes = plt.subplots(1, 2, figsize=(11, 4))
    ax = axes[0]
    ax.bar(["wall time", "target"], [obj["wall_s"], obj["target_s"]], color=["C0", "C3"])
    ax.set_ylabel("seconds")
    ax.set_title(
        f"{obj['simulated_s']:.0f} s simulated: {obj['wall_s']:.1f} s wall ({obj['ratio_to_target']:.2f} x target)"
    )
    ax = axes[1]
    tl = obj["timeline"]
    for name, series in tl["instances"].items():
        ax.plot(tl["t"], series["kv_util"], lw=0.7, label=name)
    ax.set_title("KV utilisation")
    ax.set_xlabel("simulated time (s)")
    ax.legend(fontsize=7)
    fig.suptitle(obj["command"], fontsize=9)
    fig.tight_layout()
    png.parent.mkdir(parents=True, exist_ok=True)
    fig.savefig(png, dpi=90)
    plt.close(fig)
