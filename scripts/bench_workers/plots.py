"""Benchmark plots with matplotlib (the optional ``[bench]`` extra; ``make bench`` installs it): PNG files only.

Two kinds, sharing one line-plot function:

* :func:`memory_vs_rows`: server memory against rows seen, log-log (scripts/bench.py, ``memory_vs_rows.png``);
* :func:`memory_over_time`: server memory against time in seconds, with marked events (for scenarios that
  evict or tier rows: what memory does while a job runs).

A series is a dict: ``x``, ``y`` (lists; None or, on a log axis, non-positive points are skipped), ``label``,
optional ``color`` (a matplotlib colour; "blue", "green", ... are the tab10 colours), ``dash`` (a dashed line,
e.g. stock or extrapolated values) and ``marker`` (dots at the points, default on).
"""
from __future__ import annotations

from pathlib import Path

TAB10 = {"blue", "orange", "green", "red", "purple", "brown", "pink", "gray", "grey", "olive", "cyan"}


def _pyplot():
    try:
        import matplotlib
    except ImportError:
        raise SystemExit("the benchmark plots need matplotlib: pip install 'kvstore-lazy[bench]' "
                         "(make bench installs it)") from None
    matplotlib.use("Agg")       # files only, no display
    import matplotlib.pyplot as plt
    return plt


def _color(name):
    if isinstance(name, str) and name in TAB10:
        return "tab:" + ("gray" if name == "grey" else name)
    return name


def _mib(value, _pos=None) -> str:
    """Axis labels for MiB values: 512 MiB, 1 GiB, 1.5 GiB."""
    if value >= 1024:
        return f"{value / 1024:g} GiB"
    return f"{value:g} MiB"


def _count(value, _pos=None) -> str:
    for div, suffix in ((1e9, "G"), (1e6, "M"), (1e3, "k")):
        if abs(value) >= div:
            return f"{value / div:g}{suffix}"
    return f"{value:g}"


def line_plot(path, series: list[dict], *, title: str, xlabel: str, ylabel: str, logx: bool = False,
              logy: bool = False, xformat=None, yformat=None, ybase: int = 10, hlines=(), vlines=(),
              notes=()) -> Path:
    """Write a line plot to ``path`` (PNG). ``hlines``/``vlines``: (value, label) reference lines; ``notes``: lines
    of text under the plot; ``ybase``: the tick base of a log y axis (2 for MiB: 256 MiB, 512 MiB, 1 GiB...)."""
    from matplotlib.ticker import FuncFormatter, LogLocator, NullFormatter

    plt = _pyplot()
    fig, ax = plt.subplots(figsize=(10, 6.2), dpi=110, layout="constrained")
    try:
        for s in series:
            pts = [(x, y) for x, y in zip(s["x"], s["y"]) if x is not None and y is not None
                   and (x > 0 or not logx) and (y > 0 or not logy)]
            if not pts:
                continue
            xs, ys = zip(*pts)
            ax.plot(xs, ys, label=s.get("label"), color=_color(s.get("color")), linewidth=2,
                    linestyle="--" if s.get("dash") else "-", marker="o" if s.get("marker", True) else None,
                    markersize=4)
        box = {"boxstyle": "round,pad=0.2", "facecolor": "white", "edgecolor": "none", "alpha": 0.85}
        for value, label in hlines:
            ax.axhline(value, color="0.45", linestyle=":", linewidth=1.5)
            ax.annotate(label, (0.01, value), xycoords=("axes fraction", "data"), xytext=(0, -4),
                        textcoords="offset points", color="0.25", fontsize=9, va="top", bbox=box)
        for value, label in vlines:
            ax.axvline(value, color="0.45", linestyle=":", linewidth=1.5)
            ax.annotate(label, (value, 0.02), xycoords=("data", "axes fraction"), xytext=(4, 0),
                        textcoords="offset points", color="0.25", fontsize=9, rotation=90, va="bottom",
                        bbox=box)
        if not logy:
            ax.set_ylim(bottom=0)
        if logx:
            ax.set_xscale("log")
        if logy:
            ax.set_yscale("log", base=ybase)
            if ybase != 10:
                ax.yaxis.set_major_locator(LogLocator(base=ybase))
                ax.yaxis.set_minor_formatter(NullFormatter())
        if xformat:
            ax.xaxis.set_major_formatter(FuncFormatter(xformat))
        if yformat:
            ax.yaxis.set_major_formatter(FuncFormatter(yformat))
        ax.set_title(title, fontsize=13)
        ax.set_xlabel(xlabel)
        ax.set_ylabel(ylabel)
        ax.grid(True, which="major", color="0.88")
        if any(s.get("label") for s in series):
            ax.legend(loc="best", fontsize=9, framealpha=0.9)
        if notes:
            fig.text(0.01, 0.005, "\n".join(notes), fontsize=8, color="0.25", va="bottom", wrap=True)
            fig.get_layout_engine().set(rect=(0, 0.03 + 0.025 * len(notes), 1, 1 - 0.03 - 0.025 * len(notes)))
        path = Path(path)
        fig.savefig(path)
        return path
    finally:
        plt.close(fig)


def memory_vs_rows(path, series: list[dict], *, title: str = "Server memory vs rows seen",
                   budget_mib: float | None = None, notes=()) -> Path:
    """Server RSS (MiB) against rows seen, log-log; ``budget_mib`` draws a memory budget line."""
    hlines = [(budget_mib, f"budget {_mib(budget_mib)}")] if budget_mib else []
    return line_plot(path, series, title=title, xlabel="rows seen (distinct row ids the workers touched)",
                     ylabel="server RSS", logx=True, logy=True, xformat=_count, yformat=_mib, ybase=2,
                     hlines=hlines, notes=notes)


def memory_over_time(path, series: list[dict], *, title: str = "Server memory over time", events=(),
                     budget_mib: float | None = None, notes=()) -> Path:
    """Server RSS (MiB) against seconds since the job started; ``events``: (seconds, label) marks such as
    "eviction starts" or "server restarted"."""
    hlines = [(budget_mib, f"budget {_mib(budget_mib)}")] if budget_mib else []
    return line_plot(path, series, title=title, xlabel="time since the job started (s)", ylabel="server RSS",
                     yformat=_mib, hlines=hlines, vlines=events, notes=notes)
