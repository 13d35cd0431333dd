"""PNG plots for ``docs/benchmarks.md``: set-up time, bytes broadcast, memory, throughput."""

from __future__ import annotations

import os
from typing import Any

from benchmarks.aggregate import Key

STYLE = {"mdloader": ("tab:blue", "mdloader"), "deepmd": ("tab:red", "DeePMD-kit 3.2.0")}
MARKERS = {1: "o", 2: "s", 4: "^"}


def _series(med: dict[Key, dict[str, float]], impl: str, world: int,
            name: str) -> tuple[list[int], list[float]]:
    pts = sorted((n, v[name]) for (i, n, w), v in med.items()
                 if i == impl and w == world and name in v)
    return [p[0] for p in pts], [p[1] for p in pts]


def _plot_vs_nsys(med: dict, name: str, ylabel: str, title: str, path: str,
                  worlds: list[int] | None = None) -> str | None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    worlds = sorted(worlds or {w for (_i, _n, w) in med}, key=lambda w: (w != 2, w))
    fig, ax = plt.subplots(figsize=(6.4, 4.2))
    shown: list[tuple[int, float]] = []
    for impl, (color, label) in STYLE.items():
        for w in worlds:
            xs, ys = _series(med, impl, w, name)
            if xs and any(y > 0 for y in ys) and visible(xs, ys, shown):
                ax.plot(xs, ys, marker=MARKERS.get(w, "x"), color=color,
                        label=f"{label}, W={w}", alpha=0.5 + 0.5 * (w == 2))
                shown.extend(zip(xs, ys))
    if not shown:
        plt.close(fig)
        return None
    return _finish(plt, fig, ax, path, ylabel, title)


def visible(xs: list[int], ys: list[float], shown: list[tuple[int, float]],
            close: float = 0.05) -> bool:
    """Whether a series has a point that no point already drawn hides (within ``close``, in
    relative terms, on the log axes): a series the legend lists must be seen in the plot."""
    return any(not any(x == sx and abs(y - sy) <= close * max(abs(sy), 1e-12)
                       for sx, sy in shown) for x, y in zip(xs, ys))


def _plot_throughput(med: dict, path: str, world: int = 2) -> str | None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, ax = plt.subplots(figsize=(6.4, 4.2))
    drawn = False
    for impl, (color, label) in STYLE.items():
        for nw, ls in (("nw0", "-"), ("nw2", "--")):
            xs, ys = _series(med, impl, world, f"{nw}_batches_ps")
            if xs:
                ax.plot(xs, ys, ls, marker="o", color=color,
                        label=f"{label}, {nw[2:]} workers")
                drawn = True
    xs, ys = _series(med, "mdloader", world, "raw_bps")
    if xs:
        ax.plot(xs, ys, ":", color="black", label="plain-numpy reads (reference)")
    if not drawn:
        plt.close(fig)
        return None
    return _finish(plt, fig, ax, path, "batches/s per rank",
                   f"Outer DataLoader throughput, W={world}")


def _finish(plt: Any, fig: Any, ax: Any, path: str, ylabel: str, title: str) -> str:
    """Log-log axes against the number of systems, labels, legend; save and close."""
    ax.set_xscale("log")
    ax.set_yscale("log")
    ax.set_xlabel("number of systems")
    ax.set_ylabel(ylabel)
    ax.set_title(title)
    ax.grid(True, which="both", alpha=0.3)
    ax.legend(fontsize=8)
    fig.tight_layout()
    fig.savefig(path, dpi=110)
    plt.close(fig)
    return path


FILES = ("bench_setup.png", "bench_bytes.png", "bench_rss.png", "bench_throughput.png")


def existing(img_dir: str) -> list[str]:
    """The plots already drawn in ``img_dir``, in page order (the page without redrawing)."""
    return [p for name in FILES if os.path.isfile(p := os.path.join(img_dir, name))]


def write_all(med: dict[Key, dict[str, float]], img_dir: str) -> list[str]:
    """Write every plot that has data; return their paths."""
    os.makedirs(img_dir, exist_ok=True)
    j = lambda name: os.path.join(img_dir, name)  # noqa: E731
    made = [
        _plot_vs_nsys(med, "setup_s", "seconds (barrier to barrier)",
                      "Set-up: discovery + build + broadcast", j("bench_setup.png")),
        _plot_vs_nsys(med, "bytes", "bytes broadcast", "Bytes broadcast", j("bench_bytes.png"),
                      worlds=[2]),
        _plot_vs_nsys(med, "rss_growth_rn_mib", "MiB over the import baseline",
                      "RSS growth of a non-zero rank (rank 0 for W=1)", j("bench_rss.png")),
        _plot_throughput(med, j("bench_throughput.png")),
    ]
    return [m for m in made if m]
