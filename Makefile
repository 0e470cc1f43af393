# Quick start: `make demo` and `make test` work on a fresh machine.
PY ?= python3
VENV := .venv
BIN := $(VENV)/bin
TORCH ?= torch==2.13.0
STAMP := $(VENV)/.installed
DEMO_STAMP := $(VENV)/.installed-demo
ALL_EXTRAS := test,dev,demo,integrations,lowbit,ray

.PHONY: setup demo test test-fast lint typecheck rules unit doctest bench stress clean

# the venv, then this package with extras $(1), torch pinned in the same pip call: no extra may
# replace it. pip byte-compiles on one core; compileall on every core after it (a fresh install
# of every extra: 107 s, against 39 + 35 s; a file that does not compile is left, as pip leaves it)
define install
	test -x $(BIN)/python || $(PY) -m venv $(VENV)
	$(BIN)/pip install -q --upgrade pip >/dev/null 2>&1 || true
	$(BIN)/pip install -q --no-compile "$(TORCH)" -e ".[$(1)]"
	$(BIN)/python -m compileall -q -j 0 $(VENV)/lib >/dev/null 2>&1 || true
endef

# `make demo` installs what the demo needs; every other target all the extras, the demo's too
$(DEMO_STAMP): pyproject.toml
	$(call install,demo)
	touch $(DEMO_STAMP)

$(STAMP): pyproject.toml
	$(call install,$(ALL_EXTRAS))
	touch $(STAMP) $(DEMO_STAMP)

setup: $(STAMP)

demo: $(DEMO_STAMP)
	$(BIN)/python -m zero_functional demo

lint: $(STAMP)
	$(BIN)/ruff format --check conftest.py src tests property_tests benchmarks
	$(BIN)/ruff check conftest.py src tests property_tests benchmarks

typecheck: $(STAMP)
	$(BIN)/mypy --strict src

doctest: $(STAMP)
	$(BIN)/pytest -q --doctest-modules src

rules: $(STAMP)
	$(BIN)/python .ci/rules.py

# three workers on two cores, work-stealing: the tests also wait (on ranks, subprocesses, links,
# timeouts), and a third worker fills the gaps (issue 42: 622 s with two, 543-563 s with three,
# the machine then 1.8 of 2 cores busy)
unit: $(STAMP)
	$(BIN)/pytest -q -n 3 --dist worksteal -m "not bench" --durations=12 tests property_tests

# the quick checks two at a time, then the tests on both cores with mypy beside them: a fresh
# mypy takes a minute of one core, which the tests' ranks leave idle while they wait
test: $(STAMP)
	$(MAKE) --no-print-directory -j2 --output-sync=target lint rules doctest
	$(MAKE) --no-print-directory -j2 unit typecheck

# every test that starts no process: tests/unit (its conftest fails one that does) and the properties
test-fast: $(STAMP)
	$(BIN)/pytest -q -m "not bench" tests/unit property_tests

# the exit stress test at 60 rounds (make test runs 8): two spawned ranks per round, no abort
stress: $(STAMP)
	EXIT_STRESS_ROUNDS=60 $(BIN)/pytest -q tests/dist/test_teardown.py -k never_abort

bench: $(STAMP)
	$(BIN)/python -m zero_functional bench
	$(BIN)/python -m zero_functional bench --link 2gbit
	$(BIN)/python -m zero_functional bench --link 10gbit
	$(BIN)/pytest -q -m bench tests

clean:
	rm -rf $(VENV) build *.egg-info src/*.egg-info .pytest_cache .mypy_cache .ruff_cache
