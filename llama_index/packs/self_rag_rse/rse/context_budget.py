"""The context budget of one RSE call: what chunks cost, the search within it, one correction.

A budget caps the text the answer LLM reads: each segment's span (overlaps cut once) with its
header, then the unplaced nodes. Chunk ``p`` costs ``first[p] = len(text) + header`` when it
begins a segment, else ``step[p] = end[p] - end[p - 1]`` plus the header's growth if it names a
new section; chunks not read yet share the distance between the known ends around them (exact
from hit to hit); without offsets a step is the pair's stitched growth or the chunk's length. A
token limit is searched in tokens: each chunk's cost in characters at that chunk's own tokens per
character (counted once per call; chunks not read yet at their neighbours'), since scripts cost
differently (a byte-level count prices a CJK character at 3). :class:`ContextBudget` is RSE's
selection policy under a budget (:class:`~.selection.SelectionPolicy`; dsRAG's chunk counts are
the other): it runs the search, then measures the nodes built and corrects once: never over the
user's limits, and no placed hit left out that fits in what they leave.
"""

from __future__ import annotations

import itertools
import logging
import math
from collections.abc import Callable, Iterable, Iterator, Mapping, Sequence
from dataclasses import replace
from typing import Any

import numpy as np
from llama_index.core.schema import BaseNode, MetadataMode, TextNode

from llama_index.packs.self_rag_rse.context.segment_header import segment_header
from llama_index.packs.self_rag_rse.rse.budget import (
    IntArray,
    fill_budget,
    find_budgeted_segments,
)
from llama_index.packs.self_rag_rse.rse.chunk_index import CHUNK_INDEX_KEY
from llama_index.packs.self_rag_rse.rse.layout import DocumentLayout
from llama_index.packs.self_rag_rse.rse.node_fields import char_span, offsets_checked
from llama_index.packs.self_rag_rse.rse.segment_nodes import cut_node, free_text, segment_nodes
from llama_index.packs.self_rag_rse.rse.selection import FloatArray, SelectionPolicy, Spans
from llama_index.packs.self_rag_rse.rse.stitching import stitch_chunks
from llama_index.packs.self_rag_rse.rse.types import Segment, SegmentExtraction
from llama_index.packs.self_rag_rse.rse.values import CHARS_PER_TOKEN, MAX_BUDGET

logger = logging.getLogger(__name__)

#: The shortest piece of a hit that fills what a budget has left (a quarter of it in tokens).
MIN_PIECE_CHARS = 100

#: ``minimum_value`` under a budget when none is given: a segment must be worth more than a
#: strong hit alone, and weaker hits come in by the fill, in rank order.
BUDGET_MINIMUM_VALUE = 1.0

Tokenizer = Callable[[str], Sequence[Any]]
#: ``(characters, tokens)`` of the text the LLM reads (or of a chunk's text alone).
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


class ContextBudget(SelectionPolicy):
    """RSE's selection under a context budget: the user's limits ``max_chars`` / ``max_tokens``
    (``None``: none of that kind; tokens counted with ``tokenizer``, :func:`count_tokens`), the
    :attr:`limit` the search spends (in tokens when there is a token limit, each chunk at its own
    count; a character limit beside it is kept by the correction), and what was measured on the
    way: header sizes and chunk token counts (kept for every search round of the call).

    ``max_length``: the most chunks in one segment; ``minimum_value``: the least a segment the
    search takes is worth (``None``: :data:`BUDGET_MINIMUM_VALUE`); ``keep_top_hits``: the best
    this-many hits are in as far as they fit together; ``partial``: a piece of a hit may fill
    what the segments leave (:data:`MIN_PIECE_CHARS` at least); ``headers``: segments show their
    headers (:func:`~.segment_nodes.segment_nodes`). Every document hit is searched (the budget
    decides how much of each), with calibration ``'spread'`` unless another is given.
    """

    default_calibration = "spread"

    def __init__(
        self,
        *,
        max_length: int,
        max_chars: int | None = None,
        max_tokens: int | None = None,
        tokenizer: Tokenizer | None = None,
        minimum_value: float | None = None,
        keep_top_hits: int = 0,
        partial: bool = False,
        headers: bool = True,
    ) -> None:
        super().__init__(
            max_length=max_length,
            minimum_value=BUDGET_MINIMUM_VALUE if minimum_value is None else minimum_value,
            most_documents=None,
        )
        self.max_chars = max_chars
        self.max_tokens = max_tokens
        self.tokenizer = tokenizer
        self.keep_top_hits = keep_top_hits
        self.partial = partial
        self.headers = headers
        # The search's ceiling; what comes back is measured against the user's limits anyway.
        self.limit = min(max_tokens or max_chars or MAX_BUDGET, MAX_BUDGET)
        self._headers: dict[tuple[Any, ...], int] = {}
        self._counts: dict[str, Cost] = {}

    def scale(self, values: FloatArray, lengths: FloatArray) -> FloatArray:
        """A budget is spent in characters: a hit's worth (when positive) scales with the text
        it brings, against the mean hit, so the search does not trade one long strong hit for
        two short weaker ones.
        """
        if not lengths.size or lengths.mean() <= 0:
            return values
        return np.where(values > 0, values * lengths / lengths.mean(), values)

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
            built = self._build(Segment(node.ref_doc_id or "", 0, 1, 0.0, members=[node]))[0]
            shown = built.get_content(metadata_mode=MetadataMode.LLM)
            self._headers[kind] = len(shown) - len(built.get_content().rstrip())
        return self._headers[kind]

    def search(
        self,
        laid_out: SegmentExtraction,
        layouts: Mapping[str, DocumentLayout],
        hit_ids: Sequence[str],
    ) -> Spans:
        """Segments of ``laid_out`` worth most within the budget, then the best remaining hits
        (``hit_ids``, best first: equal values fill as top-k would) that fit. The best
        :attr:`keep_top_hits` hits are in as far as they fit together: each one's value is
        raised above everything else together, so a best choice holds as many as fit.
        """
        values = laid_out.values
        splits = laid_out.document_splits
        first, step = self._chunk_costs(laid_out, layouts)
        # The chunk at hand at each position laid out (regions end to end), and where each is.
        at_hand = [layouts[r.doc_id].held.get(p) for r in laid_out.regions for p in r.positions]
        where = {node.node_id: i for i, node in enumerate(at_hand) if node is not None}
        hit_positions = [where[node_id] for node_id in hit_ids if node_id in where]
        kept = hit_positions[: self.keep_top_hits]
        searched = values.copy()
        searched[kept] = np.maximum(values[kept], 0.0) + 1.0 + np.maximum(values, 0).sum()
        spans, _ = find_budgeted_segments(
            searched,
            splits,
            first_costs=first,
            step_costs=step,
            budget=self.limit,
            max_length=self.max_length,
            minimum_value=self.minimum_value,
        )
        least = MIN_PIECE_CHARS if self.max_tokens is None else MIN_PIECE_CHARS // CHARS_PER_TOKEN
        filled = fill_budget(
            spans,
            values,
            splits,
            first_costs=first,
            step_costs=step,
            budget=self.limit,
            candidates=hit_positions,
            max_length=self.max_length,
            least_piece=least if self.partial else 0,
        )
        return filled, [float(np.sum(values[start:end])) for start, end in filled]

    def fit(
        self,
        extraction: SegmentExtraction,
        *,
        hits: Sequence[BaseNode],
        values_of: Mapping[str, float],
        layouts: Mapping[str, DocumentLayout],
    ) -> None:
        """The one correction, on the nodes built: drop the least valuable segments until the
        rest fits; after a drop, or under a token limit (the search's costs are counts of parts,
        not of the text built), add the spares (the placed ``hits`` as one-chunk segments, best
        first, :func:`_spares`) that fit and touch no segment kept, up to the first worth more
        than 0 that does not fit (with :attr:`partial`, what is left goes to a piece of it, as
        the search planned). The unplaced nodes
        follow as far as they fit (the rest go to ``extraction.left_out``); with
        :attr:`partial`, the free part of the best spare worth more than 0
        (:func:`~.segment_nodes.free_text`) fills what is left.
        """
        kept = sorted(extraction.segments, key=lambda s: -s.value)
        costs = [self.cost(s.nodes) for s in kept]
        while kept and not self.fits(_sum(costs)):
            del kept[-1], costs[-1]
        dropped = len(kept) < len(extraction.segments)
        # The spares are made one by one, only as far as they are read.
        refill, rest = itertools.tee(_spares(hits, values_of, layouts))
        if dropped or self.max_tokens is not None:
            for spare in refill:
                # Not inside or next to a segment kept: its text would be given twice.
                if any(k.touches(spare) for k in kept):
                    continue
                # Its text alone is the least it can cost: once the budget is spent, most spares
                # are refused by that, without building their nodes.
                cost = self._count(spare.members[0])
                if self.fits(_sum([*costs, cost])):
                    spare.nodes = list(self._build(spare))
                    cost = self.cost(spare.nodes)
                if self.fits(_sum([*costs, cost])):
                    kept.append(spare)
                    costs.append(cost)
                elif self.partial and spare.value > 0 and not dropped:
                    break
        extraction.segments = sorted(kept, key=lambda s: -s.value)
        unplaced = extraction.passthrough
        extraction.passthrough = []
        for item in unplaced:
            cost = self.cost([item.node])
            if self.fits(_sum([*costs, cost])):
                extraction.passthrough.append(item)
                costs.append(cost)
            else:
                extraction.left_out.append(item)
        if extraction.left_out:
            logger.info(
                "RSE left %d unplaced node(s) out: they do not fit the budget (raise the "
                "budget to pass them on)",
                len(extraction.left_out),
            )
        if not self.partial:
            return
        for spare in rest:
            if spare.value <= 0:
                continue
            if (free := free_text(spare, kept)) is None:
                continue
            if (piece := self._piece(spare, free, _sum(costs))) is not None:
                extraction.segments.append(piece)
            return

    def why_empty(self, head: str, extraction: SegmentExtraction, hits: Sequence[BaseNode]) -> str:
        """No hit fits the budget, with its header."""
        cheapest = min(len(node.get_content()) + self.header(node) for node in hits)
        limits = {"max_context_chars": self.max_chars, "max_context_tokens": self.max_tokens}
        shown = ", ".join(f"{name}={value}" for name, value in limits.items() if value is not None)
        return (
            f"{head}: no hit fits the context budget ({shown}); the shortest needs "
            f"{cheapest} characters with its header: raise the budget (or pass "
            "segment_headers=False to spend it on text alone)"
        )

    def _build(self, segment: Segment) -> list[TextNode]:
        return segment_nodes(segment, headers=self.headers)

    def _piece(self, spare: Segment, free: tuple[int, int], used: Cost) -> Segment | None:
        """``spare``'s ``free`` part cut to the budget left after ``used``, if it needs cutting."""
        node = (spare.nodes or self._build(spare))[0]
        start, end = free
        keep = self._room(used, spare.members[0])
        while end - start > keep >= MIN_PIECE_CHARS:  # only where the budget binds
            cut = cut_node(node, start, keep)
            if cut is None or len(cut.get_content()) < MIN_PIECE_CHARS:
                return None
            if self.fits(_sum([used, self.cost([cut])])):
                return replace(spare, nodes=[cut])
            keep = int(keep * 0.9)  # a token limit counts the text some other way
        return None

    def _room(self, used: Cost, chunk: BaseNode) -> int:
        """Characters of ``chunk``'s text that fit in what the search's limit leaves after
        ``used``, its header aside (tokens at the chunk's own count); the caller measures.
        """
        if self.max_tokens is None:
            return self.limit - used[0] - self.header(chunk)
        chars, tokens = self._count(chunk)
        return (self.max_tokens - used[1]) * chars // max(1, tokens) - self.header(chunk)

    def _count(self, chunk: BaseNode) -> Cost:
        """``(characters, tokens)`` of ``chunk``'s text, counted once per call."""
        if chunk.node_id not in self._counts:
            text = chunk.get_content()
            self._counts[chunk.node_id] = (len(text), count_tokens(text, self.tokenizer))
        return self._counts[chunk.node_id]

    def _in_tokens(
        self, nodes: Sequence[BaseNode | None], first: IntArray, step: IntArray
    ) -> tuple[IntArray, IntArray]:
        """Costs in characters of ``nodes`` (a region, ``None`` where a chunk is not at hand)
        as tokens: each chunk at its own tokens per character, one not at hand at those of the
        chunks at hand together (rounded up: a chunk alone costs its count exactly).
        """
        counts = [None if node is None else self._count(node) for node in nodes]
        known = [count for count in counts if count is not None]
        together = (sum(c for c, _ in known), sum(t for _, t in known))
        tokens = np.array([(count or together)[1] for count in counts], dtype=np.int64)
        chars = np.array([max(1, (count or together)[0]) for count in counts], dtype=np.int64)
        return -(-first * tokens // chars), -(-step * tokens // chars)

    def _chunk_costs(
        self, laid_out: SegmentExtraction, layouts: Mapping[str, DocumentLayout]
    ) -> tuple[IntArray, IntArray]:
        """``(first, step)`` costs of every position laid out, in the search's unit (see the
        module docstring). Positions not at hand get ``first = 0``: only hits begin a segment.
        """
        firsts = [np.zeros(0, dtype=np.int64)]
        steps = [np.zeros(0, dtype=np.int64)]
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
            known = first > 0
            typical = int(np.median(first[known])) if known.any() else 0
            i = 1
            while i < len(nodes):
                # Up to the next known end, the steps share the distance from the last one.
                j = i
                while j < len(nodes) and ends[j] is None and nodes[j] is None:
                    j += 1
                left = ends[i - 1]
                right = ends[j] if j < len(nodes) else None
                if left is not None and right is not None:
                    total = max(0, right - left)
                    count = j - i + 1
                    cuts = [total * t // count for t in range(count + 1)]
                    step[i : j + 1] = [b - a for a, b in itertools.pairwise(cuts)]
                    i = j + 1
                else:
                    step[i] = _step_without_offsets(nodes[i - 1], nodes[i], typical)
                    i += 1
            step += [self._more_header(a, b) for a, b in zip([None, *nodes], nodes, strict=False)]
            if self.max_tokens is not None:
                first, step = self._in_tokens(nodes, first, step)
            firsts.append(first)
            steps.append(step)
        return np.concatenate(firsts), np.concatenate(steps)

    def _more_header(self, before: BaseNode | None, node: BaseNode | None) -> int:
        """At most what ``node`` adds to the header of a segment ending at ``before``."""
        if before is None or node is None or not self.headers:
            return 0
        return max(0, len(segment_header(node, [before, node])) - len(segment_header(before)))


def _spares(
    hits: Sequence[BaseNode],
    values_of: Mapping[str, float],
    layouts: Mapping[str, DocumentLayout],
) -> Iterator[Segment]:
    """The placed hits as one-chunk segments, best first, each made (and filled from its
    layout) only when it is read: what a budget refills with.
    """
    for hit in hits:
        layout = layouts.get(hit.ref_doc_id or "")
        if layout is None:
            continue
        position = layout.positions.get(hit.node_id)
        if position is None or position not in layout.held:
            continue
        segment = Segment(layout.doc_id, position, position + 1, values_of[hit.node_id])
        layout.fill(segment)
        yield segment


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
    pieces = stitch_chunks(
        [previous, text],
        [char_span(before), char_span(node)],
        [False, True],
        checked=[offsets_checked(before), offsets_checked(node)],
    )
    return max(0, len(pieces[0].text) - len(previous)) if len(pieces) == 1 else len(text)


def _sum(costs: Sequence[Cost]) -> Cost:
    """``(characters, tokens)`` of ``costs`` together."""
    return sum(cost[0] for cost in costs), sum(cost[1] for cost in costs)
