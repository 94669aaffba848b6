# vllm_accel: `make demo` and `make test` work from a fresh clone on a CPU machine.
# Everything goes into the virtualenv .venv/ in the repository root.

PYTHON    ?= python3.11
VENV      ?= .venv
EXTRAS    ?= cpu,test,bench
PY        := $(VENV)/bin/python
ACCEL     := $(VENV)/bin/vllm-accel
STAMP     := $(VENV)/.vllm-accel-installed
NPROC     := $(shell nproc)

# vLLM-CPU binds to one core and reserves another by default; use them all.
export VLLM_CPU_OMP_THREADS_BIND ?= 0-$(shell echo $$(( $(NPROC) - 1 )))
export VLLM_CPU_NUM_OF_RESERVED_CPU ?= 0

.PHONY: setup demo test test-unit test-integration bench-base lint clean

setup: $(STAMP)

$(STAMP): pyproject.toml setup.py
	test -x $(PY) || $(PYTHON) -m venv $(VENV)
	$(PY) -m pip install --quiet --upgrade pip
	$(PY) -m pip install --quiet -e ".[$(EXTRAS)]"
	# PyPI's torchvision/torchaudio/torchcodec break `import transformers` beside torch 2.13+cpu.
	$(PY) -m pip uninstall --yes --quiet torchvision torchaudio torchcodec || true
	$(PY) -c "import vllm, vllm_accel.plugin; print('vLLM', vllm.__version__, 'ready')"
	touch $(STAMP)

demo: setup
	$(ACCEL) fetch-model default
	$(ACCEL) demo --json results/demo.json --plot results/demo.png

test: setup
	$(ACCEL) fetch-model default
	$(PY) -m pytest tests --benchmark-disable --timeout 1800 -p no:cacheprovider --durations=25

test-unit: setup
	$(PY) -m pytest tests/unit --benchmark-disable -p no:cacheprovider

test-integration: setup
	$(ACCEL) fetch-model default
	$(PY) -m pytest tests/integration --timeout 1800 -p no:cacheprovider

bench-base: setup
	$(ACCEL) bench base --json results/bench-base.json --plot results/bench-base.png

lint: setup
	$(PY) -m ruff check vllm_accel tests benchmarks

clean:
	rm -rf $(VENV) build *.egg-info results vllm_accel/_C_sam*.so vllm_accel/_C_kivi*.so
