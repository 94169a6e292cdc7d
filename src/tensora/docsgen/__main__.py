"""``python -m tensora.docsgen [--out DIR] [--check]``: write the reference pages (default: the checkout's
docs/reference), or with ``--check`` only say which are stale (exit 1)."""

from __future__ import annotations

import argparse
import sys
from pathlib import Path

from tensora.docsgen import COMMAND, default_dir, stale, write


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog=COMMAND, description="Write the docs site's generated reference pages.")
    parser.add_argument("--out", type=Path, default=None, help="folder to write into (default: docs/reference)")
    parser.add_argument("--check", action="store_true", help="write nothing; exit 1 naming each stale page")
    args = parser.parse_args(argv)
    out = args.out or default_dir()
    if args.check:
        old = stale(out)
        for name in old:
            print(f"{out / name} is stale: run {COMMAND}", file=sys.stderr)
        return 1 if old else 0
    for path in write(out):
        print(path)
    return 0


if __name__ == "__main__":
    sys.exit(main())
