# The two commands of the README: `make serve` and `make test`. Both create and reuse .venv/.
# `make serve` installs what serving needs, disaggregated: the base package, the `serve` extra
# (torch, safetensors, and what xgrammar needs but triton: CPU serving runs no Triton kernel, and
# triton is 1 GB of the 2.2 GB an `engine` install takes), then xgrammar and NIXL without their
# declared dependencies (NIXL_CPU: the nixl loader and the one backend wheel a CPU machine loads,
# not its CUDA 12 twin). `make test` adds the `engine`, `test`, `chart`, `ray` and `k8s` extras.
# Flags go to `splitserve serve` through ARGS; secrets through the environment, never ARGS (make
# would print them and hand them to every child in MAKEFLAGS):
#   make serve ARGS="--http-port 8080 --model tiny-qwen2 --prefill-workers 0"
#   SPLITSERVE_API_KEY=... make serve
PY ?= python3
VENV := .venv
BIN := $(VENV)/bin
STAMP := $(VENV)/.installed
TEST_STAMP := $(VENV)/.installed-test
ARGS ?=
MODEL_ARGS ?=
# installed with --no-deps (pins equal to pyproject.toml's: tests/unit/test_makefile.py)
NO_DEPS_PINS := xgrammar==0.2.8 nixl==1.5.1 nixl-cu13==1.5.1

.PHONY: serve test helm-check proto install clean

$(STAMP): pyproject.toml
	$(PY) -m venv $(VENV)
	$(BIN)/pip install -q --upgrade pip
	# the CPU wheel of torch lies on this machine's disk; an unpinned torch pulls a CUDA build
	$(BIN)/pip install -q torch==2.13.0
	$(BIN)/pip install -q -e '.[serve]'
	$(BIN)/pip install -q --no-deps $(NO_DEPS_PINS)
	touch $(STAMP)

$(TEST_STAMP): $(STAMP)
	$(BIN)/pip install -q -e '.[engine,test,chart,ray,k8s]'
	touch $(TEST_STAMP)

install: $(STAMP)

# not echoed (ARGS may hold a secret), and make's own variables stay out of the cluster's environment
serve: $(STAMP)
	@env -u MAKEFLAGS -u MFLAGS -u MAKEOVERRIDES -u MAKELEVEL -u ARGS -u MODEL_ARGS \
		$(BIN)/splitserve serve $(MODEL_ARGS) $(ARGS)

# two lanes (pytest-xdist), one torch thread per process: on a 2-core machine the lanes and the
# clusters' workers would otherwise spin OpenMP threads against each other
test: $(TEST_STAMP) helm-check
	OMP_NUM_THREADS=1 $(BIN)/python -m pytest -q -n 2 --dist loadfile --durations=25 tests

# the chart renders, lints and validates for each value set in helm/splitserve/ci/; the Dockerfiles lint
helm-check: $(TEST_STAMP)
	$(BIN)/python helm/check.py

proto: $(TEST_STAMP)
	$(BIN)/python -m grpc_tools.protoc -I. --python_out=. --pyi_out=. --grpc_python_out=. proto/splitserve/v1/*.proto

clean:
	rm -rf $(VENV)
