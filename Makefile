# One command installs and runs the demo (`make demo`), one runs the tests (`make test`).
PYTHON ?= python3
VENV   := .venv
BIN    := $(VENV)/bin
STAMP  := $(VENV)/.installed

.PHONY: install demo test redis bench clean

$(STAMP): pyproject.toml
	$(PYTHON) -m venv $(VENV)
	$(BIN)/pip install -q --upgrade pip
	$(BIN)/pip install -q -e '.[dev]'
	touch $(STAMP)

install: $(STAMP)

demo: $(STAMP)
	$(BIN)/vllm-proxy demo

redis:
	@sh deploy/ensure-redis.sh

test: $(STAMP) redis
	$(BIN)/python -m pytest

bench: $(STAMP)
	$(BIN)/python -m loadtest.overhead

clean:
	rm -rf $(VENV) .pytest_cache
