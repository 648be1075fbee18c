# Local setup and the usual entry points. Everything lives in .venv inside the checkout.
#   make serve   set up, fetch the model, start redis + prefill + decode + gateway
#   make test    set up, fetch the model, run the test suite

PYTHON ?= $(shell command -v python3.11 || command -v python3)
VENV := .venv
PY := $(VENV)/bin/python
STAMP := $(VENV)/.pdserve-installed
# Pinned and installed first: a bare `pip install torch` pulls a multi-GB CUDA build.
TORCH ?= torch==2.13.0
# Triton: the GPU kernels (pdkernels/); on CPUs their tests run under its interpreter.
TRITON ?= triton==3.9.0
SUDO := $(shell [ "$$(id -u)" = 0 ] || ! command -v sudo >/dev/null || echo sudo)

.PHONY: serve test setup proto fetch system clean gpu-check kernels-aot

serve: setup system
	$(VENV)/bin/pdserve up

test: setup system
	$(PY) -m pytest -q --durations=25

setup: proto fetch

$(PY):
	$(PYTHON) -m venv $(VENV)

$(STAMP): pyproject.toml | $(PY)
	$(PY) -m pip install $(TORCH) $(TRITON)
	$(PY) -m pip install -e '.[dev]'
	touch $@

proto: $(STAMP)
	$(PY) -m proto.build

fetch: $(STAMP)
	$(VENV)/bin/pdserve model fetch

# Debian packages: redis-server (the prefix directory), g++ (builds the CPU linear kernel).
SYSTEM_PKGS = $(if $(shell command -v redis-server),,redis-server) $(if $(shell command -v c++),,g++)

system:
	@[ -z "$(strip $(SYSTEM_PKGS))" ] || $(SUDO) apt-get install -y $(SYSTEM_PKGS) \
		|| { $(SUDO) apt-get update && $(SUDO) apt-get install -y $(SYSTEM_PKGS); }

# On a GPU machine, with that machine's python3 (torch, triton, transformers, numpy, pytest):
# no setup, no network, no model files. Prints one summary table; exit status 0 if all pass.
GPU_PYTHON ?= python3
gpu-check:
	PYTHONPATH=. $(GPU_PYTHON) -m pdserve.gpucheck $(GPU_CHECK_ARGS)

# Every Triton kernel compiled for an sm_90 GPU on this machine (no GPU needed), at the launch
# parameters the engine uses: registers, spills, shared memory per launch; fails on a compile
# error or a spill in bf16 / fp16. The test suite compiles a subset (pdkernels.aot --quick).
kernels-aot: $(STAMP)
	$(PY) -m pdkernels.aot $(KERNELS_AOT_ARGS)

clean:
	rm -rf $(VENV) build *.egg-info .pytest_cache proto/*_pb2.py proto/*_pb2_grpc.py proto/*_pb2.pyi
	find . -name __pycache__ -type d -prune -exec rm -rf {} +
