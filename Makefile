# make demo   creates .venv, installs accord, runs every example under `accord run -n 4`
# make test   creates .venv, installs accord with its test extras, runs the test suite

PYTHON ?= python3
VENV   := .venv
PY     := $(VENV)/bin/python
# Re-installs when pyproject.toml changes; `rm -rf .venv` starts over.
STAMP  := $(VENV)/.accord-installed
NPROC  ?= 4
DEMOS  := broadcast all_gather scatter mlp_sync uneven_shards eval_metrics async_overlap torch_ddp

.PHONY: demo test install clean

install: $(STAMP)

$(STAMP): pyproject.toml
	@test -x $(PY) || $(PYTHON) -m venv $(VENV)
	$(PY) -m pip install --quiet -e '.[test]'
	@touch $@

demo: $(STAMP)
	@set -e; for demo in $(DEMOS); do \
		echo "== accord run -n $(NPROC) examples/$$demo.py"; \
		$(VENV)/bin/accord run -n $(NPROC) examples/$$demo.py; \
	done

test: $(STAMP)
	$(PY) -m pytest -q

clean:
	rm -rf build *.egg-info .pytest_cache
