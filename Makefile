# Two entry points that work on a fresh clone: `make demo` and `make test`.
VENV ?= .venv
PY := $(VENV)/bin/python
STAMP := $(VENV)/.installed

.PHONY: setup demo test

setup: $(STAMP)

# torch is installed first and pinned: the CPU wheel; a bare `torch` would pull a CUDA build.
$(STAMP): pyproject.toml
	python3 -m venv $(VENV)
	$(PY) -m pip install -q --upgrade pip
	$(PY) -m pip install -q torch==2.13.0
	$(PY) -m pip install -q -e ".[test]"
	# speculators as a real consumer (tests/test_speculators_consumer.py), without its dependencies: they would
	# pull torchvision / torchaudio and a CUDA torch; what its import needs is in the test extra.
	$(PY) -m pip install -q --no-deps speculators==0.9.0 hs-connectors==0.9.0
	touch $(STAMP)

demo: setup
	$(VENV)/bin/eagle31-export demo --pair examples/tiny/models --out out/demo

test: setup
	$(PY) -m pytest -q tests
