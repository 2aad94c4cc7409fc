# HarmonicIO: the commands a newcomer needs.
#   make run    set up (virtualenv, pinned deps, generated code) and run the demo
#   make test   set up and run the test suite
#   make lint   set up and run the linter, the format check and the type checker
#   make topology   (as root) the deployment's networks in network namespaces, tested
PY      ?= python3
VENV    ?= .venv
BIN     := $(VENV)/bin
PROTOS  := $(wildcard proto/hio/proto/*.proto)
GEN     := $(PROTOS:.proto=_pb2.py)
PYTEST_ARGS ?=

.PHONY: setup proto run lint test test-bench test-quick topology images docker bench bench-kd bench-scale soak clean

setup: $(VENV)/.installed proto

$(VENV)/.installed: pyproject.toml constraints.txt
	$(PY) -m venv $(VENV)
	$(BIN)/pip install -q --upgrade pip
	$(BIN)/pip install -q -c constraints.txt -e '.[kd,docker,ansible,dev,openstack]'
	touch $@

proto: $(GEN)

proto/hio/proto/%_pb2.py: proto/hio/proto/%.proto $(VENV)/.installed
	$(BIN)/python -c "import hio.proto as p; p.generate()"

run: setup
	@if docker info >/dev/null 2>&1; then \
	  echo "make run: a Docker engine answers; building the engine images (cached after the first time)"; \
	  $(BIN)/python -m hio.cli images build; \
	else echo "make run: no Docker engine; engines run as local processes (see docs/containers.md)"; fi
	$(BIN)/hio up

# Zero findings expected; the configuration is in pyproject.toml ([tool.ruff],
# [tool.mypy]). Every check runs and prints what it found; the target fails if
# any found something. Product code imports no private name of another module
# (PLC2701, a preview rule, so it runs on its own), and every `# noqa: CODE` /
# `# type: ignore[code]` in it says why after the code.
SUPPRESSION_WITHOUT_REASON := \#[[:space:]]*(noqa(:[[:space:]]*[A-Z]+[0-9]+([,[:space:]]+[A-Z]+[0-9]+)*)?|type:[[:space:]]*ignore(\[[^]]*\])?)[[:space:]]*$$
PRODUCT := hio gateway master worker repository kd proto benchmarks

lint: setup
	@status=0; \
	for check in "$(BIN)/ruff check ." \
	             "$(BIN)/ruff check --preview --select PLC2701 ." \
	             "$(BIN)/ruff format --check --output-format concise ." \
	             "$(BIN)/mypy"; do \
	  echo "make lint: $$check"; $$check || status=1; \
	done; \
	echo "make lint: noqa / type: ignore without a reason"; \
	if grep -rnE '$(SUPPRESSION_WITHOUT_REASON)' --include='*.py' --exclude='*_pb2*.py' $(PRODUCT); then status=1; fi; \
	exit $$status

# The tests of a marker expression: two processes (pytest-xdist, a module's tests in one
# process; each starts its own servers on free ports), then one process those marked alone: they
# measure what a test beside them would change (the phases experiment's worker-seconds). Exit
# status 5 is pytest's "no test selected": an expression may select none of one kind.
define run_tests
@status=0; \
$(BIN)/python -m pytest -n 2 --dist loadfile --no-loadscope-reorder -m "not alone and ($(1))" $(PYTEST_ARGS) || status=1; \
$(BIN)/python -m pytest -m "alone and ($(1))" $(PYTEST_ARGS); rc=$$?; [ $$rc -eq 0 ] || [ $$rc -eq 5 ] || status=1; \
exit $$status
endef

# Everything but the benchmark harness's runs of real systems (test-bench).
test: setup
	$(call run_tests,not harness)

# The benchmark harness's own runs of real systems, small (a smoke run of every system, the
# scale curves, bench-core, bench-floor, the phases experiment): the benchmarks run them first.
test-bench: setup
	$(call run_tests,harness)

test-quick: setup
	$(BIN)/python -m pytest -n 2 -m "not slow and not spark and not docker and not harness" $(PYTEST_ARGS)

# As root: the edge, public and private networks of docs/deploy.md as network namespaces behind
# a router whose firewall is deploy.md's table; real roles in them, tuples streamed through, a
# worker cut off, a port blocked (tests/topology/). Skipped, saying why, without root.
topology: setup
	$(BIN)/python -m pytest -s -p no:cacheprovider tests/topology $(PYTEST_ARGS)

images: setup
	$(BIN)/python -m hio.cli images build

# As root on Debian: install and start a Docker engine if none answers, then
# build the images offline (debootstrap base, host wheelhouse).
docker: setup
	bash .ci/setup-docker.sh

# The full grid and the bursts as one run (resumed where it stopped; --fresh starts a new run);
# regenerates docs/benchmarks.md and the README's performance section from its CSV.
bench: setup test-bench
	$(BIN)/hio bench --readme README.md

bench-kd: setup
	$(BIN)/hio bench-kd

# The master's routes/s by channels, the repository's restart and index by records, KD's interval
# by records stored: CSVs, plots and docs/benchmarks/scale.md (benchmarks/scale.py). The 10 M
# record stores take minutes to fill; they are kept under var/bench-scale for later runs.
bench-scale: setup test-bench
	$(BIN)/hio bench-scale

# Hours of steady load in minutes, checking memory, files and threads stay flat (benchmarks/soak.py).
soak: setup
	$(BIN)/python -m benchmarks.soak

clean:
	rm -rf $(VENV) var build *.egg-info proto/hio/proto/*_pb2*.py* .pytest_cache .mypy_cache .ruff_cache
