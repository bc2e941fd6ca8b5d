"""What each chunk position costs in a segment, for the budgeted search, and what nodes cost.

A segment's text is its document's span from its first chunk's start to its last chunk's end
(overlap cut once), plus its header once. With character offsets that is additive: chunk ``p``
costs ``first[p] = len(text) + overhead`` when it begins a segment and ``step[p] = end[p] -
end[p - 1]`` when it follows ``p - 1``. Chunks between hits that were not read yet have no
offsets; their steps share the distance between the known ends around them, so every segment
from one hit to another (the only kind the search forms) is costed exactly, whatever the share.
Where offsets are missing or contradicted, a step is the pair's stitched growth, or the chunk's
length when even the text is not at hand: an estimate, which the postprocessor checks against
the nodes it builds (:func:`llm_text`) before returning them.
"""

from __future__ import annotations

import math
from collections.abc import Callable, Mapping, Sequence
from typing import Any

import numpy as np
from llama_index.core.schema import BaseNode, MetadataMode

from llama_index.packs.self_rag_rse.rse.layout import DocumentLayout
from llama_index.packs.self_rag_rse.rse.node_fields import char_span
from llama_index.packs.self_rag_rse.rse.stitching import stitch_chunks
from llama_index.packs.self_rag_rse.rse.types import DocumentRegion

__all__ = [
    "CHARS_PER_TOKEN",
    "chunk_costs",
    "count_tokens",
    "estimate_tokens",
    "llm_text",
    "node_cost",
]

#: The character estimate of a token, used when no tokenizer is given.
CHARS_PER_TOKEN = 4


def estimate_tokens(text: str) -> int:
    """Tokens of ``text`` by the character estimate: one per :data:`CHARS_PER_TOKEN`, rounded up."""
    return math.ceil(len(text) / CHARS_PER_TOKEN)


def llm_text(node: BaseNode) -> str:
    """The text the answer LLM reads for ``node`` (its header or metadata, then its text)."""
    return node.get_content(metadata_mode=MetadataMode.LLM)


def chunk_costs(
    regions: Sequence[DocumentRegion],
    layouts: Mapping[str, DocumentLayout],
    overhead: Callable[[BaseNode], int],
) -> tuple[np.ndarray, np.ndarray]:
    """``(first, step)`` costs in characters for every position of ``regions`` laid end to end.

    ``overhead(node)``: the characters a segment starting at ``node`` adds besides its text
    (its header and separator). Positions not at hand get ``first = 0`` (they never begin a
    segment: only hits do) and a share of the known distance around them as their step.
    """
    firsts: list[np.ndarray] = []
    steps: list[np.ndarray] = []
    for region in regions:
        layout = layouts[region.doc_id]
        nodes = [layout.held.get(p) for p in region.positions]
        first = np.zeros(len(nodes), dtype=np.int64)
        step = np.zeros(len(nodes), dtype=np.int64)
        ends: list[int | None] = []
        for i, node in enumerate(nodes):
            if node is None:
                ends.append(None)
                continue
            text = node.get_content()
            first[i] = len(text) + overhead(node)
            span = char_span(node)
            trusted = (
                region.positions[i] not in layout.suspect
                and span[0] is not None
                and span[1] is not None
                and span[1] - span[0] == len(text)
            )
            ends.append(span[1] if trusted else None)
        typical = int(np.median(first[first > 0])) if (first > 0).any() else 0
        i = 1
        while i < len(nodes):
            if ends[i - 1] is not None:
                # The next known end after i - 1: the steps up to it share the distance.
                j = i
                while j < len(nodes) and ends[j] is None and nodes[j] is None:
                    j += 1
                if j < len(nodes) and ends[j] is not None:
                    left, right = ends[i - 1], ends[j]
                    assert left is not None and right is not None
                    total = max(0, right - left)
                    shares = np.diff(np.floor(np.linspace(0, total, j - i + 2)).astype(np.int64))
                    step[i : j + 1] = shares
                    i = j + 1
                    continue
            step[i] = _step_without_offsets(nodes[i - 1], nodes[i], typical)
            i += 1
        firsts.append(first)
        steps.append(step)
    if not firsts:
        empty = np.zeros(0, dtype=np.int64)
        return empty, empty
    return np.concatenate(firsts), np.concatenate(steps)


def _step_without_offsets(before: BaseNode | None, node: BaseNode | None, typical: int) -> int:
    """A step where offsets cannot give it: the stitched growth of the pair, the chunk's
    length, or (neither text at hand) the document's typical chunk."""
    if node is None:
        return typical
    text = node.get_content()
    if before is None:
        return len(text)
    previous = before.get_content()
    pieces = stitch_chunks([previous, text], [char_span(before), char_span(node)], [False, True])
    if len(pieces) == 1:
        return max(0, len(pieces[0].text) - len(previous))
    return len(text)


def count_tokens(text: str, tokenizer: Callable[[str], Sequence[Any]] | None) -> int:
    """Tokens of ``text`` by ``tokenizer``, or by the character estimate without one."""
    if tokenizer is None:
        return estimate_tokens(text)
    tokens = tokenizer(text)
    if isinstance(tokens, Mapping | str) or not hasattr(tokens, "__len__"):
        raise ValueError(
            f"tokenizer returned {type(tokens).__name__}, not a sequence of tokens (a Hugging "
            "Face tokenizer called directly returns a mapping): pass tokenizer.encode"
        )
    return len(tokens)


def node_cost(node: BaseNode, tokenizer: Callable[[str], Sequence[Any]] | None) -> tuple[int, int]:
    """``(characters, tokens)`` of the text the LLM reads for ``node``."""
    text = llm_text(node)
    return len(text), count_tokens(text, tokenizer)
