"""The per-document cache: keys, folders, key-value stores."""

from __future__ import annotations

from typing import Any

import pytest
from llama_index.core.storage.kvstore import SimpleKVStore

from llama_index.packs.self_rag_rse.context.cache import CACHE_FILE_NAME, ContextCache, model_id


async def test_a_folder_cache_survives_a_restart(tmp_path: Any) -> None:
    cache = ContextCache.from_dir(tmp_path / "c")
    key = ContextCache.key("sections", "text", {"window": 12000})
    await cache.aput("sections", key, {"starts": [[0, "A"]]})
    cache.persist()
    assert (tmp_path / "c" / CACHE_FILE_NAME).is_file()
    reloaded = ContextCache.coerce(str(tmp_path / "c"))
    assert await reloaded.aget("sections", key) == {"starts": [[0, "A"]]}
    assert await reloaded.aget("titles", key) is None  # kinds do not mix


def test_keys_and_coercion() -> None:
    assert ContextCache.key("a", "b") == ContextCache.key("a", "b")
    assert ContextCache.key("a", "b") != ContextCache.key("ab", "")
    store = SimpleKVStore()
    assert ContextCache.coerce(store).store is store
    with pytest.raises(TypeError, match="cache must be"):
        ContextCache.coerce(42)
    assert model_id(object()) == "object:"
