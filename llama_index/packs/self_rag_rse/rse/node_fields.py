"""What RSE reads off a node, checked once: its chunk index, its document version, its offsets
(and whether they were checked against the document).

These values come from outside (a store's payload, a user's pipeline, a hand-built node), so any
of them can be a float, NaN, infinity, a string or a numpy array. Each reader returns a value the
segment logic can trust or ``None`` ("not known"); where a wrong value would silently misplace
text, the strict reader raises an error that names the node, the value and the fix instead.
"""

from __future__ import annotations

import math
import numbers
from collections.abc import Mapping
from typing import Any

import numpy as np
from llama_index.core.schema import BaseNode, NodeRelationship

from llama_index.packs.self_rag_rse.context.keys import OFFSETS_CHECKED_KEY


def chunk_index(node: BaseNode, key: str, *, strict: bool = False) -> int | None:
    """The chunk index in ``node.metadata[key]``: a non-negative integer, or ``None``.

    Integral floats (``3.0``, as some stores return numbers) and strings of an integer count.
    ``None`` when the key is absent; for any other value (negative, fractional, NaN, infinite,
    a bool, an array, text), ``None`` too, unless ``strict``: then a ``ValueError`` naming the
    node, the value and the fix (a wrong index would put the chunk at the wrong place).
    """
    value = node.metadata.get(key)
    if value is None:
        return None
    index = _as_index(value)
    if index is None and strict:
        raise ValueError(
            f"node {node.node_id!r} has {key}={value!r}: a chunk index is the chunk's 0-based "
            "position in its document, a non-negative integer. Fix: stamp the indices with "
            "ChunkIndexer at ingestion (it writes them under this key)"
        )
    return index


def _as_index(value: Any) -> int | None:
    if type(value) is int:  # the common case, without the abstract-class checks below
        return value if value >= 0 else None
    if isinstance(value, bool | np.bool_):
        return None
    if isinstance(value, np.ndarray):
        if value.ndim != 0:
            return None
        value = value.item()
    if isinstance(value, numbers.Integral):
        index = int(value)
    elif isinstance(value, numbers.Real):
        number = float(value)
        if not (math.isfinite(number) and number.is_integer()):
            return None
        index = int(number)
    elif isinstance(value, str):
        try:
            index = int(value)
        except ValueError:
            return None
    else:
        return None
    return index if index >= 0 else None


def node_version(node: BaseNode, key: str) -> str | None:
    """The version of its document that ``node`` was cut from, or ``None`` when unknown.

    :class:`~llama_index.packs.self_rag_rse.ChunkIndexer` stamps it in ``metadata[key]``;
    without a stamp, the document hash LlamaIndex's splitters record on the SOURCE relationship
    stands in (the same value: ChunkIndexer stamps that hash when there is one). Chunks of two
    versions of a document must never be joined.
    """
    stamped = node.metadata.get(key)
    if isinstance(stamped, str) and stamped:
        return stamped
    return source_hash(node)


def source_hash(node: BaseNode) -> str | None:
    """The document hash LlamaIndex's splitters record on ``node``'s SOURCE relationship."""
    digest = getattr(node.relationships.get(NodeRelationship.SOURCE), "hash", None)
    return digest if isinstance(digest, str) and digest else None


def link(node: BaseNode, relation: NodeRelationship) -> str | None:
    """Id of the node that ``relation`` (NEXT, PREVIOUS, ...) points at, if any."""
    return getattr(node.relationships.get(relation), "node_id", None)


def char_span(node: BaseNode) -> tuple[int | None, int | None]:
    """``(start_char_idx, end_char_idx)``, each ``None`` unless a non-negative integer."""
    return _offset(getattr(node, "start_char_idx", None)), _offset(
        getattr(node, "end_char_idx", None)
    )


def offsets_checked(node: BaseNode) -> bool:
    """Whether ``node``'s offsets were found again in its document's text at ingestion
    (``ChunkIndexer(documents=...)`` or ``DocumentSectioner``): true even where the text repeats.
    """
    return node.metadata.get(OFFSETS_CHECKED_KEY) is True


def off_span(node: BaseNode) -> bool:
    """Whether ``node`` holds more or less text than its offsets span (changed after splitting:
    a sentence window put in, a compressor's cut).
    """
    start, end = char_span(node)
    return start is not None and end is not None and len(node.get_content()) != end - start


def _offset(value: Any) -> int | None:
    return None if value is None or isinstance(value, str) else _as_index(value)


def same_value(a: Any, b: Any) -> bool:
    """Whether two metadata values are equal, for any value a node may carry.

    ``==`` alone fails both ways on metadata: numpy arrays answer with an array whose truth is
    ambiguous (an error), and NaN is not equal to itself (a shared NaN would be dropped). Here
    arrays compare by shape and elements, NaN equals NaN, and lists and dicts compare element by
    element with the same rules.
    """
    if a is b:
        return True
    if isinstance(a, np.ndarray) or isinstance(b, np.ndarray):
        # array_equal is False for shapes that differ or values that make no array.
        try:
            return bool(np.array_equal(a, b, equal_nan=True))
        except TypeError:  # equal_nan needs numbers: object or text arrays compare plainly
            return bool(np.array_equal(a, b))
    if isinstance(a, Mapping) and isinstance(b, Mapping):
        return a.keys() == b.keys() and all(same_value(a[k], b[k]) for k in a)
    if isinstance(a, list | tuple) and isinstance(b, list | tuple):
        return (
            type(a) is type(b)
            and len(a) == len(b)
            and all(same_value(x, y) for x, y in zip(a, b, strict=True))
        )
    if _is_nan(a) and _is_nan(b):
        return True
    try:
        return bool(a == b)
    except (TypeError, ValueError):  # an object whose == gives no single answer
        return False


def _is_nan(value: Any) -> bool:
    return isinstance(value, numbers.Real) and not isinstance(value, bool) and math.isnan(value)
