"""The per-document cache: keys, folders, key-value stores."""

from __future__ import annotations

import logging
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
    # Pinned: a change to the key scheme would orphan every entry users have cached. Only a
    # change that means to start every cache afresh may update these digests.
    assert ContextCache.key("a", "b") == (
        "8fb20ef63ced4145fc2e983ffe597d1dcff39154c3bf21f0fa9dde6a0c50fdc9"
    )
    # Settings are JSON with sorted keys, texts UTF-8: the order a dict was built in is no change.
    assert ContextCache.key("sections", {"window": 4000, "model": "m"}, "text\u00e9") == (
        "3d1eceee927dfd6e08c3bd4e0dfe899027d2ea0152f0ef0b60efe0666f91f8ac"
    )
    store = SimpleKVStore()
    assert ContextCache.coerce(store).store is store
    with pytest.raises(TypeError, match="cache must be"):
        ContextCache.coerce(42)
    assert model_id(object()) == "object:"


DAMAGED = {
    "truncated": b'{"self_rag_rse_context/sections": {"ab": {"starts": [[0, "A"',
    "empty": b"",
    "not utf-8": b"\xff\xfe{\x00",
    "a list": b"[1, 2]",
    "a collection that is no object": b'{"self_rag_rse_context/sections": 3}',
    "an entry that is no object": b'{"self_rag_rse_context/sections": {"ab": "x"}}',
}


@pytest.mark.parametrize("damage", DAMAGED)
async def test_a_damaged_cache_file_is_named_and_replaced(
    tmp_path: Any, damage: str, caplog: pytest.LogCaptureFixture
) -> None:
    path = tmp_path / "c" / CACHE_FILE_NAME
    path.parent.mkdir()
    path.write_bytes(DAMAGED[damage])
    with caplog.at_level(logging.WARNING):
        cache = ContextCache.coerce(str(tmp_path / "c"))
    assert any(str(path) in r.getMessage() for r in caplog.records if r.levelname == "WARNING")
    key = ContextCache.key("sections", "text")
    assert await cache.aget("sections", key) is None  # started empty
    await cache.aput("sections", key, {"starts": [[0, "A"]]})
    cache.persist()
    assert await ContextCache.from_dir(tmp_path / "c").aget("sections", key) == {
        "starts": [[0, "A"]]
    }


async def test_components_start_on_a_damaged_cache_folder(
    tmp_path: Any, caplog: pytest.LogCaptureFixture
) -> None:
    from llama_index.packs.self_rag_rse import DocumentSectioner

    damaged = tmp_path / CACHE_FILE_NAME
    damaged.write_text('{"self_rag_rse_context/sec')
    with caplog.at_level(logging.WARNING):
        sectioner = DocumentSectioner(strategy="headings", cache=str(tmp_path))
    assert str(damaged) in caplog.text and "damaged" in caplog.text
    # It starts empty and works: a value written now is read back.
    key = ContextCache.key("sections", "text")
    assert await sectioner.cache.aget("sections", key) is None
    await sectioner.cache.aput("sections", key, {"starts": [[0, "A"]]})
    assert await sectioner.cache.aget("sections", key) == {"starts": [[0, "A"]]}


async def test_a_write_cut_short_leaves_the_previous_cache_whole(
    tmp_path: Any, monkeypatch: pytest.MonkeyPatch
) -> None:
    cache = ContextCache.from_dir(tmp_path)
    old = ContextCache.key("old")
    await cache.aput("titles", old, {"title": "kept"})
    cache.persist()
    await cache.aput("titles", ContextCache.key("new"), {"title": "lost in the crash"})

    def crash(self: SimpleKVStore, persist_path: str, fs: Any = None) -> None:
        with open(persist_path, "w", encoding="utf-8") as out:
            out.write('{"self_rag_rse_context/titles": {"')  # half a file, then the crash
        raise KeyboardInterrupt

    monkeypatch.setattr(SimpleKVStore, "persist", crash)
    with pytest.raises(KeyboardInterrupt):
        cache.persist()
    monkeypatch.undo()
    assert sorted(p.name for p in tmp_path.iterdir()) == [CACHE_FILE_NAME]  # no leftovers
    assert await ContextCache.from_dir(tmp_path).aget("titles", old) == {"title": "kept"}


def test_the_cache_file_given_for_its_folder_is_an_error_naming_the_folder(tmp_path: Any) -> None:
    # It used to start empty (every LLM call made again), then fail to write after the work.
    from llama_index.packs.self_rag_rse import ContextualHeaders

    (tmp_path / CACHE_FILE_NAME).write_text("{}")
    with pytest.raises(ValueError, match=f"is a file: pass its folder, cache='{tmp_path}'"):
        ContextualHeaders(cache=str(tmp_path / CACHE_FILE_NAME))


async def test_two_caches_of_one_folder_keep_each_others_entries(tmp_path: Any) -> None:
    # DocumentSectioner(cache=DIR) and ContextualHeaders(cache=DIR): one file, two loaders.
    first, second = ContextCache.from_dir(tmp_path), ContextCache.from_dir(tmp_path)
    await first.aput("sections", "a", {"starts": [[0, "A"]]})
    await second.aput("titles", "b", {"title": "B"})
    await second.aput("sections", "c", {"starts": [[0, "C"]]})
    first.persist()
    second.persist()  # used to write its own entries only: "a" was gone
    reloaded = ContextCache.from_dir(tmp_path)
    assert await reloaded.aget("sections", "a") == {"starts": [[0, "A"]]}
    assert await reloaded.aget("sections", "c") == {"starts": [[0, "C"]]}
    assert await reloaded.aget("titles", "b") == {"title": "B"}
    await first.aput("titles", "b", {"title": "newer"})
    first.persist()  # its own value of a key wins over the file's
    assert await ContextCache.from_dir(tmp_path).aget("titles", "b") == {"title": "newer"}


async def test_a_pickled_component_keeps_its_cache(tmp_path: Any) -> None:
    # IngestionPipeline(num_workers=2) pickles the transformations; core's __setstate__ runs
    # __init__ again without cache=, which left the workers a fresh cache with no folder.
    import pickle

    from llama_index.packs.self_rag_rse import ContextualHeaders

    headers = ContextualHeaders(cache=str(tmp_path))
    await headers.cache.aput("titles", "k", {"title": "T"})
    copy = pickle.loads(pickle.dumps(headers))
    assert copy.cache.persist_path == headers.cache.persist_path
    assert await copy.cache.aget("titles", "k") == {"title": "T"}
    copy.cache.persist()
    assert await ContextCache.from_dir(tmp_path).aget("titles", "k") == {"title": "T"}
