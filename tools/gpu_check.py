"""The GPU acceptance check's command line; the check is the package tools/gpu/ (its docstring says what it does).

    bash tools/gpu_check.sh --out=$OUT             # on a machine with a CUDA GPU, no network needed
    python tools/gpu_check.py --tiny --cpu         # the same plumbing on the tiny models, on CPU
    python tools/gpu_check.py --help               # every option
"""
import os
import sys

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))  # the repository root

from tools.gpu.cli import main  # noqa: E402

if __name__ == "__main__":
    main()
