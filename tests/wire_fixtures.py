"""The captured and hand-made wire fixtures in tests/fixtures/*.hex, parsed (one reader for every test)."""

from __future__ import annotations

import re
from pathlib import Path

FIXTURES = Path(__file__).resolve().parent / "fixtures"


def load_fixture(name: str) -> dict[str, list[bytes]]:
    """Parse a tests/fixtures/*.hex file: `[name]` blocks of `frame <hex>` lines (see the files' headers)."""
    messages: dict[str, list[bytes]] = {}
    frames: list[bytearray] | None = None
    for lineno, raw in enumerate((FIXTURES / name).read_text().splitlines(), 1):
        line = raw.split("#", 1)[0]
        if not line.strip():
            continue
        header = re.fullmatch(r"\[([\w-]+)\]\s*", line)
        if header:
            frames = messages.setdefault(header.group(1), [])
            assert not frames, f"{name}:{lineno}: duplicate message name"
        elif line.startswith("frame"):
            assert frames is not None, f"{name}:{lineno}: frame outside a message"
            text = line[len("frame"):].strip()
            frames.append(bytearray() if text == "-" else bytearray.fromhex(text))
        elif line[0].isspace():
            assert frames, f"{name}:{lineno}: continuation without a frame"
            frames[-1] += bytes.fromhex(line)
        else:
            raise AssertionError(f"{name}:{lineno}: cannot parse {raw!r}")
    return {k: [bytes(f) for f in v] for k, v in messages.items()}
