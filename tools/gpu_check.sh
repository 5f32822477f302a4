#!/usr/bin/env bash
# Every GPU check in one run, for the device machine (one NVIDIA GPU, its own
# torch + CUDA, jax's CUDA PJRT plugin, no network). Run from the repo root:
#
#   here:   mkdir -p .pjrt_include && cp "$(python -c 'import xla_plugins.xla_cpu_pjrt as m, os; \
#             print(os.path.join(os.path.dirname(m.__file__), "include"))')"/*.h .pjrt_include/
#   device: run(command="bash tools/gpu_check.sh", carry=[".pjrt_include"], timeout_s=540)
#
# Writes its log to $OUT/gpu_check.log (or ./gpu_check.log without $OUT).
set -uo pipefail
LOG="${OUT:-.}/gpu_check.log"
exec > >(tee "$LOG") 2>&1
PY=$(command -v python3 || command -v python)
echo "== machine"; nvidia-smi --query-gpu=name,memory.total --format=csv,noheader || true
$PY -c "import torch, sys; print('python', sys.version.split()[0], 'torch', torch.__version__)"
$PY -c "import torch_pjrt._plugins as p; print('cuda plugin:', p.find_plugin('cuda'))" 2>/dev/null \
  || PYTHONPATH=python $PY -c "import importlib.util as u; print('jax cuda plugins:', [n for n in ('jax_plugins.xla_cuda12', 'jax_plugins.xla_cuda13') if u.find_spec(n)])"

echo "== build (torch of this machine)"
for tool in cmake ninja; do command -v $tool >/dev/null || echo "missing: $tool"; done
cmake -S . -B build-gpu -G Ninja -DCMAKE_BUILD_TYPE=Release -DPython3_EXECUTABLE="$PY" \
  -DPJRT_INCLUDE_DIR="$PWD/.pjrt_include" -DTORCH_PJRT_BUILD_TESTS=OFF >/dev/null || { echo "cmake failed"; exit 1; }
ninja -C build-gpu -j16 || { echo "build failed"; exit 1; }

export PYTHONPATH=python:tests/python TORCH_PJRT_PLUGIN=cuda
echo "== platform"
$PY -c "import torch_pjrt; print(torch_pjrt.platform())" || exit 1
echo "== tests on the GPU (fused default, then strict)"
for mode in fused strict; do
  TORCH_PJRT_MODE=$mode timeout 150 $PY -m pytest -q -x -p no:cacheprovider tests/python/test_device.py \
    tests/python/test_ops.py tests/python/test_fused.py tests/python/test_training.py 2>&1 | tail -5
done
echo "== benchmarks"
timeout 200 $PY benchmarks/bench_fused.py
timeout 60 $PY benchmarks/bench_eager.py | tail -12
