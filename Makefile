# `make test` and `make demo` work on a fresh machine: they build .venv first.
PYTHON ?= python3
VENV := .venv
# `make ... PY=python3` runs that interpreter instead and builds no venv (STAMP is then empty).
PY := $(VENV)/bin/python
STAMP := $(if $(filter $(VENV)/bin/python,$(PY)),$(VENV)/.installed)

.PHONY: test test-device demo bench clean
DEMO := demo_out
# 8 faked CPU devices (dp 2 x mp 4) when there is no accelerator; the flag only affects the host platform.
DEMO_ENV := XLA_FLAGS=--xla_force_host_platform_device_count=8

$(VENV)/.installed: requirements.txt requirements-dev.txt
	$(PYTHON) -m venv $(VENV)
	$(PY) -m pip install -q --upgrade pip
	$(PY) -m pip install -q -r requirements-dev.txt
	touch $@

# Two pytest workers: most of a test is one process compiling, which leaves the second core idle (on 2 cores the
# suite takes about three quarters of its one-process time).
test: $(STAMP)
	$(PY) -m pytest -q -n 2 tests

# The device tier (tests/device): the chip against the CPU, and every script end to end on the chip. Collected only
# where a TPU or GPU is attached, in one process (one program at a time can hold a chip). On a TPU VM without a venv,
# with the requirements installed for python3: make test-device PY=python3
test-device: $(STAMP)
	MTJ_TEST_TIER=device $(PY) -m pytest -q tests/device

demo: $(STAMP)
	rm -rf $(DEMO)
	$(PY) demo_corpus.py $(DEMO)/corpus
	$(PY) create_finetune_tfrecords.py $(DEMO)/corpus/train train --output-dir $(DEMO)/data --seq 64
	$(PY) create_finetune_tfrecords.py $(DEMO)/corpus/val val --output-dir $(DEMO)/data --seq 64 --preserve-data-order
	$(DEMO_ENV) $(PY) device_train.py --config configs/demo.json
	$(PY) plot_metrics.py $(DEMO)/model
	@echo "--- a sample from the trained model, prompt 'def __init__(self':"
	$(DEMO_ENV) $(PY) device_sample.py --ckpt $(DEMO)/model --prompt "def __init__(self" \
		--max-new-tokens 48 --temperature 1.0 --top-k 40 --seed 3
	@echo "metrics: $(DEMO)/model/metrics.jsonl  loss plot: $(DEMO)/model/loss.png  TensorBoard: $(DEMO)/model/tensorboard"

bench: $(STAMP)
	$(PY) bench/bench_model.py

clean:
	rm -rf $(VENV) .pytest_cache
