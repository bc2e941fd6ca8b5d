# Imported targets standing in for the libraries llama.cpp's full build would compile.
#
# scripts/build_llama_server.py copies this file into the llama.cpp sources of the
# llama-cpp-python sdist as prebuilt.cmake, and includes it where the top CMakeLists.txt added
# src/ (ggml/ and tools/mtmd/ are taken out). Each target points at the shared library that
# llama-cpp-python already built from the same sources (LLAMA_PREBUILT_LIB_DIR, its lib/ folder)
# and carries the include folders and link dependencies that the real target would export, so
# common/ and tools/server/ build against them unchanged.
foreach(name ggml-base ggml-cpu ggml llama mtmd)
    add_library(${name} SHARED IMPORTED GLOBAL)
    set_target_properties(${name} PROPERTIES IMPORTED_LOCATION "${LLAMA_PREBUILT_LIB_DIR}/lib${name}.so")
endforeach()
set(inc "${CMAKE_CURRENT_SOURCE_DIR}")
set_target_properties(ggml-base PROPERTIES INTERFACE_INCLUDE_DIRECTORIES "${inc}/ggml/include")
set_target_properties(ggml PROPERTIES INTERFACE_INCLUDE_DIRECTORIES "${inc}/ggml/include"
    INTERFACE_LINK_LIBRARIES "ggml-base;ggml-cpu")
set_target_properties(llama PROPERTIES INTERFACE_INCLUDE_DIRECTORIES "${inc}/include"
    INTERFACE_LINK_LIBRARIES "ggml")
set_target_properties(mtmd PROPERTIES INTERFACE_INCLUDE_DIRECTORIES "${inc}/tools/mtmd"
    INTERFACE_LINK_LIBRARIES "llama")
