# The two set-up commands are `make demo` and `make test`; both create .venv on first use.
PYTHON ?= $(shell command -v python3.11 || command -v python3)
VENV := .venv
BIN := $(VENV)/bin
STAMP := $(VENV)/.installed
REFVENV ?= /work/refvenv

.PHONY: demo test test-quick test-slow bench clean reference-env

$(STAMP): pyproject.toml
	test -x $(BIN)/python || $(PYTHON) -m venv $(VENV)
	$(BIN)/pip install -q --upgrade pip
	$(BIN)/pip install -q -e '.[test]'
	touch $(STAMP)

demo: $(STAMP)
	$(BIN)/hybridmoe demo

test: $(STAMP)
	$(BIN)/python -m pytest -q -n 2 --dist loadgroup --no-loadscope-reorder --durations=0 --durations-min=1

# The tests a change touches (scripts/affected_tests.py): those importing a module changed since BASE
# (default HEAD: the uncommitted change), directly or through the package. `make test` before submitting.
BASE ?= HEAD
test-quick: $(STAMP)
	@files="$$($(BIN)/python scripts/affected_tests.py $(BASE))"; \
	if [ -z "$$files" ]; then echo "no test imports what changed since $(BASE)"; \
	else $(BIN)/python -m pytest -q -n 2 --dist loadgroup --no-loadscope-reorder $$files; fi

test-slow: $(STAMP)
	$(BIN)/python -m pytest -q -m slow

# The PyTorch reference venv of benchmarks/ (Python 3.12, pinned; see benchmarks/reference/README.md),
# made in REFVENV: /work/refvenv unless you name another folder (make reference-env REFVENV=DIR).
reference-env:
	benchmarks/reference/setup.sh $(REFVENV)

clean:
	rm -rf $(VENV) runs .pytest_cache
