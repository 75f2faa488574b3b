# rlhf-flow: the local stack and the tests. The README's first two commands are `make demo` and `make test`.
#
#   make install   .venv with the whole stack (instant when pyproject.toml has not changed)
#   make up        S3 emulator + Ray head + Airflow on 127.0.0.1 (tools/stack.py; idempotent)
#   make down      stop them (S3 saved to .scratch/s3-snapshot first); `make status` shows them
#   make demo      install + up + one run of the rlhf_pipeline DAG, followed to its report
#   make test      the test suite without slow and GPU tests; `make test-all` adds the slow ones
#   make clean     down + remove .scratch (every stack's state, the DeepSpeed op cache, test scratch)

SHELL := /bin/bash
PYTHON ?= python3
VENV ?= .venv
BIN := $(VENV)/bin
PY := $(BIN)/python
STAMP := $(VENV)/.rlhf-flow-installed
PYTEST_ARGS ?=

.PHONY: install up down status demo test test-all clean

install: $(STAMP)

# torch first, pinned: it resolves to the CPU build available locally. Installing anything that depends
# on torch before it would pull the multi-GB CUDA build from the index instead.
$(STAMP): pyproject.toml
	@test -x $(PY) || $(PYTHON) -m venv $(VENV)
	$(PY) -m pip install -U pip
	$(PY) -m pip install torch==2.13.0
	DS_BUILD_OPS=0 $(PY) -m pip install -e ".[airflow,train,dev]"
	@touch $@

up: install
	$(PY) tools/stack.py up

down:
	@if [ -x $(PY) ]; then $(PY) tools/stack.py down; fi

status:
	@if [ -x $(PY) ]; then $(PY) tools/stack.py status; else echo "no $(VENV): run make install"; fi

demo: up
	$(PY) tools/demo.py

test: install
	$(PY) -m pytest -m "not slow and not gpu" $(PYTEST_ARGS)

test-all: install
	$(PY) -m pytest -m "not gpu" $(PYTEST_ARGS)

# Stops every stack under .scratch (the developer's, and any test stack or Ray head a killed test run
# left behind), then removes the folder.
clean:
	@if [ -x $(PY) ] && [ -d .scratch ]; then \
	  for pids in $$(find .scratch -type d -name pids 2>/dev/null); do \
	    RLHF_SCRATCH="$$(dirname "$$pids")" $(PY) tools/stack.py down --no-snapshot --force || true; \
	  done; \
	fi
	@# Ray temp dirs that long scratch paths moved to /tmp (see tools/STACK.md)
	@for link in $$(find .scratch -type l -name ray 2>/dev/null); do \
	  target="$$(readlink "$$link")"; case "$$target" in /tmp/rlhf-ray-*) rm -rf "$$target";; esac; \
	done
	rm -rf .scratch
