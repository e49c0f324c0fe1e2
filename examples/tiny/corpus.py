"""The tiny pair's corpus: the Python standard library's top-level source files.

Every machine with CPython has them offline. Every 10th file (sorted by name) is held out
for evaluation; the split depends only on file names.
"""

from __future__ import annotations

import sysconfig
from pathlib import Path


def stdlib_files() -> list[Path]:
    return sorted(Path(sysconfig.get_paths()["stdlib"]).glob("*.py"))


def split() -> tuple[list[Path], list[Path]]:
    files = stdlib_files()
    held_out = files[::10]
    train = [f for f in files if f not in set(held_out)]
    return train, held_out


def read(files: list[Path]) -> list[str]:
    return [f.read_text(encoding="utf-8", errors="replace") for f in files]
