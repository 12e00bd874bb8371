"""The `reshard` console entry and `python -m reshard`: exec the CLI binary that the package
carries (reshard/_bin/reshard), so the command behaves exactly as the binary does."""

from __future__ import annotations

import os
import pathlib
import sys


def binary() -> str:
    """The path of the bundled `reshard` executable."""
    path = pathlib.Path(__file__).resolve().parent / "_bin" / "reshard"
    if not path.exists():
        raise FileNotFoundError(f"the reshard CLI is missing from the package: {path}")
    return str(path)


def main() -> None:
    path = binary()
    os.execv(path, ["reshard", *sys.argv[1:]])
