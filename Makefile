# One virtualenv per checkout; every target creates or refreshes it first.
PYTHON ?= python3
VENV ?= .venv
BIN := $(VENV)/bin
# llama.cpp's default -march=native build can emit instructions (AMX, AVX-512) that
# virtual machines refuse with SIGILL; these flags build a portable AVX2 library.
export CMAKE_ARGS ?= -DGGML_NATIVE=OFF -DGGML_AVX=ON -DGGML_AVX2=ON -DGGML_FMA=ON -DGGML_F16C=ON -DGGML_BMI2=ON
# Install a CPU torch first so the HuggingFace extra does not pull a multi-GB CUDA build.
TORCH_SPEC ?= torch==2.13.0
export HF_HUB_OFFLINE := 1
export TRANSFORMERS_OFFLINE := 1
export TOKENIZERS_PARALLELISM := false

STAMP := $(VENV)/.installed

.PHONY: venv demo test lint bench clean

$(STAMP): pyproject.toml Makefile
	$(PYTHON) -m venv $(VENV)
	$(BIN)/python -m pip install -q --upgrade pip
	$(BIN)/python -m pip install -q "$(TORCH_SPEC)"
	$(BIN)/python -m pip install -q -e ".[all,dev]"
	# dsRAG is only a test oracle: its rse.py needs numpy alone, the package pulls much more.
	$(BIN)/python -m pip install -q --no-deps dsrag==0.5.6
	touch $@

venv: $(STAMP)

demo: $(STAMP)
	$(BIN)/python examples/quickstart.py $(ARGS)

lint: $(STAMP)
	$(BIN)/ruff check .
	$(BIN)/ruff format --check .
	$(BIN)/mypy

test: lint
	$(BIN)/pytest -q $(PYTEST_ARGS)

bench: $(STAMP)
	for f in benchmarks/bench_*.py; do echo "== $$f"; $(BIN)/python $$f || exit 1; done

clean:
	rm -rf $(VENV) .pytest_cache .mypy_cache .ruff_cache .hypothesis
