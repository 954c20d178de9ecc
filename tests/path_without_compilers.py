"""``python tests/path_without_compilers.py DIR``: make DIR a directory of links to every program on $PATH except C
and C++ compilers and preprocessors (cc, gcc-12, x86_64-linux-gnu-gcc, c++, cpp, clang, nvcc, ...), and print it, for
``PATH=$(...)``: the server must run with no compiler (make test-server-python)."""
from __future__ import annotations

import os
import re
import shutil
import sys
from pathlib import Path

COMPILER = re.compile(r"^(.+-)?(cc|c89|c99|gcc|g\+\+|c\+\+|cpp|clang|clang\+\+|tcc|icc|icx|nvcc)(-[0-9.]+)?$")


def main(target: str) -> None:
    out = Path(target)
    shutil.rmtree(out, ignore_errors=True)
    out.mkdir(parents=True)
    for directory in os.environ.get("PATH", "").split(os.pathsep):
        if not directory or not os.path.isdir(directory):
            continue
        for entry in sorted(os.listdir(directory)):
            source = os.path.join(directory, entry)
            if COMPILER.match(entry) or (out / entry).exists() or (out / entry).is_symlink():
                continue
            if os.path.isfile(source) and os.access(source, os.X_OK):
                (out / entry).symlink_to(source)
    print(out.resolve())


if __name__ == "__main__":
    main(sys.argv[1])
