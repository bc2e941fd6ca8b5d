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

# The suite also runs on llama-index-core 0.14.20, the last core with `llama_pack` and
# `llama_index.core.download`: a second virtualenv with the same install, core pinned.
OLD_CORE ?= 0.14.20
OLD_VENV ?= .venv-core$(OLD_CORE)
OLD_BIN := $(OLD_VENV)/bin
OLD_STAMP := $(OLD_VENV)/.installed

# llama.cpp's own HTTP server, for the served-model tests (tests/served) and benchmark: built once
# per machine from the llama.cpp sources inside the llama-cpp-python sdist (the version installed
# in the venv), portable flags as above, and cached by version in the user's cache folder (so new
# clones on the same machine reuse it); tests find it there, or at $SELF_RAG_RSE_LLAMA_SERVER.
# It links the libraries llama-cpp-python already built from those sources (libllama, libggml*,
# libmtmd), so only llama.cpp's common library and the server compile: 11 min end to end on
# 2 cores (measured), against 19 min of compiling alone for a full build; the server then runs
# the very code the in-process critic runs. If linking them fails, it builds everything.
# The steps are in scripts/build_llama_server.py, which reads these variables from the environment.
export LLAMA_SERVER_CACHE ?= $(HOME)/.cache/llama-index-packs-self-rag-rse/llama-server
export LLAMA_SERVER_JOBS ?= 2
export LLAMA_SERVER_CMAKE_ARGS ?= -DCMAKE_BUILD_TYPE=Release -DBUILD_SHARED_LIBS=OFF \
	-DGGML_OPENMP=OFF -DLLAMA_CURL=OFF -DLLAMA_OPENSSL=OFF -DLLAMA_BUILD_SERVER=ON \
	-DLLAMA_BUILD_TESTS=OFF -DLLAMA_BUILD_EXAMPLES=OFF -DLLAMA_BUILD_UI=OFF -DLLAMA_USE_PREBUILT_UI=OFF

.PHONY: venv demo test lint bench clean test-core-$(OLD_CORE) llama-server check-install

$(STAMP): pyproject.toml Makefile
	$(PYTHON) -m venv $(VENV)
	$(BIN)/python -m pip install -q --upgrade pip
	$(BIN)/python -m pip install -q "$(TORCH_SPEC)"
	$(BIN)/python -m pip install -q -e ".[all,dev,eval]"
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
	# The size rules (statements, module length, no formatter opt-outs): docs/contributing.md.
	$(BIN)/python scripts/check_size.py

test: lint check-install llama-server test-core-$(OLD_CORE)
	$(BIN)/pytest -q $(PYTEST_ARGS)

# The wheel in a fresh virtualenv with its declared dependencies only (steps in the script).
check-install: $(STAMP)
	$(BIN)/python scripts/check_install.py

# Prints the binary's path; a no-op (seconds) once the binary for this version is cached.
llama-server: $(STAMP)
	@$(BIN)/python scripts/build_llama_server.py

$(OLD_STAMP): pyproject.toml Makefile
	$(PYTHON) -m venv $(OLD_VENV)
	$(OLD_BIN)/python -m pip install -q --upgrade pip
	$(OLD_BIN)/python -m pip install -q "$(TORCH_SPEC)"
	$(OLD_BIN)/python -m pip install -q -e ".[all,dev]" "llama-index-core==$(OLD_CORE)"
	$(OLD_BIN)/python -m pip install -q --no-deps dsrag==0.5.6
	touch $@

test-core-$(OLD_CORE): $(OLD_STAMP)
	$(OLD_BIN)/python -c "import llama_index.core as c; assert c.__version__ == '$(OLD_CORE)', c.__version__"
	$(OLD_BIN)/pytest -q $(PYTEST_ARGS)

bench: $(STAMP) llama-server
	for f in benchmarks/bench_*.py; do echo "== $$f"; $(BIN)/python $$f || exit 1; done

clean:
	rm -rf $(VENV) $(OLD_VENV) .pytest_cache .mypy_cache .ruff_cache .hypothesis
