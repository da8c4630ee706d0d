# Two entry points: `make demo` and `make test`. Both create .venv on a fresh machine and
# install under constraints.txt (torch==2.13.0, the local CPU build) so pip never pulls a CUDA torch.
PYTHON ?= python3
VENV := .venv
PY := $(VENV)/bin/python
PIP := $(PY) -m pip install -c constraints.txt
STAMP_DEV := $(VENV)/.installed-dev

.PHONY: demo test test-fast lint install clean

$(PY):
	$(PYTHON) -m venv $(VENV)
	$(PY) -m pip install --quiet --upgrade pip

# setup.py and csrc/*.c: `pip install -e` compiles the native kernels (rltool/_native*.so), so a
# changed kernel is rebuilt by the next make.
$(STAMP_DEV): pyproject.toml constraints.txt setup.py $(wildcard csrc/*.c) | $(PY)
	$(PIP) --quiet torch==2.13.0
	$(PIP) --quiet -e '.[dev]'
	touch $@

install: $(STAMP_DEV)

demo: $(STAMP_DEV)
	$(PY) -m rltool.demo

test: $(STAMP_DEV)
	$(PY) -m pytest -q -p no:cacheprovider

test-fast: $(STAMP_DEV)
	$(PY) -m pytest -q -m "not slow" -p no:cacheprovider

# ruff, pinned in constraints.txt; its rules (bugs, not style) and why are in pyproject.toml.
lint: $(STAMP_DEV)
	$(VENV)/bin/ruff check rltool tests benchmarks

clean:
	rm -rf $(VENV) build *.egg-info rltool/_native*.so
