"""Optional dependencies, imported when first needed, with the install command in the error."""

from __future__ import annotations

import importlib
from types import ModuleType

#: The extra of this package that installs each optional top-level module.
EXTRAS = {
    "llama_cpp": "llama-cpp",
    "llama_index.llms.llama_cpp": "llama-cpp",
    "llama_index.embeddings.huggingface": "huggingface",
    "llama_index.vector_stores.qdrant": "qdrant",
    "qdrant_client": "qdrant",
    "matplotlib": "plot",
}

PACKAGE = "llama-index-packs-self-rag-rse"


def optional_import(module: str, feature: str, extra: str | None = None) -> ModuleType:
    """Import ``module`` or raise ``ImportError`` saying which extra installs it for ``feature``."""
    try:
        return importlib.import_module(module)
    except ImportError as error:
        name = extra or EXTRAS.get(module) or EXTRAS.get(module.split(".")[0], "all")
        raise ImportError(
            f'{feature} needs {module.split(".")[0]}: pip install "{PACKAGE}[{name}]"'
        ) from error
