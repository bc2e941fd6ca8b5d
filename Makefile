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
LLAMA_SERVER_CACHE ?= $(HOME)/.cache/llama-index-packs-self-rag-rse/llama-server
LLAMA_SERVER_JOBS ?= 2
LLAMA_SERVER_CMAKE_ARGS ?= -DCMAKE_BUILD_TYPE=Release -DBUILD_SHARED_LIBS=OFF -DGGML_OPENMP=OFF \
	-DLLAMA_CURL=OFF -DLLAMA_OPENSSL=OFF -DLLAMA_BUILD_SERVER=ON -DLLAMA_BUILD_TESTS=OFF \
	-DLLAMA_BUILD_EXAMPLES=OFF -DLLAMA_BUILD_UI=OFF -DLLAMA_USE_PREBUILT_UI=OFF

# Imported targets standing in for the libraries the full build would compile.
define LLAMA_SERVER_PREBUILT_CMAKE
foreach(name ggml-base ggml-cpu ggml llama mtmd)
    add_library($${name} SHARED IMPORTED GLOBAL)
    set_target_properties($${name} PROPERTIES IMPORTED_LOCATION "$${LLAMA_PREBUILT_LIB_DIR}/lib$${name}.so")
endforeach()
set(inc "$${CMAKE_CURRENT_SOURCE_DIR}")
set_target_properties(ggml-base PROPERTIES INTERFACE_INCLUDE_DIRECTORIES "$${inc}/ggml/include")
set_target_properties(ggml PROPERTIES INTERFACE_INCLUDE_DIRECTORIES "$${inc}/ggml/include"
    INTERFACE_LINK_LIBRARIES "ggml-base;ggml-cpu")
set_target_properties(llama PROPERTIES INTERFACE_INCLUDE_DIRECTORIES "$${inc}/include"
    INTERFACE_LINK_LIBRARIES "ggml")
set_target_properties(mtmd PROPERTIES INTERFACE_INCLUDE_DIRECTORIES "$${inc}/tools/mtmd"
    INTERFACE_LINK_LIBRARIES "llama")
endef

.PHONY: venv demo test lint bench clean test-core-$(OLD_CORE) llama-server

llama-server: export PREBUILT_CMAKE := $(LLAMA_SERVER_PREBUILT_CMAKE)

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

test: lint llama-server test-core-$(OLD_CORE)
	$(BIN)/pytest -q $(PYTEST_ARGS)

# Prints the binary's path; a no-op (seconds) once the binary for this version is cached.
llama-server: $(STAMP)
	@version=$$($(BIN)/python -c "import importlib.metadata as m; print(m.version('llama_cpp_python'))") \
	&& out="$(LLAMA_SERVER_CACHE)/$$version" \
	&& if [ -x "$$out/llama-server" ]; then echo "llama-server $$version: $$out/llama-server"; exit 0; fi \
	&& work=$$(mktemp -d) && trap 'rm -rf "$$work"' EXIT && start=$$(date +%s) \
	&& echo "building llama-server $$version (once per machine: ~11 min on 2 cores, ~21 if in full)..." \
	&& $(BIN)/python -m pip download -q --no-deps --no-binary :all: "llama-cpp-python==$$version" -d "$$work" \
	&& lib=$$($(BIN)/python -c "import llama_cpp, pathlib; print(pathlib.Path(llama_cpp.__file__).parent / 'lib')") \
	&& mkdir -p "$$work/fast" "$$work/full" \
	&& tar -xzf "$$work/llama_cpp_python-$$version.tar.gz" -C "$$work/fast" \
	&& tar -xzf "$$work/llama_cpp_python-$$version.tar.gz" -C "$$work/full" \
	&& fast="$$work/fast/llama_cpp_python-$$version/vendor/llama.cpp" \
	&& full="$$work/full/llama_cpp_python-$$version/vendor/llama.cpp" \
	&& if [ -f "$$lib/libllama.so" ] && [ -f "$$lib/libmtmd.so" ] \
		&& sed -i -e 's|^    add_subdirectory(ggml)$$|    # ggml: prebuilt|' \
			-e 's|^add_subdirectory(src)$$|include(prebuilt.cmake)|' \
			-e '/^include(GNUInstallDirs)$$/,$$d' "$$fast/CMakeLists.txt" \
		&& sed -i 's|^    add_subdirectory(mtmd)$$|    # mtmd: prebuilt|' "$$fast/tools/CMakeLists.txt" \
		&& grep -q 'include(prebuilt.cmake)' "$$fast/CMakeLists.txt" \
		&& printf '%s\n' "$$PREBUILT_CMAKE" > "$$fast/prebuilt.cmake" \
		&& cmake -S "$$fast" -B "$$work/build-fast" $(CMAKE_ARGS) $(LLAMA_SERVER_CMAKE_ARGS) \
			-DLLAMA_PREBUILT_LIB_DIR="$$lib" -DCMAKE_BUILD_RPATH='$$ORIGIN' > "$$work/configure.log" 2>&1 \
		&& cmake --build "$$work/build-fast" --target llama-server -j $(LLAMA_SERVER_JOBS); then \
		mkdir -p "$$out" && cp "$$lib"/lib*.so* "$$out/" && built="$$work/build-fast/bin/llama-server"; \
	else \
		echo "linking llama-cpp-python's libraries failed: building llama.cpp in full" \
		&& cmake -S "$$full" -B "$$work/build-full" $(CMAKE_ARGS) $(LLAMA_SERVER_CMAKE_ARGS) > "$$work/configure.log" \
		&& cmake --build "$$work/build-full" --target llama-server -j $(LLAMA_SERVER_JOBS) \
		&& mkdir -p "$$out" && built="$$work/build-full/bin/llama-server"; \
	fi \
	&& "$$built" --version > /dev/null 2>&1 \
	&& cp "$$built" "$$out/llama-server.tmp" && mv "$$out/llama-server.tmp" "$$out/llama-server" \
	&& echo "built llama-server $$version in $$(( $$(date +%s) - start )) s: $$out/llama-server"

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
