# Set-up in two commands on a fresh machine: `make demo` and `make test`.
# Each creates .venv and installs on first use (torch pinned to the release the project is tested
# with, then mla with its dev extra); later calls reuse it and re-install when pyproject.toml
# changes. Extra arguments: `make demo ARGS='--steps 8'`, `make test ARGS='-x tests/test_kit.py'`.
# `make test` runs the tests on every core (pytest-xdist, `-n auto`); `make test WORKERS=0` runs
# them in this one process (for `--pdb`, `-s`).
# An engine with its own torch skips this and installs by hand (README, "Install, run, test").

PYTHON ?= python3
VENV := .venv
STAMP := $(VENV)/.installed
TORCH := torch==2.13.0
ARGS ?=
WORKERS ?= auto

.PHONY: demo test lint clean-venv

demo: $(STAMP)
	$(VENV)/bin/mla demo $(ARGS)

# --dist loadfile: the tests of one file run on one worker, so a module fixture that compiles
# kernels (tests/gluon/test_host_launch.py) runs once per run, not once per worker (`loadgroup`
# would group finer, but pytest 9.2 drops its groups silently: pytest-xdist issue 1386).
# --no-loadscope-reorder: the files in collection order, which tests/conftest.py starts with the
# files of `heavy` tests (xdist would otherwise start with the files of most tests and leave the
# few long ones to the end). Both are pytest-xdist options, given here so that a plain
# `python -m pytest` needs no xdist.
XDIST := --dist loadfile --no-loadscope-reorder

test: $(STAMP)
	$(VENV)/bin/python -m pytest -n $(WORKERS) $(XDIST) $(ARGS)

lint: $(STAMP)
	$(VENV)/bin/ruff check mla tests benchmarks
	$(VENV)/bin/mypy

$(STAMP): pyproject.toml
	test -x $(VENV)/bin/python || $(PYTHON) -m venv $(VENV)
	$(VENV)/bin/python -m pip install $(TORCH)
	$(VENV)/bin/python -m pip install -e '.[dev]'
	touch $@

clean-venv:
	rm -rf $(VENV)
