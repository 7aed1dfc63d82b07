# The two commands of the README: `make serve` and `make test`. Both create and reuse .venv/.
# `make serve` installs only what serving needs (the base package and the `engine` extra);
# `make test` adds the `test`, `chart`, `ray` and `k8s` extras. Flags go to `splitserve serve` through ARGS:
#   make serve ARGS="--http-port 8080 --model tiny-qwen2 --prefill-workers 0"
PY ?= python3
VENV := .venv
BIN := $(VENV)/bin
STAMP := $(VENV)/.installed
TEST_STAMP := $(VENV)/.installed-test
ARGS ?=
MODEL_ARGS ?=

.PHONY: serve test helm-check proto install clean

$(STAMP): pyproject.toml
	$(PY) -m venv $(VENV)
	$(BIN)/pip install -q --upgrade pip
	# the CPU wheel of torch lies on this machine's disk; an unpinned torch pulls a CUDA build
	$(BIN)/pip install -q torch==2.13.0
	$(BIN)/pip install -q -e '.[engine]'
	touch $(STAMP)

$(TEST_STAMP): $(STAMP)
	$(BIN)/pip install -q -e '.[engine,test,chart,ray,k8s]'
	touch $(TEST_STAMP)

install: $(STAMP)

serve: $(STAMP)
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
