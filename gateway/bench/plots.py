"""Pictures of benchmark results (``--plot FILE.png``) and progress while a benchmark runs.

matplotlib is imported only when a plot is asked for (``pip install -e ".[bench]"``), with the Agg
backend: no display is needed. Progress goes to stderr through tqdm, and only on a terminal, so logs
and CI output keep just the result tables.
"""

from __future__ import annotations

from collections.abc import Iterable, Iterator, Mapping, Sequence
from pathlib import Path
from typing import Any, TypeVar

T = TypeVar("T")

REFERENCE_STYLES = {"lru": ("--", "tab:gray"), "exact-lru": ("--", "tab:gray"), "belady": (":", "black")}
"""How the two reference curves look on a hit-rate plot (every other policy gets a solid colour)."""


def progress(items: Iterable[T], description: str, total: int | None = None) -> Iterator[T]:
    """``items``, with a progress bar on stderr when stderr is a terminal."""
    try:
        from tqdm import tqdm
    except ImportError:  # progress is a nicety; a missing tqdm never stops a benchmark
        yield from items
        return
    yield from tqdm(items, desc=description, total=total, disable=None, leave=False, unit="step")


_CHUNK_OP_MIN_SIZE = 1 << 20
"""Rows of chunk-sized operations are drawn in MB/s; smaller ones (HEAD, exists, prefix) in calls/s."""


def _moves_chunks(row: Mapping[str, Any]) -> bool:
    return int(row["size"]) >= _CHUNK_OP_MIN_SIZE


def _pyplot() -> Any:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    return plt


def plot_hitrate(rows: Sequence[Mapping[str, Any]], out: Path, title: str | None = None) -> Path:
    """Hit rate against cache capacity, one line per policy (LRU and Belady as references).

    ``rows``: the simulator's rows (``trace``, ``policy``, ``capacity_tokens``, ``hit_rate``).
    """
    plt = _pyplot()
    by_policy: dict[str, list[tuple[int, float]]] = {}
    for row in rows:
        by_policy.setdefault(str(row["policy"]), []).append((int(row["capacity_tokens"]), float(row["hit_rate"])))
    fig, ax = plt.subplots(figsize=(7.5, 4.8), dpi=110)
    for policy, points in sorted(by_policy.items(), key=lambda kv: kv[0] in REFERENCE_STYLES):
        points.sort()
        style, colour = REFERENCE_STYLES.get(policy, ("-", None))
        ax.plot([p[0] for p in points], [p[1] for p in points], style, color=colour, marker="o", markersize=4,
                label=policy, linewidth=2 if policy not in REFERENCE_STYLES else 1.5)
    ax.set_xscale("log")
    ax.set_xlabel("cache capacity (tokens)")
    ax.set_ylabel("token-weighted prefix hit rate")
    traces = sorted({str(row["trace"]) for row in rows})
    ax.set_title(title or f"kvgw bench trace: {', '.join(traces)}")
    ax.set_ylim(bottom=0)
    ax.grid(True, which="both", alpha=0.3)
    ax.legend()
    fig.tight_layout()
    fig.savefig(out)
    plt.close(fig)
    return out


def plot_io(figures: Sequence[Mapping[str, Any]], out: Path, title: str = "kvgw bench io") -> Path:
    """Throughput against concurrency for each (operation, size), kvgw beside its baselines.

    ``figures``: ``kvgw bench io``'s medians (``target``, ``op``, ``size``, ``clients``, ``bytes_per_s``,
    ``ops_per_s``). Byte-moving operations are plotted in MB/s, small calls in calls per second.
    """
    plt = _pyplot()
    panels: dict[tuple[str, int], dict[str, list[tuple[int, float]]]] = {}
    for fig_row in figures:
        key = (str(fig_row["op"]), int(fig_row["size"]))
        rate = float(fig_row["bytes_per_s"]) / 1e6 if _moves_chunks(fig_row) else float(fig_row["ops_per_s"])
        panels.setdefault(key, {}).setdefault(str(fig_row["target"]), []).append((int(fig_row["clients"]), rate))
    count = max(1, len(panels))
    cols = min(3, count)
    rows = (count + cols - 1) // cols
    fig, axes = plt.subplots(rows, cols, figsize=(4.6 * cols, 3.6 * rows), dpi=110, squeeze=False)
    for ax, ((op, size), targets) in zip(axes.flat, sorted(panels.items()), strict=False):
        moves_bytes = size >= _CHUNK_OP_MIN_SIZE
        for target, points in sorted(targets.items(), key=lambda kv: not kv[0].startswith("kvgw")):
            points.sort()
            ax.plot([p[0] for p in points], [p[1] for p in points], marker="o", label=target,
                    linewidth=2.2 if target.startswith("kvgw") else 1.4)
        ax.set_title(f"{op} {size / (1 << 20):g} MiB" if size >= 1 << 20 else f"{op}")
        ax.set_xlabel("concurrent clients")
        ax.set_ylabel("MB/s" if moves_bytes else "calls/s")
        ax.set_xscale("log", base=2)
        ticks = sorted({p[0] for points in targets.values() for p in points})
        ax.set_xticks(ticks, [str(t) for t in ticks])
        ax.minorticks_off()
        ax.set_ylim(bottom=0)
        ax.grid(True, alpha=0.3)
        ax.legend(fontsize=8)
    for ax in list(axes.flat)[count:]:
        ax.set_visible(False)
    fig.suptitle(title)
    fig.tight_layout()
    fig.savefig(out)
    plt.close(fig)
    return out
