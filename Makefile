# spottrain: every target sets up what it needs from nothing (see `setup`).
SHELL := /bin/bash
PYTHON ?= python3
VENV := .venv
PY := $(VENV)/bin/python
STAMP := $(VENV)/.setup-stamp
DEV_STAMP := $(VENV)/.setup-dev-stamp
# Telemetry and version checks try the network; keep the CLI and jsii quiet and offline.
export CHECKPOINT_DISABLE := 1
export DISABLE_VERSION_CHECK := 1
export PATH := $(CURDIR)/$(VENV)/bin:$(PATH)

.PHONY: setup setup-dev lint test test-fast demo drill lifecycle chaos soak bench synth cost review preflight docs lock wheels clean \
	deploy diff destroy output logs prices

## setup: build .venv (the pinned packages of requirements.lock: the trainer, synthesis, the drill;
## Node from PyPI) and the cdktn CLI. Idempotent. What `make demo` needs, and nothing more.
setup: $(STAMP)

$(STAMP): requirements.lock package.json package-lock.json
	test -x $(PY) || $(PYTHON) -m venv $(VENV)
	$(PY) -m pip install --quiet --disable-pip-version-check -r requirements.lock
	$(VENV)/bin/npm ci --no-audit --no-fund --loglevel=error
	touch $(STAMP)

## setup-dev: setup, plus the tests' and tools' pins (requirements-dev.lock: pytest, checkov, ruff,
## mypy, the trackers the sinks' tests drive, ...). `make test` runs it. Idempotent.
setup-dev: $(DEV_STAMP)

$(DEV_STAMP): $(STAMP) requirements-dev.lock
	$(PY) -m pip install --quiet --disable-pip-version-check -r requirements-dev.lock
	touch $(DEV_STAMP)

## lint: ruff on the whole repository, mypy on the packages pyproject.toml's [tool.mypy] files lists.
lint: setup-dev
	$(PY) -m ruff check .
	$(PY) -m mypy

## test: ruff, then the whole suite with mypy beside it (a lint finding fails it): mypy's cold
## minute would otherwise run alone on one core before the suite starts. Workers: one more than the
## 2-core machine's cores, since many tests wait on processes, timers and sockets (TEST_WORKERS=N).
TEST_WORKERS ?= 3
# Bytecode is written (an environment's PYTHONDONTWRITEBYTECODE=1 would have every fresh
# interpreter compile the repository's modules again, and every worker rewrite the test modules'
# asserts: a worker's collection 11 -> 7 CPU-seconds); shipped archives and drill images leave
# __pycache__ out.
test test-fast: export PYTHONDONTWRITEBYTECODE =
test: setup-dev
	$(PY) -m ruff check .
	$(PY) -m mypy & types=$$!; \
	$(PY) -m pytest -n $(TEST_WORKERS) --dist loadgroup; suite=$$?; \
	wait $$types || { echo "make test: mypy found problems (above): the suite fails" >&2; exit 1; }; \
	exit $$suite

## test-fast: the inner loop's tier (configuration, stacks, units; no trainer process, drill or
## emulator end to end): under 3 minutes. `make test` runs these too.
test-fast: setup-dev
	$(PY) -m pytest -n $(TEST_WORKERS) --dist loadgroup -m "fast and not soak"

## demo: what the example experiment creates and costs, then a brief local preemption drill
## (the drill needs root for its namespaces and loop disk; without root the demo says so).
demo: setup
	$(PY) -m stacks.demo
	@if [ "$$(id -u)" -eq 0 ]; then \
		echo "$(PY) -m drill --steps 120 --wipe-disk-round 1"; \
		$(PY) -m drill --steps 120 --wipe-disk-round 1; \
	else \
		echo "demo: skipping the preemption drill: it needs root (mount namespaces, a loop-device disk)."; \
		echo "demo: run it with: sudo make drill"; \
	fi

## drill: the real boot scripts and trainer in a local VM stand-in, preempted K times; fails unless
## the final model equals an uninterrupted run's. Needs root. DRILL_ARGS=--soak for the long one;
## DRILL_ARGS="--nodes 2 --preemptions 1 --steps 600" drills a multi-node pool.
## EXPERIMENT=drill/experiments/two-gpus.toml drills any experiment (default: the example), e.g. a
## two-GPU VM: torchrun with one trainer process per GPU (gloo on CPU here).
drill: setup
	$(PY) -m drill $(if $(EXPERIMENT),--experiment $(EXPERIMENT)) $(DRILL_ARGS)

## lifecycle: the experiment's synthesized stack deployed to a fake project, trained, preempted,
## finished, scaled to zero and destroyed; lists what is left and its monthly cost, and fails unless
## that is exactly the bucket and key docs/deploy.md promises (needs root; a few minutes).
## EXPERIMENT=name or path; LIFECYCLE_ARGS="--preemptions 2 --steps 180".
lifecycle: setup
	$(PY) -m drill.lifecycle $(if $(EXPERIMENT),--experiment $(EXPERIMENT)) $(LIFECYCLE_ARGS)

## chaos: the promise under real faults, fault x moment, against the real trainer; prints the table
## RELIABILITY.md records (about 30 min; needs root). CHAOS_CELLS="gcs-*:startup,pd-full" runs a part;
## CHAOS_ARGS="--record RELIABILITY.md" writes a full run's table into it.
chaos: setup
	$(PY) -m drill.chaos $(if $(CHAOS_CELLS),--cells '$(CHAOS_CELLS)') $(CHAOS_ARGS)

## soak: the long crash-consistency runs, then the long drill (~8 min).
soak: setup-dev
	SPOTTRAIN_SOAK_KILLS=$${SPOTTRAIN_SOAK_KILLS:-300} $(PY) -m pytest -m soak -p no:xdist
	$(PY) -m drill --soak

## bench: the benchmarks; figures go into BENCHMARKS.md by hand.
bench: setup
	$(PY) -m bench $(BENCH)

## synth: synthesize every experiment into cdktf.out/ (what `npx cdktn synth` does), with the
## wheels its committed lock names (fetched once into build/wheels/, never resolved).
synth: setup
	$(VENV)/bin/npx cdktn synth

## lock: resolve the VMs' dependencies (the trainer's and code_dir/requirements.txt) into the lock
## files you commit: locks/pyX.Y-glibcA.B.lock, or requirements.pyX.Y-glibcA.B.lock next to a
## requirements.txt; for each image's Python and the drill's. Run it after changing requirements;
## it keeps locked versions that still fit. EXPERIMENT=name or path for one; UPGRADE=1 takes the
## newest releases. See docs/dependencies.md.
lock: setup
	$(PY) -m stacks.lock $(EXPERIMENT) $(if $(UPGRADE),--upgrade)

## wheels: fetch every experiment's locked wheels into build/wheels/ (synth does it too, once per
## lock); run it before working offline. Resolves nothing. EXPERIMENT=name or path for one.
wheels: setup
	$(PY) -m stacks.wheels $(EXPERIMENT)

## deploy, diff, destroy, output: `npx cdktn VERB` for one experiment, EXPERIMENT=name (a file
## experiments/NAME.toml) or a path, with the venv's Node (cdktn needs >= 22.19); they need
## Terraform >= 1.5 (or OpenTofu) and `gcloud auth application-default login`, and say so.
## CDKTN_ARGS="--auto-approve" passes more arguments to cdktn.
deploy diff destroy output: setup
	$(PY) -m stacks.deploy $@ $(EXPERIMENT) $(CDKTN_ARGS)

## cost: expected cost, Spot against on-demand, of every experiment (or EXPERIMENT=name or path).
cost: setup
	$(PY) -m stacks.cost $(EXPERIMENT)

## prices: regenerate stacks/prices.json from the Cloud Billing Catalog API with your
## application-default credentials (make prices [PRICE_REGIONS="us-central1 europe-west4"]).
prices: setup
	$(PY) -m stacks.price_catalog $(PRICE_REGIONS)

## preflight: before a deploy, with your application-default credentials: APIs enabled, GPU quota,
## machine type per zone, image family, Spot obtainability (make preflight EXPERIMENT=name or path).
preflight: setup
	$(PY) -m stacks.preflight $(EXPERIMENT)

## logs: a deployed experiment's sessions across VMs and how each ended, from Cloud Logging, with
## your application-default credentials (make logs EXPERIMENT=name [LOGS_ARGS="--since 2d --lines"]).
logs: setup
	$(PY) -m stacks.logs $(EXPERIMENT) $(LOGS_ARGS)

## review: offline infrastructure review against the branch yours tracks (else origin/HEAD), or
## make review BASE=origin/main [HEAD=rev].
review: setup
	$(PY) -m stacks.review $(BASE) $(HEAD)

## docs: regenerate docs/reference/ (experiment fields, trainer flags and settings) from the code.
docs: setup
	$(PY) -m stacks.reference

clean:
	rm -rf cdktf.out .pytest_cache build/code
