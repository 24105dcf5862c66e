#!/usr/bin/env bash
# The GPU acceptance check (tools/gpu_check.py): tests/test_gpu.py, the plain-PyTorch reference and
# both scripts at real width, sized to the disk of --out and timed to one call (its deadline counts
# from here, the wheels' install included), one table. Needs no network: where the machine lacks
# diffusers or torchao, put their wheels in .whl/ (the device tool's README) and they are installed
# to /tmp/site first.
#
#   bash tools/gpu_check.sh --out=$OUT               # the table in $OUT/gpu_check.md
#   bash tools/gpu_check.sh --flux_blocks=4,8        # more FLUX blocks at real width (fewer where the disk is short)
#   bash tools/gpu_check.sh --suite=qwen_image --skip_tests --out=$OUT  # the Qwen-Image-Edit rows: a call of their own
#   bash tools/gpu_check.sh --suite=flux2 --skip_tests --out=$OUT  # FLUX.2 klein-base DMD2: a call of its own
#   bash tools/gpu_check.sh --suite=wan --skip_tests --out=$OUT    # Wan 2.1 T2V-1.3B DMD2: a call of its own
#   bash tools/gpu_check.sh --suite=speed --skip_tests --out=$OUT   # the step-time rows
set -uo pipefail
export GPU_CHECK_T0=$(date +%s.%N)  # the deadline counts from here
cd "$(dirname "$0")/.."
if [ -d .whl ] && ! python3 -c "import diffusers, torchao" 2>/dev/null; then
    python3 -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --upgrade --target /tmp/site .whl/*.whl
    export PYTHONPATH=/tmp/site${PYTHONPATH:+:$PYTHONPATH}
fi
export HF_HUB_OFFLINE=1 OMP_NUM_THREADS=${OMP_NUM_THREADS:-4} PYTHONUNBUFFERED=1
exec python3 tools/gpu_check.py "$@"
