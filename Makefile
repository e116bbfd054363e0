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

test: $(STAMP)
	$(VENV)/bin/python -m pytest -n $(WORKERS) $(ARGS)

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
