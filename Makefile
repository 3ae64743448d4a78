# Targets create .venv at the repo root and install into it; constraints.txt pins torch for
# these machines (torch 2.14.1 and torchvision 0.29.1 come from the local disk).
PYTHON ?= python3
VENV := .venv
PY := $(VENV)/bin/python
STAMP := $(VENV)/.installed

.PHONY: venv test demo report bench-balance clean

venv: $(STAMP)

$(STAMP): pyproject.toml constraints.txt
	$(PYTHON) -m venv $(VENV)
	$(PY) -m pip install -q --upgrade pip
	$(PY) -m pip install -q -c constraints.txt -e '.[dev]'
	touch $(STAMP)

# The tests. pytest's own exit code is kept: 5 ("no tests collected") fails like any other.
test: venv
	$(PY) -m pytest -q -p no:cacheprovider tests

# The main job: the ViT example, pp=2 x tp=2 on 4 CPU processes, on the bundled digits dataset.
demo: venv
	OMP_NUM_THREADS=1 $(VENV)/bin/torchrun --standalone --nproc-per-node 4 examples/vit_cifar10.py --pp 2 --tp 2 --epochs 3

# Plan a large model without allocating it.
report: venv
	$(VENV)/bin/autopipe report timm:vit_large_patch16_224 --pp 4 --chunks 2 --batch 256 --microbatches 16 --json plan.json --figure plan.png

bench-balance: venv
	$(PY) benchmarks/balance_quality.py

clean:
	rm -rf $(VENV) .pytest_cache
