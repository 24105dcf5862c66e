"""Benchmarks (not tests), measured side by side in one run on this machine: the command line; the benchmarks are
the package tools/bench/ (tools/bench/cli.py lists them).

    python tools/benchmarks.py NAME       # one benchmark's markdown table (--help: the names)
    python tools/benchmarks.py all        # everything, as the markdown tables of docs/benchmarks.md
"""
import os
import sys

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))  # the repository root

from tools.bench.cli import main  # noqa: E402

if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
