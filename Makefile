# make demo   creates .venv, installs accord (numpy only), runs every example under `accord run -n 4`
#              (elastic_training.py with --max-restarts 1; examples/ray_*.py with python where Ray is installed)
# make test   creates .venv, installs accord with its test extras, runs the test suite
# make docs   creates .venv, installs the docs extra, builds the site into site/ (warnings are errors)

PYTHON ?= python3
VENV   := .venv
PY     := $(VENV)/bin/python
# Each stamp re-installs when pyproject.toml, setup.py or the C helper changes (the
# editable install compiles accord/transport/ring_core.c in place); `rm -rf .venv` starts over.
DEMO_STAMP := $(VENV)/.accord-demo
TEST_STAMP := $(VENV)/.accord-test
DOCS_STAMP := $(VENV)/.accord-docs
NPROC  ?= 4
DEMOS  := broadcast all_gather scatter mlp_sync uneven_shards eval_metrics async_overlap torch_ddp torch_accelerate \
          torch_fsdp torch_dtensor torch_checkpoint torch_pipeline
# run with python (each starts a local Ray), where ray is installed (the "ray" extra)
RAY_DEMOS := ray_collective ray_train

.PHONY: demo test docs install clean

install: $(TEST_STAMP)

$(PY):
	$(PYTHON) -m venv $(VENV)

$(DEMO_STAMP): pyproject.toml setup.py accord/transport/ring_core.c | $(PY)
	$(PY) -m pip install --quiet -e .
	@touch $@

$(TEST_STAMP): pyproject.toml setup.py accord/transport/ring_core.c | $(PY)
	$(PY) -m pip install --quiet -e '.[test]'
	@touch $@

$(DOCS_STAMP): pyproject.toml setup.py accord/transport/ring_core.c | $(PY)
	$(PY) -m pip install --quiet -e '.[docs]'
	@touch $@

# The torch example runs only where torch is installed (make test installs it).
demo: $(DEMO_STAMP)
	@set -e; for demo in $(DEMOS); do \
		if grep -q '^import torch' examples/$$demo.py && ! $(PY) -c 'import torch' 2>/dev/null; then \
			echo "== skipping examples/$$demo.py: it needs PyTorch ($(VENV)/bin/pip install torch, or make test, which installs it)"; \
			continue; \
		fi; \
		echo "== accord run -n $(NPROC) examples/$$demo.py"; \
		$(VENV)/bin/accord run -n $(NPROC) examples/$$demo.py; \
	done; \
	echo "== accord run -n $(NPROC) --max-restarts 1 examples/elastic_training.py (a rank kills itself; its restart is admitted)"; \
	$(VENV)/bin/accord run -n $(NPROC) --max-restarts 1 examples/elastic_training.py; \
	if $(PY) -c 'import ray, torch' 2>/dev/null; then \
		for demo in $(RAY_DEMOS); do echo "== python examples/$$demo.py (a local Ray)"; $(PY) examples/$$demo.py; done; \
	else \
		echo "== skipping examples/ray_*.py: they need Ray and PyTorch ($(VENV)/bin/pip install -e '.[ray]' torch, or make test)"; \
	fi

# Two workers (pytest-xdist): most of the suite's time is waiting (timeouts that must
# fire, ranks seen stopped, processes and Ray clusters starting), which two workers
# overlap: 18.4 min serially, 10.5 with two, an hour apart on a 2-vCPU host. Ray's test
# files share one worker (their xdist_group), as each starts a local Ray cluster.
test: $(TEST_STAMP)
	$(PY) -m pytest -q -n 2 --dist loadgroup

docs: $(DOCS_STAMP)
	$(VENV)/bin/mkdocs build --strict --site-dir site

clean:
	rm -rf build dist site *.egg-info .pytest_cache accord/transport/ring_core.*.so
