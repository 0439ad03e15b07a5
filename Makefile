# Quick start: `make demo` and `make test`, on a fresh machine with Python 3.11+.
PYTHON ?= python3
VENV   ?= .venv
BIN    := $(VENV)/bin
# compat: a plain .pth path entry that mypy and pyright follow (setuptools' default editable
# install is an import hook they cannot see: "Cannot find implementation or library stub").
# setuptools calls compat "transitional" (a warning at install). editable_mode=strict also works
# for type checkers (a tree of symlinks) but sees a new module only after a reinstall.
EDITABLE := --config-settings editable_mode=compat

# Extra pytest arguments for `unit` (e.g. PYTEST_ARGS='-x -q tests/test_cli.py').
PYTEST_ARGS ?=

.PHONY: demo test lint typecheck unit unit-py verify bench clean

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
	$(BIN)/python -m pytest $(PYTEST_ARGS)

# The test suite under another interpreter, in its own venv (.venv-3.12, ...); lint and
# typecheck run once, under the default interpreter (`make test`).
#   make unit-py PY=/root/.pyenv/versions/3.13.0/bin/python3 [PYTEST_ARGS=...]
unit-py:
	@test -n "$(PY)" || { echo "usage: make unit-py PY=/path/to/python3.X"; exit 2; }
	$(MAKE) unit PYTHON='$(PY)' \
		VENV=.venv-$$('$(PY)' -c 'import sys; print("%d.%d" % sys.version_info[:2])')

test: lint typecheck unit

# Exhaustive model checking of the session/resume/takeover protocol at a larger bound than the
# test suite's (tests/test_model.py); a few minutes. Other bounds: python -m tests.model --help.
verify: $(VENV)/.installed-test
	$(BIN)/python -m tests.model --preset verify

bench: $(VENV)/.installed-bench
	$(BIN)/python -m benchmarks

clean:
	rm -rf $(VENV) .venv-3.* build *.egg-info .mypy_cache .pytest_cache .ruff_cache
