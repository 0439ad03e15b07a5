# Quick start: `make demo` and `make test`, on a fresh machine with Python 3.11+.
PYTHON ?= python3
VENV   ?= .venv
BIN    := $(VENV)/bin
# compat: a plain .pth path entry that mypy and pyright follow (setuptools' default editable
# install is an import hook they cannot see: "Cannot find implementation or library stub").
# setuptools calls compat "transitional" (a warning at install). editable_mode=strict also works
# for type checkers (a tree of symlinks) but sees a new module only after a reinstall.
EDITABLE := --config-settings editable_mode=compat
# The package version is written only in this file (pyproject.toml reads it); a change reinstalls,
# so the installed metadata says the same version.
VERSION_FILE := garcon_link/version.py

# Extra pytest arguments for `unit` (e.g. PYTEST_ARGS='-x -q tests/test_cli.py').
PYTEST_ARGS ?=
# pytest-xdist workers for `unit`: auto is one per CPU; 0 runs the tests in pytest's own process.
PYTEST_WORKERS ?= auto
# The tests `unit` selects (pytest -m): all but the chaos soak, a timed run that .ci/run runs
# (it sets PYTEST_MARKERS= , which selects every test).
PYTEST_MARKERS ?= not soak

# Interpreters `make bench` measures, one after the other, each in its own venv (.venv-3.11, ...,
# as `unit-py`): names on PATH or paths. A name that does not run (pyenv's shim of a version that
# is not selected) is looked up in $(pyenv root)/versions. One interpreter: make bench PYTHON=...
PYTHONS ?= python3.11 python3.13
ifeq ($(origin PYTHON),command line)
ifneq ($(origin PYTHONS),command line)
PYTHONS := $(PYTHON)
endif
endif
# More options for python -m benchmarks in `make bench`, e.g. BENCH_ARGS='--quick'
# or BENCH_ARGS='--only floor,ours --repetitions 3'.
BENCH_ARGS ?=

# `make soak`: the chaos soak (tests/soak/test_chaos.py), plain and keyed, and the kill soak
# (tests/soak/test_kill_soak.py: a worker SIGKILLed and restarted on its state directory),
# SOAK_MINUTES each, once per seed of SOAK_SEEDS (a seed replays a fault or kill schedule; none:
# the chaos soak draws a fresh seed and the kill soak uses its fixed one, each printed), e.g.
# make soak SOAK_MINUTES=15 SOAK_SEEDS='2789515527 17'.
SOAK_MINUTES ?= 5
SOAK_SEEDS ?=

.PHONY: demo test quick lint typecheck unit unit-py docs verify soak bench bench-venv clean

$(BIN)/python:
	@$(PYTHON) -c 'import sys; sys.exit(0 if sys.version_info >= (3, 11) else "Python 3.11+ is required")'
	$(PYTHON) -m venv $(VENV)
	$(BIN)/python -m pip install --quiet --upgrade pip

$(VENV)/.installed: pyproject.toml Makefile $(VERSION_FILE) | $(BIN)/python
	$(BIN)/python -m pip install --quiet $(EDITABLE) -e .
	@touch $@

# The test extra and the docs extra in one pip run: `make test` also builds the site.
$(VENV)/.installed-test: pyproject.toml Makefile $(VERSION_FILE) | $(BIN)/python
	$(BIN)/python -m pip install --quiet $(EDITABLE) -e '.[test,docs]'
	@touch $@ $(VENV)/.installed $(VENV)/.installed-docs

$(VENV)/.installed-docs: pyproject.toml Makefile $(VERSION_FILE) | $(BIN)/python
	$(BIN)/python -m pip install --quiet $(EDITABLE) -e '.[docs]'
	@touch $@ $(VENV)/.installed

# The peers (bench extra) and uvloop (fast extra); a peer that does not install under this
# interpreter is left out with a note, and python -m benchmarks reports it as not installed.
$(VENV)/.installed-bench: pyproject.toml Makefile $(VERSION_FILE) | $(BIN)/python
	$(BIN)/python -m pip install --quiet $(EDITABLE) -e '.[bench,fast]' || { \
	  $(BIN)/python -m pip install --quiet $(EDITABLE) -e . && \
	  $(BIN)/python -c 'import tomllib; extras = tomllib.load(open("pyproject.toml", "rb"))["project"]["optional-dependencies"]; print(*extras["bench"], *extras["fast"], sep="\n")' | \
	  while IFS= read -r requirement; do \
	    $(BIN)/python -m pip install --quiet "$$requirement" || \
	      echo "bench: '$$requirement' does not install under $(PYTHON); left out" >&2; \
	  done; }
	@touch $@ $(VENV)/.installed

demo: $(VENV)/.installed
	$(BIN)/garcon-link demo

lint: $(VENV)/.installed-test
	$(BIN)/ruff check .
	$(BIN)/ruff format --check garcon_link tests benchmarks examples

typecheck: $(VENV)/.installed-test
	$(BIN)/mypy --strict garcon_link tests benchmarks

# Bytecode is written even where PYTHONDONTWRITEBYTECODE is set (compileall first, the variable
# emptied for pytest): the suite starts a few hundred Python child processes (CLI, workers,
# examples), each of which would compile the package again, and pytest would rewrite the tests'
# asserts again in every worker on every run (collection: 11 s of CPU instead of 3.5 s).
# --dist worksteal: the test durations range from milliseconds to a minute; an idle worker takes
# queued tests from a busy one.
# The tests marked `latency` (a legitimate peer's latency or liveness measured under a flood)
# run after the others, one at a time: on 2 cores a neighbouring test's load, not the code,
# would otherwise decide them. pytest's exit status 5 (nothing selected, e.g. PYTEST_ARGS naming
# other files) is not a failure of that second pass.
unit: $(VENV)/.installed-test
	@$(BIN)/python -m compileall -q garcon_link tests examples benchmarks
	PYTHONDONTWRITEBYTECODE= $(BIN)/python -m pytest -n $(PYTEST_WORKERS) --dist worksteal \
		-m '$(if $(PYTEST_MARKERS),($(PYTEST_MARKERS)) and )not latency' $(PYTEST_ARGS)
	PYTHONDONTWRITEBYTECODE= $(BIN)/python -m pytest -n 0 \
		-m '$(if $(PYTEST_MARKERS),($(PYTEST_MARKERS)) and )latency' $(PYTEST_ARGS); \
		status=$$?; test $$status = 0 || test $$status = 5

# The test suite under another interpreter, in its own venv (.venv-3.12, ...); lint and
# typecheck run once, under the default interpreter (`make test`).
#   make unit-py PY=/root/.pyenv/versions/3.13.0/bin/python3 [PYTEST_ARGS=...]
unit-py:
	@test -n "$(PY)" || { echo "usage: make unit-py PY=/path/to/python3.X"; exit 2; }
	$(MAKE) unit PYTHON='$(PY)' \
		VENV=.venv-$$('$(PY)' -c 'import sys; print("%d.%d" % sys.version_info[:2])')

# lint first (seconds); then mypy and, after it, the documentation site's strict build run
# alongside the tests (one core for about a minute in all, while the tests wait on sockets and
# timers), their output printed after the tests'.
test: lint
	@out=$$(mktemp); site=$$(mktemp); \
	{ $(MAKE) --no-print-directory typecheck > "$$out" 2>&1; echo $$? > "$$out.status"; \
	  $(MAKE) --no-print-directory docs > "$$site" 2>&1; } & checks=$$!; \
	$(MAKE) --no-print-directory unit; unit=$$?; \
	wait $$checks; docs=$$?; status=$$(cat "$$out.status"); cat "$$out"; \
	if test $$docs = 0; then echo "docs: the site builds (make docs)"; \
	else cat "$$site"; echo "docs: the site does not build in strict mode (make docs)"; fi; \
	rm -f "$$out" "$$out.status" "$$site"; \
	test $$unit = 0 && test $$status = 0 && test $$docs = 0

# The documentation site, from docs/ and the docstrings (mkdocs.yml), into site/; strict: a
# warning (a broken link or anchor, a docstring griffe cannot read) fails the build.
# NO_MKDOCS_2_WARNING: mkdocs-material's banner about its successor, printed on every build.
# No --quiet: it hides the warnings that --strict turns into the failure being looked for.
docs: $(VENV)/.installed-docs
	NO_MKDOCS_2_WARNING=1 $(BIN)/mkdocs build --strict

# The fast loop while editing: the tests without the soak and those marked `slow` (the demo, the
# examples, end-to-end runs of child processes); no lint or typecheck. `make test` runs them all.
quick:
	$(MAKE) --no-print-directory unit PYTEST_MARKERS='not soak and not slow'

# Exhaustive model checking of the session/resume/takeover protocol at a larger bound than the
# test suite's (tests/test_model.py), then two controllers on one worker; a few minutes. Other
# bounds: python -m tests.model --help.
verify: $(VENV)/.installed-test
	$(BIN)/python -m tests.model --preset verify
	$(BIN)/python -m tests.model --preset controllers

# Every seed runs even when one fails; the exit status says whether any did.
soak: $(VENV)/.installed-test
	@status=0; \
	for seed in $(or $(strip $(SOAK_SEEDS)),fresh); do \
	  if [ "$$seed" = fresh ]; then unset GARCON_SOAK_SEED; else export GARCON_SOAK_SEED=$$seed; fi; \
	  echo "== chaos and kill soaks: $(SOAK_MINUTES) min per mode, seed $$seed"; \
	  $(BIN)/python -m pytest -q -s tests/soak/test_chaos.py tests/soak/test_kill_soak.py \
	    --soak-minutes $(SOAK_MINUTES) \
	    || { echo "== a soak FAILED: seed $$seed"; status=1; }; \
	done; \
	exit $$status

bench-venv: $(VENV)/.installed-bench

# The benchmarks under each of PYTHONS (echo entries on plain asyncio), garcon_link's resume,
# memory and fleet figures under the first only, the floors and ours on uvloop under the last;
# one report side by side in benchmarks/README.md (see benchmarks/versions.py).
bench:
	@set -e; pythons=; \
	for name in $(PYTHONS); do \
	  python=$$name; \
	  if ! "$$python" -c '' 2>/dev/null; then \
	    python=$$(ls -d "$$(pyenv root 2>/dev/null)"/versions/*/bin/"$$name" 2>/dev/null | sort -V | tail -n 1); \
	    test -n "$$python" || { echo "bench: no interpreter '$$name' (set PYTHONS=...)" >&2; exit 2; }; \
	  fi; \
	  version=$$("$$python" -c 'import sys; print("%d.%d" % sys.version_info[:2])'); \
	  $(MAKE) --no-print-directory bench-venv PYTHON="$$python" VENV=.venv-$$version; \
	  pythons="$$pythons --python .venv-$$version/bin/python"; \
	done; \
	first=$$(echo $$pythons | cut -d' ' -f2); \
	echo "$$first -m benchmarks$$pythons $(BENCH_ARGS)"; \
	"$$first" -m benchmarks $$pythons $(BENCH_ARGS)

clean:
	rm -rf $(VENV) .venv-3.* build site *.egg-info .mypy_cache .pytest_cache .ruff_cache
