"""The context budget of one RSE call: what chunks cost, the search within it, one correction.

A budget caps the text the answer LLM reads: each segment's span (overlaps cut once) with its
header, then the unplaced nodes. Chunk ``p`` costs ``first[p] = len(text) + header`` when it
begins a segment, else ``step[p] = end[p] - end[p - 1]`` plus the header's growth if it names a
new section; chunks not read yet share the distance between the known ends around them (exact
from hit to hit); without offsets a step is the pair's stitched growth or the chunk's length. A
token limit is searched in characters, at the hits' characters per token. :class:`ContextBudget`
runs the search, then measures the nodes built and corrects once: never over the user's limits.
"""

from __future__ import annotations

import functools
import itertools
import logging
import math
from collections.abc import Callable, Iterable, Mapping, Sequence
from dataclasses import replace
from typing import Any

import numpy as np
from llama_index.core.schema import BaseNode, MetadataMode

from llama_index.packs.self_rag_rse.context.segment_header import segment_header
from llama_index.packs.self_rag_rse.rse.budget import (
    MAX_BUDGET,
    fill_budget,
    find_budgeted_segments,
)
from llama_index.packs.self_rag_rse.rse.chunk_index import CHUNK_INDEX_KEY
from llama_index.packs.self_rag_rse.rse.layout import DocumentLayout
from llama_index.packs.self_rag_rse.rse.node_fields import char_span
from llama_index.packs.self_rag_rse.rse.segment_nodes import cut_node, free_text, segment_nodes
from llama_index.packs.self_rag_rse.rse.stitching import stitch_chunks
from llama_index.packs.self_rag_rse.rse.types import Segment, SegmentExtraction

logger = logging.getLogger(__name__)

#: The character estimate of a token, used when no tokenizer is given.
CHARS_PER_TOKEN = 4
#: The shortest piece of a hit that fills what a budget has left.
MIN_PIECE_CHARS = 100

Tokenizer = Callable[[str], Sequence[Any]]
#: ``(characters, tokens)`` of the text the LLM reads.
Cost = tuple[int, int]


def count_tokens(text: str, tokenizer: Tokenizer | None) -> int:
    """Tokens of ``text`` by ``tokenizer``, else one per :data:`CHARS_PER_TOKEN` characters."""
    if tokenizer is None:
        return math.ceil(len(text) / CHARS_PER_TOKEN)
    tokens = tokenizer(text)
    if isinstance(tokens, Mapping | str) or not hasattr(tokens, "__len__"):
        raise ValueError(
            f"tokenizer returned {type(tokens).__name__}, not a sequence of tokens (a Hugging "
            "Face tokenizer called directly returns a mapping): pass tokenizer.encode"
        )
    return len(tokens)


class ContextBudget:
    """One call's context budget: the user's limits ``max_chars`` / ``max_tokens`` (``None``:
    none of that kind; tokens counted with ``tokenizer``, :func:`count_tokens`), the characters
    the search spends (a token limit at the characters per token of the hits' ``texts``), and
    the header sizes measured on the way (kept for every search round of the call); ``partial``:
    a piece of a hit may fill what the segments leave (:data:`MIN_PIECE_CHARS` at least);
    ``headers``: segments show their headers (:func:`~.segment_nodes.segment_nodes`).
    """

    def __init__(
        self, max_chars: int | None, max_tokens: int | None, tokenizer: Any, texts: Sequence[str],
        partial: bool = False, headers: bool = True,
    ) -> None:  # fmt: skip
        self.max_chars, self.max_tokens, self.tokenizer = max_chars, max_tokens, tokenizer
        self.partial, self.least_piece = partial, MIN_PIECE_CHARS if partial else 0
        self.build = functools.partial(segment_nodes, headers=headers)
        limits = [MAX_BUDGET] if max_chars is None else [max_chars]
        if max_tokens is not None:
            counted = sum(count_tokens(t, tokenizer) for t in texts)
            ratio = sum(map(len, texts)) / counted if counted else CHARS_PER_TOKEN
            limits.append(int(max_tokens * ratio))
        # The search's ceiling; what comes back is measured against the user's limits anyway.
        self.chars = min(*limits, MAX_BUDGET)
        self._headers: dict[tuple[Any, ...], int] = {}

    def cost(self, nodes: Iterable[BaseNode]) -> Cost:
        """``(characters, tokens)`` of the text the LLM reads for ``nodes``."""
        texts = [node.get_content(metadata_mode=MetadataMode.LLM) for node in nodes]
        return sum(map(len, texts)), sum(count_tokens(t, self.tokenizer) for t in texts)

    def fits(self, cost: Cost) -> bool:
        """Whether ``cost`` keeps within every limit."""
        limits = zip(cost, (self.max_chars, self.max_tokens), strict=True)
        return all(limit is None or used <= limit for used, limit in limits)

    def header(self, node: BaseNode) -> int:
        """Characters a segment starting at ``node`` shows besides its text (its header)."""
        # It depends on the first chunk's metadata (chunk index aside) and hidden keys: one
        # segment node is built per distinct kind (chunks of a section share it), not per hit.
        kind = (
            tuple((k, repr(v)) for k, v in sorted(node.metadata.items()) if k != CHUNK_INDEX_KEY),
            tuple(node.excluded_llm_metadata_keys),
        )
        if kind not in self._headers:
            built = self.build(Segment(node.ref_doc_id or "", 0, 1, 0.0, members=[node]))[0]
            shown = built.get_content(metadata_mode=MetadataMode.LLM)
            self._headers[kind] = len(shown) - len(built.get_content().rstrip())
        return self._headers[kind]

    def spans(
        self, laid_out: SegmentExtraction, layouts: Mapping[str, DocumentLayout],
        hit_ids: Sequence[str], max_length: int, minimum_value: float, keep_top_hits: int = 0,
    ) -> list[tuple[int, int]]:  # fmt: skip
        """Segments of ``laid_out`` worth most within the budget, then the best remaining hits
        (``hit_ids``, best first: equal values fill as top-k would) that fit. The best
        ``keep_top_hits`` hits are in as far as they fit together: each one's value is raised
        above everything else together, so a best choice holds as many as fit.
        """
        values, splits = laid_out.values, laid_out.document_splits
        first, step = self._chunk_costs(laid_out, layouts)
        where: dict[str, int] = {}
        place = itertools.count()  # positions are numbered across regions, in order
        for region in laid_out.regions:
            held = layouts[region.doc_id].held
            for position, i in zip(region.positions, place, strict=False):
                if position in held:
                    where[held[position].node_id] = i
        hits = [where[node_id] for node_id in hit_ids if node_id in where]
        searched, kept = values.copy(), hits[:keep_top_hits]
        searched[kept] = np.maximum(values[kept], 0.0) + 1.0 + np.maximum(values, 0).sum()
        costs = (first, step, self.chars, max_length)
        spans, _ = find_budgeted_segments(searched, splits, *costs, minimum_value)
        return fill_budget(spans, values, splits, *costs[:3], hits, max_length, self.least_piece)

    def fit(self, extraction: SegmentExtraction, spares: Iterable[Segment]) -> None:
        """The one correction, on the nodes built: drop the least valuable segments until the
        rest fits; after a drop, add the ``spares`` (hits as one-chunk segments, best first)
        that fit and touch no segment kept. The unplaced nodes follow as far as they fit (the
        rest go to ``extraction.left_out``); with :attr:`partial`, the free part of the best spare
        worth more than 0 (:func:`~.segment_nodes.free_text`) fills what is left.
        """
        kept = sorted(extraction.segments, key=lambda s: -s.value)
        costs = [self.cost(s.nodes) for s in kept]
        while kept and not self.fits(_sum(costs)):
            del kept[-1], costs[-1]
        dropped = len(kept) < len(extraction.segments)
        refill, rest = itertools.tee(spares)  # made one by one, only as far as they are read
        # Not inside or next to a segment kept: its text would be given twice.
        for spare in (s for s in refill if not any(k.touches(s) for k in kept)) if dropped else ():
            spare.nodes = list(self.build(spare))
            cost = self.cost(spare.nodes)
            if self.fits(_sum([*costs, cost])):
                kept.append(spare)
                costs.append(cost)
        extraction.segments = sorted(kept, key=lambda s: -s.value)
        passthrough, extraction.passthrough = extraction.passthrough, []
        for item in passthrough:
            cost = self.cost([item.node])
            if self.fits(_sum([*costs, cost])):
                extraction.passthrough.append(item)
                costs.append(cost)
            else:
                extraction.left_out.append(item)
        if left := len(extraction.left_out):
            logger.info("RSE left %d unplaced node(s) out: they do not fit the budget", left)
        for spare in (s for s in rest if s.value > 0) if self.partial else ():
            if (free := free_text(spare, kept)) is not None:
                if (piece := self._piece(spare, free, _sum(costs))) is not None:
                    extraction.segments.append(piece)
                return

    def _piece(self, spare: Segment, free: tuple[int, int], used: Cost) -> Segment | None:
        """``spare``'s ``free`` part cut to the budget left after ``used``, if it needs cutting."""
        node = (spare.nodes or self.build(spare))[0]
        keep = self.chars - used[0] - self.header(spare.members[0])
        while free[1] - free[0] > keep >= MIN_PIECE_CHARS:  # only where the budget binds
            cut = cut_node(node, free[0], keep)
            if cut is None or len(cut.get_content()) < MIN_PIECE_CHARS:
                return None
            if self.fits(_sum([used, self.cost([cut])])):
                return replace(spare, nodes=[cut])
            keep = int(keep * 0.9)  # a token limit counts the text some other way
        return None

    def why_empty(self, head: str, hits: Sequence[BaseNode]) -> str:
        """Why nothing was returned: no hit fits the budget."""
        cheapest = min(len(node.get_content()) + self.header(node) for node in hits)
        limits = {"max_context_chars": self.max_chars, "max_context_tokens": self.max_tokens}
        shown = ", ".join(f"{name}={value}" for name, value in limits.items() if value is not None)
        return (
            f"{head}: no hit fits the context budget ({shown}); the shortest needs "
            f"{cheapest} characters with its header: raise the budget"
        )

    def _chunk_costs(
        self, laid_out: SegmentExtraction, layouts: Mapping[str, DocumentLayout]
    ) -> tuple[np.ndarray, np.ndarray]:
        """``(first, step)`` costs in characters of every position laid out (see the module
        docstring). Positions not at hand get ``first = 0``: only hits begin a segment.
        """
        firsts, steps = [np.zeros(0, dtype=np.int64)], [np.zeros(0, dtype=np.int64)]
        for region in laid_out.regions:
            layout = layouts[region.doc_id]
            nodes = [layout.held.get(p) for p in region.positions]
            first, step = np.zeros((2, len(nodes)), dtype=np.int64)
            ends: list[int | None] = [None] * len(nodes)
            for i, node in enumerate(nodes):
                if node is None:
                    continue
                text = node.get_content()
                first[i] = len(text) + self.header(node)
                start, end = char_span(node)
                trusted = region.positions[i] not in layout.suspect
                if trusted and start is not None and end is not None and end - start == len(text):
                    ends[i] = end
            typical = int(np.median(first[first > 0])) if (first > 0).any() else 0
            i = 1
            while i < len(nodes):
                # Up to the next known end, the steps share the distance from the last one.
                j = i
                while j < len(nodes) and ends[j] is None and nodes[j] is None:
                    j += 1
                left, right = ends[i - 1], ends[j] if j < len(nodes) else None
                if left is not None and right is not None:
                    total, count = max(0, right - left), j - i + 1
                    cuts = [total * t // count for t in range(count + 1)]
                    step[i : j + 1] = [b - a for a, b in itertools.pairwise(cuts)]
                    i = j + 1
                else:
                    step[i] = _step_without_offsets(nodes[i - 1], nodes[i], typical)
                    i += 1
            step += [self._more_header(a, b) for a, b in zip([None, *nodes], nodes, strict=False)]
            firsts.append(first)
            steps.append(step)
        return np.concatenate(firsts), np.concatenate(steps)

    def _more_header(self, before: BaseNode | None, node: BaseNode | None) -> int:
        """At most what ``node`` adds to the header of a segment ending at ``before``."""
        if before is None or node is None or not self.build.keywords["headers"]:
            return 0
        return max(0, len(segment_header(node, [before, node])) - len(segment_header(before)))


def _step_without_offsets(before: BaseNode | None, node: BaseNode | None, typical: int) -> int:
    """A step where offsets cannot give it: the stitched growth of the pair, the chunk's
    length, or (neither text at hand) the document's typical chunk.
    """
    if node is None:
        return typical
    text = node.get_content()
    if before is None:
        return len(text)
    previous = before.get_content()
    pieces = stitch_chunks([previous, text], [char_span(before), char_span(node)], [False, True])
    return max(0, len(pieces[0].text) - len(previous)) if len(pieces) == 1 else len(text)


def _sum(costs: Iterable[Cost]) -> Cost:
    chars, tokens = zip((0, 0), *costs, strict=True)
    return sum(chars), sum(tokens)
