# Two commands from a fresh clone: `make demo` and `make test`. Both create .venv first.
PYTHON ?= python3
VENV := .venv
PY := $(VENV)/bin/python
STAMP := $(VENV)/.installed

.PHONY: demo test install clean bench

$(STAMP): pyproject.toml
	$(PYTHON) -m venv $(VENV)
	$(PY) -m pip install -q --upgrade pip
	# torch only when missing: the pinned version resolves to the CPU wheel on these machines,
	# and a bare `torch` requirement would pull a multi-GB CUDA build.
	$(PY) -c "import torch" 2>/dev/null || $(PY) -m pip install -q torch==2.13.0
	$(PY) -m pip install -q -e ".[test]"
	touch $(STAMP)

install: $(STAMP)

demo: $(STAMP)
	OMP_NUM_THREADS=1 $(VENV)/bin/torchrun --standalone --nproc-per-node 4 examples/quickstart.py

# --no-loadscope-reorder (pytest-xdist >= 3.8): files go to the workers in collection order, longest first
# (tests/conftest.py: FILE_SECONDS), not by their number of tests.
test: $(STAMP)
	$(PY) -m pytest tests -q --durations=10 -n 2 --dist loadfile --no-loadscope-reorder

bench: $(STAMP)
	$(PY) benchmarks/run_all.py

clean:
	rm -rf $(VENV) build *.egg-info
