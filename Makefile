# `make demo`: the whole flow on Multi30k En->De, from a fresh clone to a BLEU score:
# install, prep, bpe, train for MINUTES (default 15), average the last 5 checkpoints,
# choose the length penalty on the valid split (nmt tune), translate test2016 with it (beam
# 4), score.
# Re-running resumes where it stopped (training budgets are totals).
#   make demo MINUTES=5          a shorter training budget
#   make demo MIRROR=            force the real download instead of ../shared/data/multi30k
#   make demo ALPHA=0.6          one length penalty, no choice (0.6: the paper's, and
#                                nmt translate's default)

SHELL := /bin/bash
.SHELLFLAGS := -eo pipefail -c
PYTHON ?= python3
VENV ?= .venv
MINUTES ?= 15
# The length penalty, chosen for each model by `nmt tune` on the valid split (alpha 0.6 to
# 1.4: valid BLEU's best among the alphas at which the model does not ramble; see
# docs/translating.md) and kept in RUN/decoding.json, which translate then uses. ALPHA=x
# decodes with x and skips the choice.
ALPHA ?=
RECIPE := multi30k-en-de
DATA ?= data/$(RECIPE)
RUN ?= runs/$(RECIPE)
SHARED_MIRROR := ../shared/data/multi30k
MIRROR ?= $(if $(wildcard $(SHARED_MIRROR)/train.en),$(SHARED_MIRROR),)
NMT := $(VENV)/bin/nmt

# `make test`: the README's test command. Installs the dev extra, runs the whole suite, then
# the kernel-sensitive tests (marker `isa`) again with every library's CPU kernels capped at
# AVX2, no native bf16 (oneDNN, PyTorch's own, MKL, FBGEMM, CTranslate2): what a CPU
# without AVX-512 runs, checked on any x86-64 machine.
AVX2_ENV := ONEDNN_MAX_CPU_ISA=AVX2 ATEN_CPU_CAPABILITY=avx2 MKL_ENABLE_INSTRUCTIONS=AVX2 \
	FBGEMM_ENABLE_INSTRUCTIONS=AVX2 CT2_FORCE_CPU_ISA=AVX2

# Two test workers (pytest-xdist), each taking whole files so a module's fixtures are built
# once: most tests run one thread or wait on a subprocess starting torch, so one worker left
# the second core of a 2-core CI machine idle. TEST_WORKERS=0 runs them in this process.
TEST_WORKERS ?= 2
PYTEST := $(VENV)/bin/python -m pytest -n $(TEST_WORKERS) --dist loadfile

.PHONY: demo install test check docs gpu-offline-files
install: $(VENV)/.installed

# The C kernels are compiled by the install (setup.py): a change to them reinstalls.
KERNEL_SOURCES := setup.py $(wildcard nmt/kernels/*.c nmt/kernels/*.h) nmt/kernels/levels.py

$(VENV)/.installed: pyproject.toml $(KERNEL_SOURCES)
	$(PYTHON) -m venv $(VENV)
	$(VENV)/bin/pip install -q torch==2.13.0 -e .
	touch $@

$(VENV)/.installed-dev: pyproject.toml $(KERNEL_SOURCES)
	$(PYTHON) -m venv $(VENV)
	$(VENV)/bin/pip install -q torch==2.13.0 -e '.[dev]'
	touch $@ $(VENV)/.installed

test: $(VENV)/.installed-dev
	$(PYTEST)
	$(AVX2_ENV) $(PYTEST) -m isa

# `make check`: the fast loop while you work (README): no training runs, multi-process or
# fault-injection runs, wheel builds.
check: $(VENV)/.installed-dev
	$(PYTEST) -m "not slow"

# `make docs`: regenerate docs/reference/cli.md and docs/reference/api.md from the code, and
# the generated blocks of README.md and docs/*.md (docs/generate.py; tests/test_docs.py
# fails while a committed one differs).
docs: install
	$(VENV)/bin/python docs/generate.py

demo: install
	$(NMT) prep $(RECIPE) -o $(DATA) $(if $(MIRROR),--mirror $(MIRROR))
	$(NMT) bpe $(DATA)
	$(NMT) train $(DATA) -o $(RUN) --max-minutes $(MINUTES)
	$(NMT) average $(RUN) --last 5 -o $(RUN)/average.pt
	$(if $(ALPHA),,$(NMT) tune -m $(RUN)/average.pt)
	$(NMT) translate -m $(RUN)/average.pt -i $(DATA)/test.src -o $(RUN)/test.hyp \
		$(if $(ALPHA),--alpha $(ALPHA))
	$(NMT) score --ref $(DATA)/test.tgt -i $(RUN)/test.hyp --metrics bleu,chrf \
		| tee $(RUN)/test.score
	@echo "model:       $(RUN)/average.pt (checkpoints and train_log.jsonl in $(RUN)/)"
	@echo "translation: $(RUN)/test.hyp  (source $(DATA)/test.src, reference $(DATA)/test.tgt)"
	@echo "scores:      $(RUN)/test.score"

# `make gpu-offline-files`: what bench/gpu_session.py needs on a GPU machine without network
# access that a machine with torch usually lacks, fetched here (where there is network) into
# the git-ignored bench/gpu_offline/: wheels of sacremoses and its dependencies for the GPU
# machine's Python (GPU_PY, default 3.12; x86-64 Linux), and a copy of the shared data
# (Multi30k; newstest2014 for the beam-search bench). Copy the checkout, bench/gpu_offline/
# included, to the GPU machine and run python3 bench/gpu_session.py there (see its
# docstring): it installs from those wheels and reads that data.
GPU_PY ?= 3.12
gpu-offline-files:
	mkdir -p bench/gpu_offline/wheels bench/gpu_offline/shared/multi30k \
		bench/gpu_offline/shared/wmt14
	$(PYTHON) -m pip download -q --only-binary=:all: --python-version $(GPU_PY) \
		--platform manylinux2014_x86_64 --platform manylinux_2_17_x86_64 \
		-d bench/gpu_offline/wheels sacremoses
	cp ../shared/data/multi30k/* bench/gpu_offline/shared/multi30k/
	cp ../shared/data/wmt14/newstest2014.* bench/gpu_offline/shared/wmt14/
	du -sh bench/gpu_offline
