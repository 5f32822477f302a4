#!/usr/bin/env bash
# Every GPU check in one run, for the device machine (one NVIDIA GPU, its own
# torch + CUDA, jax's CUDA PJRT plugin, no network). Run from the repo root:
#
#   here:   mkdir -p .pjrt_include && cp "$(python -c 'import xla_plugins.xla_cpu_pjrt as m, os; \
#             print(os.path.join(os.path.dirname(m.__file__), "include"))')"/*.h .pjrt_include/
#   device: run(command="bash tools/gpu_check.sh", carry=[".pjrt_include"], timeout_s=560)
#
# Phases share one deadline (GPU_CHECK_SECONDS, default 520 s from the start),
# so a slow build leaves less to the tests but the script still ends in time.
# A dry run on a machine without a GPU (needs pytest-xdist):
#   GPU_CHECK_PLUGIN=cpu GPU_CHECK_SKIP_BUILD=1 GPU_CHECK_SECONDS=200 bash tools/gpu_check.sh
# Logs go to $OUT (or ./gpu_check_logs without $OUT): gpu_check.log (all),
# tests_<mode>.log (pytest -v lines, kept even when a phase is cut short).
set -uo pipefail
LOGS="${OUT:-./gpu_check_logs}"
mkdir -p "$LOGS"
exec > >(tee "$LOGS/gpu_check.log") 2>&1
DEADLINE=${GPU_CHECK_SECONDS:-520}
left() { echo $((DEADLINE - SECONDS)); }
# A phase gets at most $1 seconds, and never past the deadline minus $2 (reserved for later phases).
budget() { local b=$(( $(left) - $2 )); (( b > $1 )) && b=$1; (( b < 10 )) && b=10; echo $b; }
PY=$(command -v python3 || command -v python)
echo "== machine"; nvidia-smi --query-gpu=name,memory.total,driver_version --format=csv,noheader || true
$PY -c "import torch, sys; print('python', sys.version.split()[0], 'torch', torch.__version__, 'cuda', torch.version.cuda)"
$PY -c "import jax; print('jax', jax.__version__, jax.default_backend())" 2>&1 | tail -1

echo "== build (torch of this machine)"
for c in /usr/bin/g++ /usr/bin/g++-13; do [ -x "$c" ] && export CXX=$c CC=${c/g++/gcc} && break; done  # see gpu_debug.sh
for tool in cmake ninja; do command -v $tool >/dev/null || echo "missing: $tool"; done
start=$SECONDS
if [ -z "${GPU_CHECK_SKIP_BUILD:-}" ]; then
cmake -S . -B build-gpu -G Ninja -DCMAKE_BUILD_TYPE=Release -DPython3_EXECUTABLE="$PY" \
  -DPJRT_INCLUDE_DIR="$PWD/.pjrt_include" -DTORCH_PJRT_BUILD_TESTS=OFF > "$LOGS/cmake.log" 2>&1 \
  || { tail -40 "$LOGS/cmake.log"; echo "cmake failed"; exit 1; }
ninja -C build-gpu -j16 > "$LOGS/build.log" 2>&1 || { grep -E "error|FAILED" -A3 "$LOGS/build.log" | head -80; echo "build failed"; exit 1; }
fi
echo "built in $((SECONDS - start)) s"

# jax in the same process as torch_pjrt and PyTorch's CUDA tensors: no one reserves the GPU up front.
export PYTHONPATH=python:tests/python TORCH_PJRT_PLUGIN=${GPU_CHECK_PLUGIN:-cuda} XLA_PYTHON_CLIENT_PREALLOCATE=false PYTHONUNBUFFERED=1
echo "== platform"
timeout 120 $PY -c "
import torch, torch_pjrt
print(torch_pjrt.platform(), torch.tpu.device_count(), 'device(s)')
a = torch.randn(64, 32); b = torch.randn(32, 16)
for mode in ('strict', 'fused'):
    with torch_pjrt.mode(mode):
        got = (a.to('tpu') @ b.to('tpu')).relu().sum(0).cpu()
    print(mode, 'matmul/relu/sum vs CPU: max abs diff', (got - (a @ b).relu().sum(0)).abs().max().item())
" || exit 1

# Tests: the files that compare against CPU PyTorch, several workers (XLA:GPU
# compiles on the host's cores). Multi-process and CPU-plugin-specific files are left out.
TESTS="test_device.py test_ops.py test_fused.py test_training.py test_nan_semantics.py test_index_checks.py
  test_exactness.py test_matmul_precision.py test_autocast.py test_views_autograd.py test_failed_steps.py
  test_compile_backend.py test_jax_op.py test_fused_optim.py test_complex.py test_moe_ops.py test_generation.py
  test_memory_format.py test_rnn.py test_eager_checks.py test_opinfo.py"
FILES=$(for f in $TESTS; do echo tests/python/*/$f; done)  # tests/python/<layer>/test_x.py
run_tests() {  # mode, seconds at most, seconds to keep for what follows
  local b=$(budget "$2" "$3") extra=""
  if (( b < 60 )); then echo "== tests, $1 mode: skipped ($b s left)"; return; fi
  [ "$1" = fused ] || extra='-m "not modes_inside"'
  echo "== tests, $1 mode ($b s at most)"
  # Tests compile many small programs: skip XLA:GPU's GEMM autotuning there (results do not depend on it).
  eval XLA_FLAGS=--xla_gpu_autotune_level=0 TORCH_PJRT_MODE=$1 timeout -s INT -k 15 "$b" $PY -m pytest -v -p no:cacheprovider -n 12 --timeout 120 \
    $extra $FILES > "$LOGS/tests_$1.log" 2>&1
  echo "exit $?; passed $(grep -c ' PASSED' "$LOGS/tests_$1.log"), failed $(grep -c ' FAILED' "$LOGS/tests_$1.log"),"\
       "errors $(grep -c ' ERROR' "$LOGS/tests_$1.log"), skipped $(grep -c ' SKIPPED' "$LOGS/tests_$1.log")"
  grep -E ' (FAILED|ERROR) ' "$LOGS/tests_$1.log" | sed 's/^\[gw[0-9]*\] \[ *[0-9]*%\] //' | cut -c1-200 | sort -u | head -40
  tail -2 "$LOGS/tests_$1.log"
}
# GPU_CHECK_QUICK=1 (a short lease): fewer seconds per phase, the small GPT only, no strict pass.
if [ -n "${GPU_CHECK_QUICK:-}" ]; then fused_cap=100; fused_keep=110; bench_keep=0; BENCH_ARGS=--quick
else fused_cap=170; fused_keep=200; bench_keep=40; BENCH_ARGS=""; fi
run_tests fused $fused_cap $fused_keep
echo "== benchmark (side by side: PyTorch CUDA eager, torch_pjrt on the CUDA plugin, jax.jit)"
timeout -k 10 "$(budget 170 $bench_keep)" $PY benchmarks/bench_gpu.py $BENCH_ARGS
if [ -z "${GPU_CHECK_QUICK:-}" ]; then
  echo "== failed-check cost (keeping values on a failed check, on/off per step: docs/design/runtime-checks.md)"
  timeout -k 10 "$(budget 90 200)" $PY benchmarks/bench_failed_checks.py --quick
fi

[ -n "${GPU_CHECK_QUICK:-}" ] || run_tests strict 200 0
echo "== done in $SECONDS s"
