# hmscale — two commands on a fresh machine:  make demo   |   make test
#
# The torch build is an explicit choice:
#   make test                 TORCH=cpu  (default) installs torch==$(TORCH_VERSION), the CPU build where the
#                             machine provides it (set TORCH_INDEX=https://download.pytorch.org/whl/cpu elsewhere)
#   make demo TORCH=cuda      installs the CUDA build of torch from PyPI (several GB); add
#                             ARGS="-s parallel.use_gpu=true -s parallel.bf16=true" to train on the GPU
# ARGS passes overrides to `hmscale run`, e.g.  make demo ARGS="-s budget.total_tokens=200000 -s output_dir=runs/demo-200k"
# (runs/demo holds one run: other training settings go to another output_dir)
# (the demo also scores 2048-token rows, 8x its training rows, by position: eval.context_length)
PYTHON        ?= python3
VENV          ?= .venv
TORCH         ?= cpu
TORCH_VERSION ?= 2.13.0
TORCH_INDEX   ?=
ARGS          ?=
TEST_WORKERS  ?= 2
GPU_TRITON    ?= 3.6.0
BIN           := $(VENV)/bin

ifeq ($(TORCH),cpu)
  TORCH_SPEC := torch==$(TORCH_VERSION)
else ifeq ($(TORCH),cuda)
  TORCH_SPEC := torch
else
  $(error TORCH must be cpu or cuda, got '$(TORCH)')
endif
TORCH_FLAGS := $(if $(TORCH_INDEX),--index-url $(TORCH_INDEX),)

.PHONY: demo test venv clean gpu-wheels compile-check

$(BIN)/python:
	$(PYTHON) -m venv $(VENV)
	$(BIN)/python -m pip install -q --upgrade pip

$(VENV)/.installed-$(TORCH): pyproject.toml | $(BIN)/python
	$(BIN)/python -m pip install -q $(TORCH_FLAGS) "$(TORCH_SPEC)"
	$(BIN)/python -m pip install -q -e '.[dev]'
	rm -f $(VENV)/.installed-*
	touch $@

venv: $(VENV)/.installed-$(TORCH)

demo: venv
	$(BIN)/hmscale run -s eval.context_length=2048 $(ARGS)

test: venv
	$(BIN)/python -m pytest -q -n $(TEST_WORKERS) --dist loadgroup tests

gpu-wheels: venv
	PYTHON=$(BIN)/python bash ../shared/gpu/fetch_wheels.sh

# every SSD kernel launch compiled for sm_90 with the GPU image's Triton, on the CPU (before spending device time)
compile-check: venv
	PYTHON=$(BIN)/python bash benchmarks/compile_check.sh $(GPU_TRITON)

clean:
	rm -rf runs .pytest_cache
