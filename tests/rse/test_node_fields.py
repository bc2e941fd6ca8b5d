"""Reading a node's chunk index, version, offsets and metadata values, whatever they hold."""

from __future__ import annotations

import math

import numpy as np
import pytest
from llama_index.core.schema import NodeRelationship, RelatedNodeInfo, TextNode

from llama_index.packs.self_rag_rse.rse.node_fields import (
    char_span,
    chunk_index,
    node_version,
    same_value,
)


def node(**metadata):
    return TextNode(id_="n", text="chunk", metadata=metadata)


@pytest.mark.parametrize(
    ("value", "index"),
    [(3, 3), (0, 0), (np.int64(7), 7), (4.0, 4), (np.float32(2.0), 2), ("5", 5), (10**15, 10**15)],
)
def test_chunk_indices_are_non_negative_integers_of_any_number_type(value, index):
    assert chunk_index(node(chunk_index=value), "chunk_index", strict=True) == index


@pytest.mark.parametrize(
    "value",
    [-1, 2.5, math.inf, -math.inf, math.nan, True, np.bool_(False), "x", "2.5", [1], np.array([1])],
)
def test_anything_else_is_no_index_or_in_strict_mode_an_error(value):
    assert chunk_index(node(chunk_index=value), "chunk_index") is None
    with pytest.raises(ValueError, match=r"node 'n' has chunk_index=.*Fix:"):
        chunk_index(node(chunk_index=value), "chunk_index", strict=True)


def test_an_absent_index_is_none_even_in_strict_mode():
    assert chunk_index(node(), "chunk_index", strict=True) is None


def test_version_is_the_stamp_else_the_documents_hash():
    source = RelatedNodeInfo(node_id="doc", hash="abc")
    plain = TextNode(text="x", relationships={NodeRelationship.SOURCE: source})
    assert node_version(plain, "chunk_version") == "abc"
    plain.metadata["chunk_version"] = "stamped"
    assert node_version(plain, "chunk_version") == "stamped"
    plain.metadata["chunk_version"] = np.array([1])  # not a version: the hash stands in
    assert node_version(plain, "chunk_version") == "abc"
    assert node_version(node(), "chunk_version") is None


def test_offsets_that_are_no_positions_are_unknown():
    n = TextNode(text="chunk", start_char_idx=4, end_char_idx=9)
    assert char_span(n) == (4, 9)
    n.start_char_idx = -3  # pydantic takes a negative offset
    assert char_span(n) == (None, 9)


@pytest.mark.parametrize(
    ("a", "b", "same"),
    [
        (1, 1, True),
        (1, 1.0, True),
        ("a", "b", False),
        (None, None, True),
        (math.nan, math.nan, True),
        (math.nan, 1.0, False),
        (np.array([1.0, math.nan]), np.array([1.0, math.nan]), True),
        (np.array([1, 2]), np.array([1, 3]), False),
        (np.array([1, 2]), np.array([1, 2, 3]), False),
        (np.array(["a", "b"]), np.array(["a", "b"]), True),
        (np.array([1, 2]), [1, 2], True),
        ([math.nan, {"k": np.array([1])}], [math.nan, {"k": np.array([1])}], True),
        ([1, 2], (1, 2), False),
        ({"a": 1}, {"a": 1, "b": 2}, False),
    ],
)
def test_same_value_compares_any_metadata(a, b, same):
    assert same_value(a, b) is same
