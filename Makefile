PY ?= python3
PLUGIN_SO = $(shell $(PY) -c "import xla_plugins.xla_cpu_pjrt as m, os; print(os.path.join(os.path.dirname(m.__file__), 'xla_cpu_pjrt.so'))" 2>/dev/null)

deps:
	$(PY) -m pip install -q torch==2.13.0 xla-cpu-pjrt==0.0.1 numpy pytest
	command -v ninja >/dev/null || $(PY) -m pip install -q ninja
	test -f /usr/include/gtest/gtest.h || (apt-get update -q && apt-get install -y -q libgtest-dev ccache)

build: deps
	cmake -S . -B build -G Ninja -DCMAKE_BUILD_TYPE=Release -DTORCH_PJRT_BUILD_EXTENSION=OFF
	ninja -C build -j2

test: build
	cd build && ctest --output-on-failure

.PHONY: deps build test
