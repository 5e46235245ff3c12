"""Repeated, interleaved measurement rounds and their ratios (shared by the e2e scripts).

On a 2-core machine one end-to-end run is noise: a ratio can flip between runs. So every
figure is measured in ``rounds`` rounds; each round runs every setup once, the order rotating
from round to round (so drift and warm-up hit every setup alike); a ratio ``a/b`` is computed
per round (a *pair*) and reported as the median with its range. A claim "a beats b on k" holds
only if *no* pair contradicts it (``wins``).
"""

from __future__ import annotations

import statistics
from collections.abc import Callable, Sequence


def rotation(setups: Sequence[str], r: int) -> list[str]:
    """The order of round ``r`` (from 0): ``setups`` rotated left by ``r``."""
    return list(setups[r % len(setups) :]) + list(setups[: r % len(setups)])


def run_rounds(rounds: int, setups: Sequence[str], run: Callable[[str, int], dict], log=print) -> list[dict]:
    """``run(setup, round)`` for every setup in every round, rotating the order; returns one dict per
    round: ``{setup: run's result, "order": [...]}``."""
    out = []
    for r in range(rounds):
        order = rotation(setups, r)
        result = {"order": order}
        for name in order:
            result[name] = run(name, r)
            log(f"round {r + 1}/{rounds} {name}: " + ", ".join(
                f"{k}={v:.4g}" for k, v in result[name].items() if isinstance(v, (int, float))))  # fmt: skip
        out.append(result)
    return out


def ratio_stats(rounds: Sequence[dict], key: str, num: str, den: str) -> dict:
    """Per-pair ratios ``rounds[i][num][key] / rounds[i][den][key]``: values, median, min, max."""
    values = []
    for r in rounds:
        a, b = r[num][key], r[den][key]
        values.append(a / b if b else float("nan"))
    return value_stats(values)


def value_stats(values: Sequence[float]) -> dict:
    """``values`` as given, and the median, min and max of the finite ones (NaN when none is)."""
    values = list(values)
    finite = [v for v in values if v == v]
    return {
        "values": values,
        "median": statistics.median(finite) if finite else float("nan"),
        "min": min(finite, default=float("nan")),
        "max": max(finite, default=float("nan")),
    }


def wins(stats: dict, median_at_most: float, every_below: float) -> bool:
    """The claim holds: the median ratio is at most ``median_at_most`` and no pair reaches ``every_below``."""
    values = stats["values"]
    return bool(values) and stats["median"] <= median_at_most and all(v < every_below for v in values)


def plot_ratios(doc: dict, keys: Sequence[str], path, title: str, ratio_label: str) -> None:
    """One panel per key: each pair's ratio as a point, the median as a bar, 1.0 as a line."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, axes = plt.subplots(1, len(keys), figsize=(3.2 * len(keys), 3.4))
    for ax, key in zip(axes if len(keys) > 1 else [axes], keys):
        st = doc["ratios"][key]
        ax.bar([0], [st["median"]], color="#2a7", width=0.5)
        ax.scatter([0] * len(st["values"]), st["values"], color="k", s=14, zorder=3)
        ax.axhline(1.0, color="#999", lw=1, ls="--")
        ax.set_xticks([])
        ax.set_title(f"{key}\n{ratio_label} median {st['median']:.2f}\n[{st['min']:.2f}, {st['max']:.2f}]",
                     fontsize=8)  # fmt: skip
    fig.suptitle(title, fontsize=9)
    fig.tight_layout()
    fig.savefig(path, dpi=110)
    plt.close(fig)
