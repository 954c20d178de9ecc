"""The saturation scenario's figures from the load generator's records: the table rows, the knees, the targets, the
results.json object and the latency plot.

Owns: what the scenario reports (``build``): per (server, mode, N, B) the closed-loop saturation point (rows/s,
server cores, rows/s per server core, server CPU per row, p50/p99 step latency), the open-loop curve of latency
against offered load and its knee (the lowest offered load whose p99 is at least twice the light-load p99), the
dense 2x3 light-load latency, and the issue's targets checked against them. results.json's ``"saturation"``
object: ``gather_limit_rows_per_s`` and ``rows`` in the shape the issue fixes, then ``curves``, ``dense``,
``targets``, ``gather`` beside them.
Does not own: running anything (``scripts/bench.py``, ``loadgen_job``) or the text layout of a table (bench's
``table``).

"Rows" are the rows of a step (B rows pulled, then the same B rows' gradients pushed): rows/s = B x steps/s,
summed over the workers; a server handles each row twice per step (a gather for the pull, an update for the push).
"""
from __future__ import annotations

from pathlib import Path

TARGET_CONFIG = {"workers": 8, "batch": 8192}
LIGHT_LEVEL, LOAD_LEVEL = 0.1, 0.8


def _count(value, _pos=None) -> str:
    """Axis labels for rows/s: 100k, 2M."""
    for div, suffix in ((1e9, "G"), (1e6, "M"), (1e3, "k")):
        if abs(value) >= div:
            return f"{value / div:g}{suffix}"
    return f"{value:g}"


def _fmt(x, spec: str = ",.0f", suffix: str = "") -> str:
    return "-" if x is None else f"{x:{spec}}{suffix}"


def _per_core(r: dict) -> float | None:
    return r["rows_per_s"] / r["server_cores"] if r.get("server_cores") else None


def knee(points: list[dict]) -> dict | None:
    """The lowest-load point whose p99 is at least twice the lightest point's p99 (None: p99 never doubled)."""
    pts = sorted((p for p in points if p.get("p99_ms") is not None), key=lambda p: p["offered_rows_per_s"])
    if len(pts) < 2:
        return None
    return next((p for p in pts[1:] if p["p99_ms"] >= 2 * pts[0]["p99_ms"]), None)


def collect(jobs: list[dict]) -> tuple[list[dict], list[dict], list[dict]]:
    """From each job ({"server": "ours"|"stock", "mode", "workers", "records"}): the saturation rows, the open-loop
    curves and the dense phases."""
    rows, curves, dense = [], [], []
    for job in jobs:
        tag = {"server": job["server"], "mode": job["mode"], "workers": job["workers"]}
        by_batch: dict[int, list[dict]] = {}
        for r in job["records"]:
            if r.get("kind") == "phase":
                by_batch.setdefault(r["batch"], []).append(r)
            elif r.get("kind") == "dense":
                dense.append({**tag, "p50_ms": r["p50_ms"], "p99_ms": r["p99_ms"],
                              "steps_per_s": r["steps"] / r["seconds"], "errors": r["errors"]})
        for batch, phases in sorted(by_batch.items()):
            closed = next((p for p in phases if p["pacing"] == "closed"), None)
            if closed is None:
                continue
            rows.append({**tag, "batch": batch, "rows_per_s": closed["rows_per_s"],
                         "server_cores": closed["server_cores"], "p50_ms": closed["p50_ms"],
                         "p99_ms": closed["p99_ms"]})
            points = [{k: p[k] for k in ("level", "offered_rows_per_s", "rows_per_s", "p50_ms", "p99_ms",
                                         "server_cores", "loadgen_cores", "held_starts")}
                      for p in phases if p["pacing"] == "open"]
            errors = [e for p in phases for e in p["errors"]]
            curves.append({**tag, "batch": batch, "points": points, "knee": knee(points),
                           "loadgen_cores": closed.get("loadgen_cores"), "errors": errors[:5]})
    return rows, curves, dense


def _find(items: list[dict], **match) -> dict | None:
    return next((x for x in items if all(x.get(k) == v for k, v in match.items())), None)


def _level(curve: dict | None, level: float) -> dict | None:
    if not curve:
        return None
    return min(curve["points"], key=lambda p: abs(p["level"] - level), default=None)


def targets(rows: list[dict], curves: list[dict], dense: list[dict], gather: float, modes: list[str]) -> list[dict]:
    """The issue's targets, each {"what", "ours", "reference", "ok"} (ok None: a figure is missing)."""
    out = []
    for mode in modes:
        ours = _find(rows, server="ours", mode=mode, **TARGET_CONFIG)
        stock = _find(rows, server="stock", mode=mode, **TARGET_CONFIG)
        o, s = _per_core(ours) if ours else None, _per_core(stock) if stock else None
        out.append({"what": f"{mode}: rows/s per server core >= 3x stock's", "ours": o, "reference": s,
                    "ok": None if o is None or s is None else o >= 3 * s})
        out.append({"what": f"{mode}: rows/s per server core >= 25% of the gather limit", "ours": o,
                    "reference": gather, "ok": None if o is None else o >= 0.25 * gather})
        curve = _find(curves, server="ours", mode=mode, **TARGET_CONFIG)
        light, loaded = _level(curve, LIGHT_LEVEL), _level(curve, LOAD_LEVEL)
        p99 = loaded["p99_ms"] if loaded else None
        p50 = light["p50_ms"] if light else None
        out.append({"what": f"{mode}: p99 at {LOAD_LEVEL:.0%} of saturation <= 2x p50 at light load "
                            f"({LIGHT_LEVEL:.0%})", "ours": p99, "reference": p50,
                    "ok": None if p99 is None or p50 is None else p99 <= 2 * p50})
        od = _find(dense, server="ours", mode=mode, workers=TARGET_CONFIG["workers"])
        sd = _find(dense, server="stock", mode=mode, workers=TARGET_CONFIG["workers"])
        out.append({"what": f"{mode}: dense 2x3 push+pull p50 at light load <= stock's",
                    "ours": od["p50_ms"] if od else None, "reference": sd["p50_ms"] if sd else None,
                    "ok": None if not od or not sd else od["p50_ms"] <= sd["p50_ms"]})
    return out


def table_rows(rows: list[dict], curves: list[dict], gather: dict) -> list[list[str]]:
    out = []
    for r in sorted(rows, key=lambda r: (r["mode"], r["batch"], r["workers"], r["server"] != "ours")):
        curve = _find(curves, server=r["server"], mode=r["mode"], workers=r["workers"], batch=r["batch"]) or {}
        k = curve.get("knee")
        per_core = _per_core(r)
        us_per_row = 1e6 * r["server_cores"] / r["rows_per_s"] if r.get("server_cores") and r["rows_per_s"] else None
        light, loaded = _level(curve, LIGHT_LEVEL), _level(curve, LOAD_LEVEL)
        out.append([r["mode"], r["server"], str(r["workers"]), str(r["batch"]), _fmt(r["rows_per_s"]),
                    _fmt(r["server_cores"], ".2f"), _fmt(per_core), _fmt(us_per_row, ".3f"),
                    _fmt(r["p50_ms"], ".2f"), _fmt(r["p99_ms"], ".2f"),
                    _fmt(light["p50_ms"] if light else None, ".2f"), _fmt(loaded["p99_ms"] if loaded else None, ".2f"),
                    _fmt(k["offered_rows_per_s"] if k else None) if curve.get("points") else "-",
                    _fmt(curve.get("loadgen_cores"), ".2f")])
    out.append(["gather limit", "numpy", "-", str(gather["batch"]), _fmt(gather["rows_per_s"]), "1.00",
                _fmt(gather["rows_per_cpu_s"]), _fmt(1e6 / gather["rows_per_cpu_s"], ".3f")] + ["-"] * 6)
    return out


HEADERS = ["mode", "server", "N", "B", "rows/s", "server cores", "rows/s per core", "CPU us/row", "p50 (closed)",
           "p99 (closed)", f"p50 @{LIGHT_LEVEL:.0%}", f"p99 @{LOAD_LEVEL:.0%}", "knee (offered rows/s)",
           "loadgen cores"]


def build(jobs: list[dict], gather: dict, modes: list[str]) -> tuple[list[list[str]], dict, list[str]]:
    """(table rows, results.json's "saturation" object, target lines)."""
    rows, curves, dense = collect(jobs)
    limit = gather["rows_per_cpu_s"]
    checks = targets(rows, curves, dense, limit, modes)
    data = {"gather_limit_rows_per_s": limit, "rows": rows, "curves": curves, "dense": dense, "targets": checks,
            "gather": gather}
    lines = []
    for t in checks:
        status = "-" if t["ok"] is None else ("met" if t["ok"] else "MISSED")
        lines.append(f"{status}: {t['what']}: ours {_fmt(t['ours'], ',.3g')}, reference {_fmt(t['reference'], ',.3g')}")
    for d in sorted(dense, key=lambda d: (d["mode"], d["workers"], d["server"])):
        lines.append(f"dense 2x3 push+pull, {d['mode']}, N={d['workers']}, {d['server']}: "
                     f"p50 {_fmt(d['p50_ms'], '.2f')} ms, p99 {_fmt(d['p99_ms'], '.2f')} ms "
                     f"at {d['steps_per_s']:.0f} steps/s")
    return table_rows(rows, curves, gather), data, lines


def plot(path: Path, curves: list[dict], batch: int, workers: int, notes: list[str]) -> Path | None:
    """p50 and p99 step latency against offered load, ours (solid) and stock (dashed), both modes, one N and B."""
    import plots
    colors = {"dist_sync": ("blue", "green"), "dist_async": ("orange", "red")}
    series = []
    for c in curves:
        if c["batch"] != batch or c["workers"] != workers or not c["points"]:
            continue
        pts = sorted(c["points"], key=lambda p: p["offered_rows_per_s"])
        xs = [p["offered_rows_per_s"] for p in pts]
        k = c.get("knee")
        label = f"{c['server']} {c['mode']}" + (f" (knee {k['offered_rows_per_s']:,.0f} rows/s)" if k else "")
        p99_color, p50_color = colors.get(c["mode"], ("gray", "gray"))
        series.append({"x": xs, "y": [p["p99_ms"] for p in pts], "label": label + " p99", "color": p99_color,
                       "dash": c["server"] == "stock"})
        series.append({"x": xs, "y": [p["p50_ms"] for p in pts], "label": label + " p50", "color": p50_color,
                       "dash": c["server"] == "stock", "marker": False})
    if not series:
        return None
    return plots.line_plot(path, series, title=f"Step latency against offered load, {workers} simulated workers, "
                                                f"B={batch}, D=32", xlabel="offered load (rows/s, all workers)",
                           ylabel="step latency (ms)", logx=True, logy=True, xformat=_count, notes=notes)
