"""A tiny line-plot renderer that writes PNG with zlib and numpy only (no matplotlib), for scripts/bench.py.

Canvas: an RGB numpy array; lines, dashed lines, square markers, and text in a 5x7 bitmap font (upper case,
digits and a little punctuation; lower case is drawn as upper case). :func:`plot` draws log-log or linear axes
with decade ticks, a legend and optional horizontal reference lines.
"""
from __future__ import annotations

import math
import struct
import zlib

import numpy as np

_GLYPHS = {
    "A": ".###." "#...#" "#...#" "#####" "#...#" "#...#" "#...#", "B": "####.#...##...#####.#...##...#####.",
    "C": ".###.#...##....#....#....#...#.###.", "D": "####.#...##...##...##...##...#####.",
    "E": "######....#....####.#....#....#####", "F": "######....#....####.#....#....#....",
    "G": ".###.#...##....#.####...##...#.####", "H": "#...##...##...#######...##...##...#",
    "I": ".###...#....#....#....#....#...###.", "J": "..###...#....#....#....##..#..##...",
    "K": "#...##..#.#.#..##...#.#..#..#.#...#", "L": "#....#....#....#....#....#....#####",
    "M": "#...###.###.#.##.#.##...##...##...#", "N": "#...##...###..##.#.##..###...##...#",
    "O": ".###.#...##...##...##...##...#.###.", "P": "####.#...##...#####.#....#....#....",
    "Q": ".###.#...##...##...##.#.##..#..##.#", "R": "####.#...##...#####.#.#..#..#.#...#",
    "S": ".#####....#.....###.....#....#####.", "T": "#####..#....#....#....#....#....#..",
    "U": "#...##...##...##...##...##...#.###.", "V": "#...##...##...##...##...#.#.#...#..",
    "W": "#...##...##...##.#.##.#.##.#.#.#.#.", "X": "#...##...#.#.#...#...#.#.#...##...#",
    "Y": "#...##...#.#.#...#....#....#....#..", "Z": "#####....#...#...#...#...#....#####",
    "0": ".###.#...##..###.#.###..##...#.###.", "1": "..#...##....#....#....#....#...###.",
    "2": ".###.#...#....#...#...#...#...#####", "3": "#####" "...#." "..#.." "...#." "....#" "#...#" ".###.",
    "4": "...#...##..#.#.#..#.#####...#....#.", "5": "######....####.....#....##...#.###.",
    "6": "..##..#...#....####.#...##...#.###.", "7": "#####....#...#...#...#....#....#...",
    "8": ".###.#...##...#.###.#...##...#.###.", "9": ".###.#...##...#.####....#...#..##..",
    " ": "." * 35, ".": "." * 25 + ".##...##..", ",": "." * 20 + ".##....#...#...",
    "-": "." * 15 + "#####" + "." * 15, "+": ".......#....#..#####..#....#.......",
    "(": "...#...#...#....#....#.....#.....#.", ")": ".#.....#.....#....#....#...#...#...",
    "/": "....." "....#" "...#." "..#.." ".#..." "#...." ".....", ":": "......##...##........##...##.......",
    "%": "##...##..#...#...#...#...#..##...##", "=": "..........#####.....#####..........",
    "^": "..#...#.#.#...#....................", "_": "." * 30 + "#####",
    "<": "...#...#...#...#.....#.....#.....#.", ">": ".#.....#.....#.....#...#...#...#...",
    "*": ".......#..#.#.#.###.#.#.#..#.......", ";": "......##...##........##....#...#...",
    "[": ".###..#....#....#....#....#....###.", "]": ".###....#....#....#....#....#..###.", "'": "..#.." "..#.." ".#..." + "." * 20,
}
_FONT = {ch: np.array([c == "#" for c in g], bool).reshape(7, 5) for ch, g in _GLYPHS.items()}

COLORS = {
    "black": (0, 0, 0), "grey": (150, 150, 150), "light": (225, 225, 225), "white": (255, 255, 255),
    "blue": (31, 119, 180), "green": (44, 160, 44), "teal": (23, 190, 207), "red": (214, 39, 40),
    "orange": (255, 127, 14), "purple": (148, 103, 189), "brown": (140, 86, 75),
}


class Canvas:
    def __init__(self, width: int, height: int, background=(255, 255, 255)) -> None:
        self.w, self.h = width, height
        self.px = np.empty((height, width, 3), np.uint8)
        self.px[:] = background

    def dot(self, x: float, y: float, color, size: int = 1) -> None:
        x, y = int(round(x)), int(round(y))
        lo = -(size // 2)
        x0, x1 = max(x + lo, 0), min(x + lo + size, self.w)
        y0, y1 = max(y + lo, 0), min(y + lo + size, self.h)
        if x0 < x1 and y0 < y1:
            self.px[y0:y1, x0:x1] = color

    def line(self, x0, y0, x1, y1, color, width: int = 1, dash: int = 0) -> None:
        n = int(max(abs(x1 - x0), abs(y1 - y0))) + 1
        for i in range(n):
            if dash and (i // dash) % 2:
                continue
            t = i / max(n - 1, 1)
            self.dot(x0 + (x1 - x0) * t, y0 + (y1 - y0) * t, color, width)

    def rect(self, x0, y0, x1, y1, color, fill=None) -> None:
        if fill is not None:
            self.px[max(int(y0), 0):int(y1), max(int(x0), 0):int(x1)] = fill
        self.line(x0, y0, x1, y0, color)
        self.line(x1, y0, x1, y1, color)
        self.line(x1, y1, x0, y1, color)
        self.line(x0, y1, x0, y0, color)

    def text(self, x, y, s: str, color=(0, 0, 0), scale: int = 2, anchor: str = "left", vertical=False) -> None:
        s = s.upper()
        width = len(s) * 6 * scale
        if vertical:   # bottom to top, rotated 90 degrees counter-clockwise; (x, y) is the centre
            y0 = int(y + width / 2)
            for i, ch in enumerate(s):
                glyph = np.rot90(_FONT.get(ch, _FONT["*"]))
                self._blit(glyph, int(x - 3.5 * scale), y0 - (i + 1) * 6 * scale, color, scale)
            return
        x0 = {"left": x, "center": x - width / 2, "right": x - width}[anchor]
        for i, ch in enumerate(s):
            self._blit(_FONT.get(ch, _FONT["*"]), int(x0 + i * 6 * scale), int(y - 3.5 * scale), color, scale)

    def _blit(self, glyph: np.ndarray, x: int, y: int, color, scale: int) -> None:
        big = np.kron(glyph, np.ones((scale, scale), bool))
        h, w = big.shape
        ys, xs = np.nonzero(big)
        ys, xs = ys + y, xs + x
        ok = (ys >= 0) & (ys < self.h) & (xs >= 0) & (xs < self.w)
        self.px[ys[ok], xs[ok]] = color

    def png(self) -> bytes:
        raw = b"".join(b"\x00" + self.px[row].tobytes() for row in range(self.h))

        def chunk(kind: bytes, data: bytes) -> bytes:
            return struct.pack(">I", len(data)) + kind + data + struct.pack(">I", zlib.crc32(kind + data) & 0xFFFFFFFF)

        return (b"\x89PNG\r\n\x1a\n" + chunk(b"IHDR", struct.pack(">IIBBBBB", self.w, self.h, 8, 2, 0, 0, 0))
                + chunk(b"IDAT", zlib.compress(raw, 9)) + chunk(b"IEND", b""))

    def save(self, path) -> None:
        with open(path, "wb") as fh:
            fh.write(self.png())


def _si(v: float) -> str:
    for div, suffix in ((1e12, "T"), (1e9, "G"), (1e6, "M"), (1e3, "K")):
        if abs(v) >= div:
            return f"{v / div:g}{suffix}"
    return f"{v:g}"


def _ticks(lo: float, hi: float, log: bool) -> list[float]:
    if log:
        return [10.0 ** e for e in range(math.floor(math.log10(lo)), math.ceil(math.log10(hi)) + 1)]
    step = 10 ** math.floor(math.log10(max(hi - lo, 1e-12)))
    while (hi - lo) / step > 8:
        step *= 2
    return list(np.arange(math.floor(lo / step) * step, hi + step, step))


def plot(path, series: list[dict], title: str, xlabel: str, ylabel: str, logx=True, logy=True,
         hlines: list[tuple[float, str]] = (), width: int = 1100, height: int = 700, yformat=_si, xformat=_si,
         notes: list[str] = ()) -> None:
    """series: dicts with x, y (lists), label, color (a COLORS name or RGB), dash (bool), marker (bool)."""
    legend_rows = -(-len(series) // 2)
    height += 24 * legend_rows
    canvas = Canvas(width, height)
    left, right, top, bottom = 120, width - 30, 60, height - 100 - 22 * len(notes) - 24 * legend_rows
    xs = [x for s in series for x in s["x"] if x is not None and (x > 0 or not logx)]
    ys = [y for s in series for y in s["y"] if y is not None and (y > 0 or not logy)] + [h for h, _ in hlines]
    if not xs or not ys:
        xs, ys = [1, 10], [1, 10]
    fx = (lambda v: math.log10(v)) if logx else (lambda v: v)
    fy = (lambda v: math.log10(v)) if logy else (lambda v: v)
    xt = _ticks(min(xs), max(xs), logx)
    yt = _ticks(min(ys), max(ys), logy)
    x_lo, x_hi = fx(xt[0]), fx(xt[-1])
    y_lo, y_hi = fy(yt[0]), fy(yt[-1])
    if x_hi == x_lo:
        x_hi += 1
    if y_hi == y_lo:
        y_hi += 1

    def X(v):
        return left + (fx(v) - x_lo) / (x_hi - x_lo) * (right - left)

    def Y(v):
        return bottom - (fy(v) - y_lo) / (y_hi - y_lo) * (bottom - top)

    for t in xt:
        canvas.line(X(t), top, X(t), bottom, COLORS["light"])
        canvas.text(X(t), bottom + 16, xformat(t), anchor="center")
    for t in yt:
        canvas.line(left, Y(t), right, Y(t), COLORS["light"])
        canvas.text(left - 8, Y(t), yformat(t), anchor="right")
    canvas.rect(left, top, right, bottom, COLORS["black"])
    canvas.text((left + right) / 2, 28, title, scale=2, anchor="center")
    canvas.text((left + right) / 2, bottom + 44, xlabel, anchor="center")
    canvas.text(24, (top + bottom) / 2, ylabel, vertical=True)
    for value, label in hlines:
        canvas.line(left, Y(value), right, Y(value), COLORS["grey"], width=2, dash=8)
        canvas.text(left + 8, Y(value) - 14, label, color=COLORS["grey"], anchor="left")
    for s in series:
        color = COLORS.get(s.get("color"), s.get("color")) if isinstance(s.get("color"), str) else s.get("color",
                                                                                                       (0, 0, 0))
        pts = [(X(x), Y(y)) for x, y in zip(s["x"], s["y"])
               if x is not None and y is not None and (x > 0 or not logx) and (y > 0 or not logy)]
        for (a, b), (c, d) in zip(pts, pts[1:]):
            canvas.line(a, b, c, d, color, width=3, dash=10 if s.get("dash") else 0)
        if s.get("marker", True):
            for a, b in pts:
                canvas.dot(a, b, color, 9)
    # legend: two columns under the x axis label
    ly = bottom + 76
    col_w = (width - 40) // 2
    for i, s in enumerate(series):
        color = COLORS.get(s.get("color"), (0, 0, 0)) if isinstance(s.get("color"), str) else s["color"]
        x, y = 20 + (i % 2) * col_w, ly + 24 * (i // 2)
        canvas.line(x, y, x + 40, y, color, width=3, dash=10 if s.get("dash") else 0)
        canvas.text(x + 52, y, s["label"][:(col_w - 60) // 12])
    for i, note in enumerate(notes):
        canvas.text(20, ly + 24 * legend_rows + 8 + 22 * i, note, scale=2)
    canvas.save(path)
