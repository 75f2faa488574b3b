# rlhf-flow: the local stack and the tests. The README's first two commands are `make demo` and `make test`.
#
#   make install   .venv with the whole stack, pinned by locks/dev.txt (instant when nothing changed)
#   make lock      re-resolve locks/*.txt from pyproject.toml's ranges (tools/lock.py); commit the result
#   make up        S3 emulator + Ray head + Airflow on 127.0.0.1 (python -m tools.stack; idempotent)
#   make down      stop them (S3 objects stay in .scratch/s3-data); `make status` shows them
#   make demo      install + up + one run of the rlhf_pipeline DAG, followed to its report
#   make readme-table RUN=<run id> (or REPORT=path): README.md's demo table from that run's eval report (tools/readme_table.py)
#   make export    RUN=<run id> (or CHAMPION=1) [ROOT=s3://bucket/prefix] [OUT=dir]: that run's policy as a plain HF folder, verified (tools/export.py)
#   make test      lock check, then the test suite without slow and GPU tests; `make test-all` adds the slow ones
#   make test-fast the unit tests only (no stack, no Ray head, no DeepSpeed op builds): the edit loop
#   make lint      ruff check and ruff format --check (every test target runs it first)
#   make clean     down + remove .scratch (every stack's state, the DeepSpeed op cache, test scratch)

SHELL := /bin/bash
PYTHON ?= python3
VENV ?= .venv
BIN := $(VENV)/bin
PY := $(BIN)/python
STAMP := $(VENV)/.rlhf-flow-installed
PYTEST_ARGS ?=
TEST_WORKERS ?= 0
XDIST := $(if $(filter 0,$(TEST_WORKERS)),,-n $(TEST_WORKERS) --dist loadgroup)
PIP_VERSION := 26.3
LOCK := locks/dev.txt

.PHONY: install lock check-lock up down status demo export readme-table test test-all test-fast lint clean

install: $(STAMP)

# Every version comes from the lock (pip constraints), so two fresh machines install the same stack.
# torch first: it resolves to the CPU build available locally. Installing anything that depends on torch
# before it would pull the multi-GB CUDA build from the index instead. The lock's sha256 is recorded in
# the venv; every stage's manifest copies it (tasks/common/manifest.py).
$(STAMP): pyproject.toml $(LOCK)
	@$(PYTHON) tools/lock.py check
	@test -x $(PY) || $(PYTHON) -m venv $(VENV)
	$(PY) -m pip install pip==$(PIP_VERSION)
	$(PY) -m pip install -c $(LOCK) torch
	DS_BUILD_OPS=0 $(PY) -m pip install -c $(LOCK) -e ".[airflow,train,dev]"
	@printf '{"set": "dev", "sha256": "%s"}\n' "$$($(PYTHON) tools/lock.py hash dev)" > $(VENV)/rlhf-flow-lock.json
	@touch $@

# Needs the venv only for uv (the dev extra); resolves against the package index, so it is never run by CI.
lock: install
	$(PY) tools/lock.py generate

check-lock:
	@$(PYTHON) tools/lock.py check

up: install
	$(PY) -m tools.stack up

down:
	@if [ -x $(PY) ]; then $(PY) -m tools.stack down; fi

status:
	@if [ -x $(PY) ]; then $(PY) -m tools.stack status; else echo "no $(VENV): run make install"; fi

demo: up
	$(PY) tools/demo.py

OUT ?= exported-model
readme-table: install
	$(PY) -m tools.readme_table $(if $(REPORT),--report '$(REPORT)',--run '$(RUN)') $(if $(ROOT),--root '$(ROOT)')

export: install
	$(PY) -m tools.export $(if $(CHAMPION),--champion,--run '$(RUN)') $(if $(ROOT),--root '$(ROOT)') --out '$(OUT)'

# TEST_WORKERS=n runs n pytest-xdist workers: the tests on the shared local stack (one group, tests/conftest.py)
# in one, the rest spread over the others. Worth it with cores to spare: on 2 cores two training tests at once
# oversubscribe them (each trains on 2 threads; measured with some other load too: the demo run took 1,715 s
# beside the other worker, 451 s alone), so the default is one process.
test: check-lock install lint
	$(PY) -m pytest $(XDIST) -m "not slow and not gpu" $(PYTEST_ARGS)

test-all: check-lock install lint
	$(PY) -m pytest $(XDIST) -m "not gpu" $(PYTEST_ARGS)

test-fast: install lint
	$(PY) -m pytest $(XDIST) -m "not slow and not gpu and not e2e and not ray" $(PYTEST_ARGS)

# pyflakes' checks, pycodestyle's errors and warnings, import order (pyproject.toml's tool.ruff); seconds.
lint: install
	$(BIN)/ruff check --no-cache .
	$(BIN)/ruff format --check --no-cache .

# Stops every stack under .scratch (the developer's, and any test stack or Ray head a killed test run
# left behind), then removes the folder.
clean:
	@if [ -x $(PY) ] && [ -d .scratch ]; then \
	  for pids in $$(find .scratch -type d -name pids 2>/dev/null); do \
	    RLHF_SCRATCH="$$(dirname "$$pids")" $(PY) -m tools.stack down || true; \
	  done; \
	fi
	@# Ray temp dirs that long scratch paths moved to /tmp (see tools/STACK.md)
	@for link in $$(find .scratch -type l -name ray 2>/dev/null); do \
	  target="$$(readlink "$$link")"; case "$$target" in /tmp/rlhf-ray-*) rm -rf "$$target";; esac; \
	done
	rm -rf .scratch
