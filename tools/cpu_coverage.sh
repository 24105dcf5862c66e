#!/usr/bin/env bash
# Which lines of the training code no CPU run executes: the test suite under coverage, every
# launched process included (torchrun ranks and spawned ranks), then the lines of the scripts,
# the root modules, components/, data/, parallel/ and algorithms/ that never ran. What remains is the code only a GPU runs (the
# docs/gpu.md, "On GPUs", lists it and says why each line is right) plus error paths the tests
# do not provoke.
#
#   bash tools/cpu_coverage.sh            # the whole suite (~15 minutes on 2 cores)
#   bash tools/cpu_coverage.sh -m "not slow"
set -euo pipefail
cd "$(dirname "$0")/.."
python -m pip install -q "coverage>=7"
site=$(python -c "import sysconfig; print(sysconfig.get_paths()['purelib'])")
out=$(mktemp -d)
cat > "$out/.coveragerc" <<RC
[run]
parallel = True
data_file = $out/.coverage
include = $PWD/*.py
          $PWD/components/*.py
          $PWD/data/*.py
          $PWD/parallel/*.py
          $PWD/algorithms/*.py
RC
echo "import coverage; coverage.process_startup()" > "$site/zz_cpu_coverage.pth"  # every new interpreter
trap 'rm -f "$site/zz_cpu_coverage.pth"' EXIT
COVERAGE_PROCESS_START="$out/.coveragerc" HF_HUB_OFFLINE=1 python -m pytest tests -q -p no:cacheprovider "$@" || true
python -m coverage combine --rcfile="$out/.coveragerc" -q
python -m coverage report --rcfile="$out/.coveragerc" --show-missing --skip-covered | tee "$out/report.txt"
echo "full report: $out/report.txt"
