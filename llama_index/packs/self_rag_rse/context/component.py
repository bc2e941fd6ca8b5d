"""What the two ingestion components share: where each goes in a pipeline, a cache of LLM
results, the call itself (async, run from sync code through the package's bridge), the cost
of their last run, and their rebuilding from ``to_dict`` (a saved pipeline read back).

:class:`~.sectioner.DocumentSectioner` takes the splitter's place (documents in, chunks out) and
:class:`~.headers.ContextualHeaders` comes after it (chunks in). Put in the wrong place, each
would run without complaint and quietly spoil the index: the sectioner after a splitter sections
every chunk as if it were a document, so the chunks' offsets point into the chunk while their source
still names the document (RSE then finds the texts contradicting the offsets and breaks segments
there), and the headers before the splitter name no section and are copied into every chunk. The two
are told apart the way LlamaIndex marks them: a splitter gives every chunk a SOURCE relationship
naming the document it was cut from (``node.ref_doc_id``), while a reader's ``Document`` has none.
"""

from __future__ import annotations

import time
from collections import Counter
from collections.abc import Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, ClassVar

from llama_index.core import node_parser
from llama_index.core.bridge.pydantic import PrivateAttr, model_validator
from llama_index.core.instrumentation import get_dispatcher
from llama_index.core.prompts import PromptTemplate
from llama_index.core.schema import BaseNode, Document, TransformComponent

from llama_index.packs.self_rag_rse.common.bridge import run_sync
from llama_index.packs.self_rag_rse.common.options import pydantic_fields, reject_unknown
from llama_index.packs.self_rag_rse.context.cache import ContextCache

dispatcher = get_dispatcher(__name__)


@dataclass
class ContextUsage:
    """Cost of one run of a context component.

    ``llm_calls`` counts calls actually sent to the LLM; ``cached`` the results read from the
    cache instead; ``rejected`` the sectioning windows whose LLM answer could not be used (with
    the reason), ``repairs`` the fixes made to answers that were used.
    """

    documents: int = 0
    llm_calls: int = 0
    cached: int = 0
    seconds: float = 0.0
    rejected: list[str] = field(default_factory=list)
    repairs: list[str] = field(default_factory=list)


class ContextComponent(TransformComponent):
    """Base of :class:`~.headers.ContextualHeaders` and :class:`~.sectioner.DocumentSectioner`:
    options checked at construction (unknown ones raise), a cache, the last run's usage, and the
    call (``__call__`` runs ``acall`` through the package's bridge; ``acall`` times the
    component's own ``_transform``).
    """

    #: Options that must be at least the given number.
    _minimums: ClassVar[dict[str, int]] = {}
    _cache: ContextCache = PrivateAttr()
    _usage: ContextUsage = PrivateAttr(default_factory=ContextUsage)

    def __init__(self, *, cache: Any = None, **kwargs: Any) -> None:
        name = type(self).__name__
        # Pydantic would drop a misspelt option silently and use its default.
        reject_unknown(name, kwargs, pydantic_fields(type(self)) | {"cache"})
        super().__init__(**kwargs)
        for option, low in self._minimums.items():
            if (value := getattr(self, option)) < low:
                raise ValueError(
                    f"{name}: {option} must be at least {low}, got {value}: pass {option}={low} "
                    "or more"
                )
        self._check_options()
        self._cache = ContextCache.coerce(cache)

    def __setstate__(self, state: dict[str, Any]) -> None:
        # Core unpickles by calling __init__ again without cache= (IngestionPipeline's workers,
        # num_workers > 1): keep the cache that was pickled, or its folder would get nothing.
        super().__setstate__(state)
        if "_cache" in (private := state.get("__pydantic_private__") or {}):
            self._cache = private["_cache"]

    @model_validator(mode="before")
    @classmethod
    def _rebuild_parts(cls, data: Any) -> Any:
        """Parts given in the form :meth:`to_dict` writes them (a saved pipeline read back): a
        prompt or a splitter is rebuilt from its dict; an LLM cannot be, and is asked for.
        """
        if not isinstance(data, dict):
            return data
        return {
            name: _part_from_dict(cls.__name__, name, value) if isinstance(value, dict) else value
            for name, value in data.items()
        }

    def to_dict(self, **kwargs: Any) -> dict[str, Any]:
        """The options, and the cache's folder when it has one, as ``from_dict`` reads them."""
        data = super().to_dict(**kwargs)
        if self._cache.persist_path is not None:
            data["cache"] = str(Path(self._cache.persist_path).parent)
        return data

    def _check_options(self) -> None:
        """Raise ``ValueError`` for options that do not fit together."""

    # -- TransformComponent -------------------------------------------------------------------
    @dispatcher.span
    def __call__(self, nodes: Sequence[BaseNode], **kwargs: Any) -> Sequence[BaseNode]:
        """Transform ``nodes`` (see the class); LLM calls, if any, go through the package's
        bridge. ``show_progress=True`` (as a pipeline passes it) shows their progress.
        """
        return run_sync(self.acall(nodes, **kwargs))

    @dispatcher.span
    async def acall(self, nodes: Sequence[BaseNode], **kwargs: Any) -> Sequence[BaseNode]:
        """Async :meth:`__call__`; the time it took is kept in :attr:`usage`."""
        started = time.perf_counter()
        result = await self._transform(nodes, bool(kwargs.get("show_progress", False)))
        self._usage.seconds = time.perf_counter() - started
        return result

    async def _transform(
        self, nodes: Sequence[BaseNode], show_progress: bool
    ) -> Sequence[BaseNode]:
        """What one call does; it starts :attr:`usage` afresh."""
        raise NotImplementedError

    @classmethod
    def class_name(cls) -> str:
        """Name used in serialisation."""
        return cls.__name__

    @property
    def usage(self) -> ContextUsage:
        """What the last call cost (documents, LLM calls, cache hits, rejected windows)."""
        return self._usage

    @property
    def cache(self) -> ContextCache:
        """The per-document cache of LLM results (titles, summaries, sectionings)."""
        return self._cache


def _part_from_dict(owner: str, name: str, data: dict[str, Any]) -> Any:
    """The prompt (a ``PromptTemplate``) or splitter (a core node parser) option ``name`` that
    ``data`` (its ``to_dict``) describes; for anything else (an LLM, a chat prompt, a splitter
    of another package, or with an ``id_func`` of its own), ``ValueError`` naming the fix.
    """
    if "template" in data:
        return PromptTemplate.model_construct(**data)
    splitter = getattr(node_parser, str(data.get("class_name")), None)
    if (
        name == "splitter"
        and isinstance(splitter, type)
        and issubclass(splitter, TransformComponent)
    ):
        # A function does not serialise (to_dict writes its name): the splitter is rebuilt with
        # the default id_func, and kept only if that is the one it had.
        options = {
            key: value for key, value in data.items() if key not in ("class_name", "id_func")
        }
        rebuilt = splitter(**options)
        if rebuilt.to_dict() == data:
            return rebuilt
    raise ValueError(
        f"{owner}: {name} is a {data.get('class_name', 'part')} written as a dict, which cannot "
        f"be rebuilt from it: pass it to from_dict, {owner}.from_dict(data, {name}=...)"
    )


#: The pipeline both messages show.
PIPELINE = (
    "IngestionPipeline(transformations=[DocumentSectioner(splitter=SentenceSplitter(...)), "
    "ChunkIndexer(), ContextualHeaders(), embed_model])"
)


def source_of(node: BaseNode) -> str | None:
    """The id of the document ``node`` was cut from, or ``None`` when it is a document itself."""
    source = node.ref_doc_id
    return source if source is not None and source != node.node_id else None


def check_documents(component: str, nodes: Sequence[BaseNode]) -> None:
    """Raise ``ValueError`` for chunks (not documents), or for documents sharing an id."""
    if repeated := [i for i, n in Counter(node.node_id for node in nodes).items() if n > 1]:
        raise ValueError(
            f"{component} got documents sharing an id ({repeated[0]!r}): their chunks would mix. "
            "Give each its own id_ (SimpleDirectoryReader(filename_as_id=True)) or pass it once"
        )
    if chunks := [node for node in nodes if source_of(node) is not None]:
        first = chunks[0]
        raise ValueError(
            f"{component} got {len(chunks)} node(s) that are already chunks of a document "
            f"(node {first.node_id!r} is a chunk of {source_of(first)!r}): a chunk sectioned "
            "as if it were a document gets offsets inside the chunk, which contradict its "
            f"document. {component} replaces the splitter: give it the documents, in the "
            f"splitter's place: {PIPELINE}"
        )


def check_chunks(component: str, nodes: Sequence[BaseNode]) -> None:
    """Raise ``ValueError`` if any of ``nodes`` is a whole ``Document`` (the splitter or the
    sectioner has not run yet).
    """
    if documents := [n for n in nodes if isinstance(n, Document) and source_of(n) is None]:
        raise ValueError(
            f"{component} got {len(documents)} whole document(s) (e.g. {documents[0].node_id!r}, "
            "a Document with no source document): it writes each chunk's header from its "
            "document and section, and a document has no section yet; a splitter after it "
            f"would copy that header into every chunk. Put {component} after the splitter or "
            f"DocumentSectioner (and ChunkIndexer), right before the embedding model: {PIPELINE}"
        )
