"""scripts/bench_workers/plots.py: the benchmark's PNG plots, rendered from sample data with matplotlib (installed
by `make test` and `make bench` from requirements-bench.txt) and checked pixel by pixel: the size, the series'
colours, the dashed stock lines, and the reference lines."""
from __future__ import annotations

import sys
from pathlib import Path

import numpy as np
import pytest

pytest.importorskip("matplotlib")
from PIL import Image  # noqa: E402  (matplotlib's own dependency)

sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "scripts" / "bench_workers"))
import plots  # noqa: E402

TAB_BLUE, TAB_RED, TAB_GREEN = (31, 119, 180), (214, 39, 40), (44, 160, 44)


def read_png(path: Path) -> np.ndarray:
    """RGB pixels (uint8) of the PNG file."""
    assert path.read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"
    with Image.open(path) as image:
        return np.asarray(image.convert("RGB"))


def pixels_of(image: np.ndarray, rgb) -> int:
    return int(np.all(np.abs(image.astype(int) - rgb) <= 2, axis=2).sum())


def test_memory_vs_rows(tmp_path):
    seen = [50_000, 200_000, 800_000, 1_600_000]
    series = [{"x": seen, "y": [42 + r * 279 / 2**20 for r in seen], "label": "ours sgd", "color": "blue"},
              {"x": seen, "y": [2720] * 4, "label": "stock sgd", "color": "red", "dash": True},
              {"x": [0, None], "y": [5, 6], "label": "nothing drawable on a log axis", "color": "green"}]
    path = plots.memory_vs_rows(tmp_path / "m.png", series, budget_mib=8192, notes=["sample data"])
    image = read_png(path)
    assert image.shape == (682, 1100, 3)
    blue, red = pixels_of(image, TAB_BLUE), pixels_of(image, TAB_RED)
    assert blue > 500 and red > 300 and pixels_of(image, TAB_GREEN) < 50   # only the legend's swatch
    # the stock line is dashed: along its row, red runs alternate with gaps
    red_mask = np.all(np.abs(image.astype(int) - TAB_RED) <= 2, axis=2)
    runs = np.diff(red_mask[int(np.argmax(red_mask.sum(axis=1)))].astype(int))
    assert (runs == 1).sum() >= 5


def test_memory_over_time_marks_events(tmp_path):
    t = [i * 0.5 for i in range(100)]
    path = plots.memory_over_time(tmp_path / "t.png", [{"x": t, "y": [40 + i for i in range(100)],
                                                       "label": "server 0", "color": "blue", "marker": False}],
                                  events=[(20.0, "eviction starts")], budget_mib=200)
    image = read_png(path)
    assert pixels_of(image, TAB_BLUE) > 300
    # the event line: a grey dotted vertical line, in one column over most of the plot's height
    grey = np.all(np.abs(image.astype(int) - (115, 115, 115)) <= 12, axis=2)
    assert grey.sum(axis=0).max() > 150
