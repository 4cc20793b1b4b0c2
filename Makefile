# One command installs and runs the demo (`make demo`), one runs the tests (`make test`).
PYTHON ?= python3
VENV   := .venv
BIN    := $(VENV)/bin
STAMP  := $(VENV)/.installed

.PHONY: install demo test redis bench clean

# The routing decision's and the request path's modules are compiled in place by the install (setup.py, proxy/native.py);
# after an edit of the package, `make` compiles them again (until then they run from source).
NATIVE     := $(VENV)/.native
NATIVE_SRC := setup.py $(shell find proxy -name '*.py' -not -name native_built.py)

$(STAMP): pyproject.toml
	$(PYTHON) -m venv $(VENV)
	$(BIN)/pip install -q --upgrade pip
	$(BIN)/pip install -q -e '.[dev]'
	touch $(STAMP) $(NATIVE)

$(NATIVE): $(NATIVE_SRC) | $(STAMP)
	$(BIN)/pip install -q --no-deps -e .
	touch $(NATIVE)

install: $(STAMP) $(NATIVE)

demo: $(STAMP) $(NATIVE)
	$(BIN)/vllm-proxy demo

redis:  # installs redis-server if missing; tests start their own on a free port
	@sh deploy/ensure-redis.sh

# The suite mostly waits on real servers (streams, timeouts under test, subprocesses), so it runs
# in 4 processes even on 2 cores; whole files per process, so module-scoped fleets start once.
# `make test PYTEST_ARGS=` runs it in one process.
PYTEST_ARGS ?= -n 4 --dist loadfile --no-loadscope-reorder

test: $(STAMP) $(NATIVE) redis  # each test process compiles the project once, not on every import (~7 s)
	env -u PYTHONDONTWRITEBYTECODE $(BIN)/python -m pytest $(PYTEST_ARGS)

bench: $(STAMP) $(NATIVE)
	$(BIN)/python -m loadtest.overhead

# Benchmark report (loadtest/report.py): JSON, Markdown summary and PNG plots in
# loadtest/results/report-<timestamp>/. `make report REPORT_ARGS=--quick` for the ~5 minute version.
.PHONY: report
REPORT_ARGS ?=
report: $(STAMP) $(NATIVE) redis
	$(BIN)/pip install -q -e '.[dev,bench]'
	$(BIN)/python -m loadtest.report $(REPORT_ARGS)

clean:
	rm -rf $(VENV) .pytest_cache
