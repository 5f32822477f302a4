#!/usr/bin/env bash
# Diagnose a crash on the GPU machine: build, then each smoke step in its own
# process (Python faulthandler), and a native backtrace (cuda-gdb) of the first crash.
set -uo pipefail
LOGS="${OUT:-./gpu_check_logs}"; mkdir -p "$LOGS"
exec > >(tee "$LOGS/gpu_debug.log") 2>&1
PY=$(command -v python3)
echo "== toolchain: g++ is $(command -v g++) ($(g++ -dumpfullversion)); others: $(ls /usr/bin/g++* /usr/bin/c++ 2>/dev/null | tr '\n' ' ')"
g++ -v 2>&1 | grep -o -- "--disable-shared\|--enable-shared" | head -1
ls -la "$(command -v g++)" | cut -c1-200
echo "libstdc++ of g++: $(g++ -print-file-name=libstdc++.so) $(g++ -print-file-name=libstdc++.a)"
env | grep -E '^(CC|CXX|CXXFLAGS|LDFLAGS|LD_PRELOAD|LD_LIBRARY_PATH)=' | cut -c1-200
# The image sets CXX=/opt/gcc/bin/g++, whose _C.so carries libstdc++ locale
# code of its own (a static part beside libstdc++.so.6): its first iostream use
# after the CUDA plugin loads segfaulted (c10::str in an op's description).
# The system compiler links the one shared libstdc++ that torch uses.
for c in /usr/bin/g++ /usr/bin/g++-13; do [ -x "$c" ] && export CXX=$c CC=${c/g++/gcc} && break; done
echo "building with CXX=${CXX:-default}"
echo "== libstdc++ ABI: compiler default $(echo '#include <string>' | ${CXX:-g++} -x c++ -dM -E - | grep -o '_GLIBCXX_USE_CXX11_ABI [01]'),"\
     "torch $($PY -c 'import torch; print(int(torch._C._GLIBCXX_USE_CXX11_ABI))')"
rm -rf build-gpu; cmake -S . -B build-gpu -G Ninja -DCMAKE_BUILD_TYPE=RelWithDebInfo -DPython3_EXECUTABLE="$PY" \
  -DPJRT_INCLUDE_DIR="$PWD/.pjrt_include" -DTORCH_PJRT_BUILD_TESTS=OFF > "$LOGS/cmake.log" 2>&1 || { tail -30 "$LOGS/cmake.log"; exit 1; }
start=$SECONDS
ninja -C build-gpu -j16 > "$LOGS/build.log" 2>&1 || { grep -E "error" -A3 "$LOGS/build.log" | head -60; exit 1; }
echo "built in $((SECONDS - start)) s; $(grep 'torch_pjrt:' "$LOGS/cmake.log")"
echo "libstdc++ inside _C.so (static copy): $(nm -C --defined-only python/torch_pjrt/_C.so | grep -c 'codecvt<char16_t') symbols;"\
     "linked: $(ldd python/torch_pjrt/_C.so | grep -o 'libstdc++[^ ]* => [^ ]*')"
export PYTHONPATH=python TORCH_PJRT_PLUGIN=${GPU_CHECK_PLUGIN:-cuda} XLA_PYTHON_CLIENT_PREALLOCATE=false PYTHONUNBUFFERED=1 TF_CPP_MIN_LOG_LEVEL=1
cat > /tmp/smoke.py <<'PYEOF'
import sys, torch
step = sys.argv[1]
import torch_pjrt
from torch_pjrt import _C
print("imported", flush=True)
if step == "import": sys.exit(0)
print("platform", _C._platform(), flush=True)
if step == "platform": sys.exit(0)
print("devices", torch.tpu.device_count(), flush=True)
x = torch.arange(6, dtype=torch.float32).to("tpu")
print("uploaded", flush=True)
print("read back", x.cpu(), flush=True)
if step == "copy": sys.exit(0)
with torch_pjrt.mode("strict"):
    y = (x * 2).cpu()
print("strict op", y, flush=True)
with torch_pjrt.mode("fused"):
    a = torch.randn(64, 32); b = torch.randn(32, 16)
    got = (a.to("tpu") @ b.to("tpu")).relu().sum(0).cpu()
print("fused diff", (got - (a @ b).relu().sum(0)).abs().max().item(), flush=True)
PYEOF
first_crash=""
for step in ${GPU_DEBUG_STEPS:-import platform copy all}; do
  echo "== step $step"
  timeout 120 $PY -X faulthandler /tmp/smoke.py $step; rc=$?
  echo "rc $rc"
  if [ $rc -ne 0 ] && [ -z "$first_crash" ]; then first_crash=$step; fi
done
if [ -n "$first_crash" ]; then
  echo "== native backtrace of step $first_crash"
  GDB=$(command -v cuda-gdb || command -v gdb)
  timeout 150 $GDB -q -batch -ex "set pagination off" -ex "set print thread-events off" -ex run -ex bt \
    --args $PY /tmp/smoke.py $first_crash 2>&1 | grep -v "^\[New Thread\|^\[Thread" | tail -60
  exit 1
fi
