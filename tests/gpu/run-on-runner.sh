#!/usr/bin/env bash
# The GPU suite, then the GPU benchmark, in one device call on the H200 runner.
#
#   [GPU_TESTS="tests/gpu/a.py ..."] [BENCH_EXTRA="--sections ..."] bash tests/gpu/run-on-runner.sh [--nccl] [--tests-only | --bench-only] [--dry-run]
#
# Needs the vLLM bundle staged (tests/gpu/README.md): it runs .gpu-bundle/install.sh
# (idempotent) and sources .gpu-bundle/env.sh. genworker comes from this repository copy
# through a symlink tree (/tmp/gwdev/genworker/{core,shell}), nothing is pip-installed.
# --nccl adds the two-GPU benchmark section (the two-GPU test runs whenever there are two
# GPUs). Logs, the JUnit file and the report land in $OUT (default ./gpu-out).
# --dry-run checks this script: tiny benchmark shapes, no GPU tests.
set -uo pipefail
cd "$(dirname "${BASH_SOURCE[0]}")/../.."
REPO=$PWD
OUT=${OUT:-$REPO/gpu-out}
BUNDLE=${BUNDLE:-.gpu-bundle}
TEST_TIMEOUT_S=${TEST_TIMEOUT_S:-240} # one test (pytest-timeout, when installed)
RUN_TESTS=1 RUN_BENCH=1 BENCH_ARGS=()
# BENCH_EXTRA: more bench/gpu.py arguments, e.g. "--sections refit,async --gen-reps 3"
read -r -a EXTRA <<< "${BENCH_EXTRA:-}"
BENCH_ARGS+=("${EXTRA[@]}")
for arg in "$@"; do
  case $arg in
    --nccl) BENCH_ARGS+=(--nccl) ;;
    --tests-only) RUN_BENCH=0 ;;
    --bench-only) RUN_TESTS=0 ;;
    --dry-run) RUN_TESTS=0; BENCH_ARGS+=(--dry-run) ;;
    *) echo "unknown argument: $arg" >&2; exit 2 ;;
  esac
done
# Whole-run budgets: both parts must fit one 600 s device call; one part alone gets more.
if [ "$RUN_TESTS" = 1 ] && [ "$RUN_BENCH" = 1 ]; then
  TEST_BUDGET_S=${TEST_BUDGET_S:-250} BENCH_BUDGET_S=${BENCH_BUDGET_S:-310}
else
  TEST_BUDGET_S=${TEST_BUDGET_S:-540} BENCH_BUDGET_S=${BENCH_BUDGET_S:-540}
fi
mkdir -p "$OUT"
exec > >(tee -a "$OUT/run.log") 2>&1

if [ -f "$BUNDLE/install.sh" ]; then
  bash "$BUNDLE/install.sh" "$BUNDLE" || { echo "bundle install failed (staged in /tmp/stage?)"; exit 3; }
fi
if [ -f "$BUNDLE/env.sh" ]; then
  # shellcheck disable=SC1090,SC1091
  source "$BUNDLE/env.sh"
elif [ -d /tmp/site ]; then
  export PYTHONPATH=/tmp/site${PYTHONPATH:+:$PYTHONPATH}
fi
export VLLM_ENABLE_V1_MULTIPROCESSING=0 VLLM_USE_FLASHINFER_SAMPLER=0 NCCL_NVLS_ENABLE=0
export PYTHONSAFEPATH=1 TOKENIZERS_PARALLELISM=false

rm -rf /tmp/gwdev && mkdir -p /tmp/gwdev/genworker
ln -s "$REPO/core" /tmp/gwdev/genworker/core
ln -s "$REPO/shell" /tmp/gwdev/genworker/shell
ln -s "$REPO/demo" /tmp/gwdev/genworker/demo
export PYTHONPATH=/tmp/gwdev${PYTHONPATH:+:$PYTHONPATH}

python3 - <<'EOF' | tee "$OUT/environment.txt"
import importlib.metadata as md, platform, torch
print("python", platform.python_version(), "torch", torch.__version__, "cuda", torch.version.cuda)
print("gpus", [torch.cuda.get_device_name(i) for i in range(torch.cuda.device_count())])
for name in ("vllm", "transformers", "pytest", "hypothesis", "returns", "msgspec", "pyzmq", "mypy", "pytest-timeout"):
    try:
        print(name, md.version(name))
    except md.PackageNotFoundError:
        print(name, "not installed")
import genworker.core, genworker.shell.worker
print("genworker from", genworker.shell.worker.__file__)
EOF
nvidia-smi --query-gpu=index,name,memory.used,memory.total --format=csv > "$OUT/nvidia-smi.csv" 2>&1

status=0
if [ "$RUN_TESTS" = 1 ]; then
  PER_TEST=()
  python3 -c "import pytest_timeout" 2>/dev/null && PER_TEST=(--timeout "$TEST_TIMEOUT_S")
  read -r -a TESTS <<< "${GPU_TESTS:-tests/gpu}" # GPU_TESTS: a few test files instead
  echo "== pytest -m gpu ${TESTS[*]} (budget ${TEST_BUDGET_S}s)"
  timeout -k 20 "$TEST_BUDGET_S" python3 -m pytest -m gpu "${TESTS[@]}" -v -rA \
    -p no:cacheprovider "${PER_TEST[@]}" --junitxml="$OUT/junit-gpu.xml" \
    2>&1 | tee "$OUT/pytest-gpu.log"
  rc=${PIPESTATUS[0]}
  echo "== pytest exit code $rc"
  [ "$rc" = 0 ] || status=1
fi
if [ "$RUN_BENCH" = 1 ]; then
  echo "== bench/gpu.py ${BENCH_ARGS[*]} (budget ${BENCH_BUDGET_S}s)"
  timeout -k 20 "$BENCH_BUDGET_S" python3 bench/gpu.py --out "$OUT/RESULTS-gpu.md" \
    "${BENCH_ARGS[@]}" 2>&1 | tee "$OUT/bench-gpu.log"
  rc=${PIPESTATUS[0]}
  echo "== bench exit code $rc"
  [ "$rc" = 0 ] || status=1
fi
nvidia-smi --query-gpu=index,memory.used --format=csv >> "$OUT/nvidia-smi.csv" 2>&1
exit $status
