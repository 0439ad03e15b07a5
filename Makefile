# Quick start: `make demo` and `make test`, on a fresh machine with Python 3.11+.
PYTHON ?= python3
VENV   ?= .venv
BIN    := $(VENV)/bin
# compat: a plain .pth path entry that mypy and pyright follow (setuptools' default editable
# install is an import hook they cannot see: "Cannot find implementation or library stub").
# setuptools calls compat "transitional" (a warning at install). editable_mode=strict also works
# for type checkers (a tree of symlinks) but sees a new module only after a reinstall.
EDITABLE := --config-settings editable_mode=compat

.PHONY: demo test lint typecheck unit bench clean

$(BIN)/python:
	@$(PYTHON) -c 'import sys; sys.exit(0 if sys.version_info >= (3, 11) else "Python 3.11+ is required")'
	$(PYTHON) -m venv $(VENV)
	$(BIN)/python -m pip install --quiet --upgrade pip

$(VENV)/.installed: pyproject.toml Makefile | $(BIN)/python
	$(BIN)/python -m pip install --quiet $(EDITABLE) -e .
	@touch $@

$(VENV)/.installed-test: pyproject.toml Makefile | $(BIN)/python
	$(BIN)/python -m pip install --quiet $(EDITABLE) -e '.[test]'
	@touch $@ $(VENV)/.installed

$(VENV)/.installed-bench: pyproject.toml Makefile | $(BIN)/python
	$(BIN)/python -m pip install --quiet $(EDITABLE) -e '.[test,bench]'
	@touch $@ $(VENV)/.installed-test $(VENV)/.installed

demo: $(VENV)/.installed
	$(BIN)/garcon-link demo

lint: $(VENV)/.installed-test
	$(BIN)/ruff check .
	$(BIN)/ruff format --check garcon_link

typecheck: $(VENV)/.installed-test
	$(BIN)/mypy --strict garcon_link

unit: $(VENV)/.installed-test
	$(BIN)/python -m pytest

test: lint typecheck unit

bench: $(VENV)/.installed-bench
	$(BIN)/python -m benchmarks

clean:
	rm -rf $(VENV) build *.egg-info .mypy_cache .pytest_cache .ruff_cache
