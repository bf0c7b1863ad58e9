# spottrain: every target sets up what it needs from nothing (see `setup`).
SHELL := /bin/bash
PYTHON ?= python3
VENV := .venv
PY := $(VENV)/bin/python
STAMP := $(VENV)/.setup-stamp
# Telemetry and version checks try the network; keep the CLI and jsii quiet and offline.
export CHECKPOINT_DISABLE := 1
export DISABLE_VERSION_CHECK := 1
export PATH := $(CURDIR)/$(VENV)/bin:$(PATH)

.PHONY: setup test demo soak bench synth cost review clean

## setup: build .venv (pinned Python deps, Node from PyPI) and the cdktn CLI. Idempotent.
setup: $(STAMP)

$(STAMP): requirements.lock package.json package-lock.json
	test -x $(PY) || $(PYTHON) -m venv $(VENV)
	$(PY) -m pip install --quiet --disable-pip-version-check -r requirements.lock
	$(VENV)/bin/npm ci --no-audit --no-fund --loglevel=error
	touch $(STAMP)

## test: the whole suite.
test: setup
	$(PY) -m pytest -n 2 --dist loadgroup

## demo: synthesize the example experiment and print what it would create.
demo: setup
	$(PY) -m stacks.demo

## soak: the long crash-consistency runs.
soak: setup
	SPOTTRAIN_SOAK_KILLS=$${SPOTTRAIN_SOAK_KILLS:-300} $(PY) -m pytest -m soak -p no:xdist

## bench: the benchmarks; figures go into BENCHMARKS.md by hand.
bench: setup
	$(PY) -m bench $(BENCH)

## synth: synthesize every experiment into cdktf.out/ (what `npx cdktn synth` does).
synth: setup
	$(VENV)/bin/npx cdktn synth

## cost: expected cost, Spot against on-demand, of every experiment (or EXPERIMENT=path).
cost: setup
	$(PY) -m stacks.cost $(EXPERIMENT)

## review: offline infrastructure review, e.g. make review BASE=origin/main [HEAD=rev].
review: setup
	$(PY) -m stacks.review $(BASE) $(HEAD)

clean:
	rm -rf cdktf.out .pytest_cache
