#!/usr/bin/env bash
# The GPU acceptance check (tools/gpu_check.py): both scripts on NCCL at real width on every GPU of
# this machine, one table. Needs no network: where the machine lacks diffusers/peft, put their
# wheels in .whl/ (see the device tool's README) and they are installed to /tmp/site first.
#
#   bash tools/gpu_check.sh                      # all GPUs; the table also in out/gpu_check/gpu_check.md
#   bash tools/gpu_check.sh --flux_blocks=4,8    # more FLUX blocks at real width
set -euo pipefail
cd "$(dirname "$0")/.."
if [ -d .whl ] && ! python3 -c "import diffusers, peft" 2>/dev/null; then
    python3 -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --upgrade --target /tmp/site .whl/*.whl
    export PYTHONPATH=/tmp/site${PYTHONPATH:+:$PYTHONPATH}
fi
export HF_HUB_OFFLINE=1 OMP_NUM_THREADS=${OMP_NUM_THREADS:-4} PYTHONUNBUFFERED=1
python3 -m pytest tests/test_gpu.py -q -p no:cacheprovider
python3 tools/gpu_check.py "$@"
