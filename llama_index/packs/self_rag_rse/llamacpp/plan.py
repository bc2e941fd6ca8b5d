"""Which prompt tokens a batch really needs evaluated, and in which sequence.

Prompts asked of one model share long prefixes: a system prompt and the question, then one
paragraph asked several questions; and a conversation's KV cache may already hold some of them
from an earlier call (a paragraph read for the answer, needed again to judge support).
:func:`plan` lays the prompts out as a prefix tree, cuts away what the cache holds, and returns
the rest as *edges*: runs of tokens, each evaluated once, in one sequence, whose KV is then
handed to the edges below. :func:`assign` chooses the sequence ids. Pure Python, no llama.cpp:
:mod:`.conversation` executes the plan.

Every prompt evaluates at least its own last token, so that it reads its first logits from its
own batch row; only a prompt the cache holds whole, with the logits after it, costs nothing.
"""

from __future__ import annotations

from collections.abc import Collection, Iterator, Mapping, Sequence
from dataclasses import dataclass, field
from itertools import pairwise

import numpy as np
from numpy.typing import NDArray

#: A run shared by ``m`` prompts is evaluated once only if that saves at least this many token
#: evaluations, ``(m - 1) * len(run)``: a separate run costs one more ``llama_decode`` pass over
#: the weights, about what evaluating a handful of tokens in a bigger batch costs.
MIN_SHARED_TOKENS = 8
#: A prompt's run evens out its level by handing fewer than this many tokens to its parent's run.
MOST_HANDED = 32


@dataclass
class Held:
    """A sequence the KV cache holds: its tokens, the logits after the last one (when known),
    and whether it must survive later calls (``keep``: copied from, never continued in place).
    """

    tokens: list[int]
    logits: NDArray[np.float32] | None = None
    keep: bool = False


@dataclass(eq=False)
class Edge:
    """Tokens evaluated in one sequence, from position ``start``; ``request`` when they end a
    prompt (a leaf), else the edges that continue them.
    """

    tokens: list[int]
    start: int
    children: list[Edge] = field(default_factory=list)
    request: int | None = None
    seq: int = -1

    def leaves(self) -> Iterator[Edge]:
        """The leaf edges below (or at) this one, depth first."""
        if self.request is not None:
            yield self
        for child in self.children:
            yield from child.leaves()


@dataclass
class Start:
    """Where an evaluation starts: an ``edge`` (or a request the cache holds whole) continuing
    the first ``length`` positions of the held sequence ``source`` (None: an empty sequence),
    in place (``takeover``) or in a copy.
    """

    edge: Edge | None
    request: int | None
    source: int | None
    takeover: bool
    length: int


@dataclass
class Plan:
    """The evaluations of one group of prompts; ``seq_of`` maps each prompt to its sequence id
    once :func:`assign` has run.
    """

    starts: list[Start]
    seq_of: dict[int, int] = field(default_factory=dict)

    @property
    def claimed(self) -> set[int]:
        """Held sequences continued in place (they become a prompt's sequence)."""
        return {s.source for s in self.starts if s.takeover and s.source is not None}

    @property
    def copied(self) -> set[int]:
        """Held sequences copied from and left as they are."""
        return {s.source for s in self.starts if not s.takeover and s.source is not None}

    def edges(self) -> Iterator[Edge]:
        """Every edge, parents before children."""
        return (edge for level in self.waves() for edge, _ in level)

    def evaluated(self, n: int) -> list[int]:
        """The prompt tokens evaluated for each of the ``n`` prompts: an edge's count for the
        first prompt below it (a run several prompts share, once).
        """
        counts = [0] * n
        for edge in self.edges():
            first = min(leaf.request for leaf in edge.leaves() if leaf.request is not None)
            counts[first] += len(edge.tokens)
        return counts

    def waves(self) -> Iterator[list[tuple[Edge, Edge | None]]]:
        """Edges with their parent edge (None for a start), one list per tree level: a level
        can be evaluated once the one above it is.
        """
        wave: list[tuple[Edge, Edge | None]] = [
            (s.edge, None) for s in self.starts if s.edge is not None
        ]
        while wave:
            yield wave
            wave = [(child, edge) for edge, _ in wave for child in edge.children]


class _Node:
    """A prefix-tree node: the prompt prefix of length ``depth``."""

    __slots__ = ("children", "depth", "ends", "holders")

    def __init__(self, depth: int) -> None:
        self.children: dict[int, _Node] = {}
        self.depth = depth
        self.ends: list[int] = []  # prompts whose tokens but the last end here
        self.holders: list[int] = []  # held sequences that hold this prefix


def plan(prompts: Sequence[Sequence[int]], held: Mapping[int, Held], share: bool = True) -> Plan:
    """The evaluations ``prompts`` need, given the ``held`` sequences of the KV cache.

    With ``share=False`` every prompt is evaluated whole in its own sequence (the reference the
    shared evaluation is tested against).
    """
    starts: list[Start] = []
    claimed: set[int] = set()
    rest: list[int] = []
    for r, prompt in enumerate(prompts):
        h = _held_whole(prompt, held) if share else None
        if h is None:
            rest.append(r)
            continue
        take = h not in claimed and not held[h].keep
        if take:
            claimed.add(h)
        starts.append(Start(edge=None, request=r, source=h, takeover=take, length=len(prompt)))
    if not share:
        starts += [
            Start(
                edge=Edge(list(prompts[r]), 0, request=r),
                request=None,
                source=None,
                takeover=False,
                length=0,
            )
            for r in rest
        ]
        return Plan(starts)

    root = _Node(0)
    for r in rest:
        node = root
        for token in prompts[r][:-1]:
            child = node.children.get(token)
            if child is None:
                child = _Node(node.depth + 1)
                node.children[token] = child
            node = child
        node.ends.append(r)
    for h, sequence in held.items():
        node = root
        for token in sequence.tokens:
            found = node.children.get(token)
            if found is None:
                break
            node = found
            node.holders.append(h)

    tops: list[tuple[_Node, Edge]] = []
    stack = [root]
    while stack:  # the held part of the tree, and the edges hanging from it
        node = stack.pop()
        for token, child in node.children.items():
            if child.holders:
                stack.append(child)
            else:
                tops += [(node, edge) for edge in _merge(_build(token, child, prompts))]
        tops += [(node, Edge([prompts[r][-1]], node.depth, request=r)) for r in node.ends]
    # Deepest first: a long held prefix is worth more than a short one to whoever continues it.
    tops.sort(key=lambda item: -item[0].depth)
    for node, edge in tops:
        free = next((h for h in node.holders if h not in claimed and not held[h].keep), None)
        if free is not None:  # continued in place
            claimed.add(free)
            starts.append(
                Start(edge=edge, request=None, source=free, takeover=True, length=node.depth)
            )
        else:  # a copy of a holder (or from nothing)
            source = node.holders[0] if node.holders else None
            starts.append(
                Start(edge=edge, request=None, source=source, takeover=False, length=node.depth)
            )
    return Plan(starts)


def assign(
    plan_: Plan, n_prompts: int, free_ids: Sequence[int], generating: Collection[int]
) -> None:
    """Give every prompt a sequence id and every edge the sequence it is evaluated in.

    A prompt continuing a held sequence in place keeps its id; the others take ``free_ids`` in
    order, prompts that generate first, so that the sequences decoded step by step hold
    consecutive ids (a split KV cache decodes consecutive ids in one pass). An edge is
    evaluated in the sequence of one of its leaves (the prompt continuing in place, else one
    under its longest child), so that one child continues it in place and only the others copy
    it; then each level's runs are evened out (see :func:`_balance`).
    """
    seq_of: dict[int, int] = {}
    for start in plan_.starts:
        if start.takeover and start.source is not None:
            owner = start.request if start.edge is None else next(start.edge.leaves()).request
            assert owner is not None
            seq_of[owner] = start.source
    fresh = sorted(
        (r for r in range(n_prompts) if r not in seq_of), key=lambda r: (r not in generating, r)
    )
    if len(fresh) > len(free_ids):
        raise ValueError(f"{len(fresh)} sequences needed, {len(free_ids)} free")
    seq_of.update(zip(fresh, free_ids, strict=False))
    plan_.seq_of = seq_of
    for start in plan_.starts:
        if start.edge is not None:
            # A prompt continuing a held sequence in place evaluates there.
            _descend(start.edge, start.source if start.takeover else None, seq_of)
    _balance(plan_)


def _descend(edge: Edge, forced: int | None, seq_of: Mapping[int, int]) -> None:
    # Unforced, an edge goes on in place into its longest child (see _balance).
    leaf = edge
    while leaf.request is None:
        leaf = max(leaf.children, key=lambda c: (len(c.tokens), -min(_leaf_ids(c, seq_of))))
    edge.seq = forced if forced is not None else seq_of[leaf.request]
    for child in edge.children:
        # The child whose leaves include this sequence goes on in it; the others copy.
        _descend(child, edge.seq if edge.seq in _leaf_ids(child, seq_of) else None, seq_of)


def _balance(plan_: Plan) -> None:
    """Even out each level's runs: on a split KV cache llama.cpp cuts a batch into micro-batches
    taking as many tokens from each sequence, so runs a few tokens longer than the rest make one
    more, tiny micro-batch. A leaf continuing its parent in place hands its first ``len -
    shortest`` tokens (fewer than :data:`MOST_HANDED`) to the parent's run when that leaves fewer
    distinct run lengths over the two levels.
    """
    levels = list(plan_.waves())
    for above, level in pairwise(levels):
        shortest = min(len(edge.tokens) for edge, _ in level)
        moves = [
            (edge, parent, len(edge.tokens) - shortest)
            for edge, parent in level
            if parent is not None and edge.request is not None and edge.seq == parent.seq
            if 0 < len(edge.tokens) - shortest < MOST_HANDED
        ]
        cut = {id(edge): extra for edge, _, extra in moves}
        grown = {id(parent): extra for _, parent, extra in moves}
        before = len({len(e.tokens) for e, _ in level}) + len({len(e.tokens) for e, _ in above})
        after = len({len(e.tokens) - cut.get(id(e), 0) for e, _ in level})
        after += len({len(e.tokens) + grown.get(id(e), 0) for e, _ in above})
        if after < before:
            for edge, parent, extra in moves:
                parent.tokens += edge.tokens[:extra]
                edge.tokens, edge.start = edge.tokens[extra:], edge.start + extra


def _leaf_ids(edge: Edge, seq_of: Mapping[int, int]) -> set[int]:
    return {seq_of[leaf.request] for leaf in edge.leaves() if leaf.request is not None}


def _held_whole(prompt: Sequence[int], held: Mapping[int, Held]) -> int | None:
    """A held sequence that is exactly ``prompt``, with the logits after it."""
    wanted = list(prompt)
    for h, sequence in held.items():
        if sequence.logits is not None and sequence.tokens == wanted:
            return h
    return None


def _build(token: int, node: _Node, prompts: Sequence[Sequence[int]]) -> Edge:
    """The edge starting with ``token`` (leading to ``node``) and everything below it."""
    tokens = [token]
    start = node.depth - 1
    while not node.ends and len(node.children) == 1:
        ((token, node),) = node.children.items()
        tokens.append(token)
    edge = Edge(tokens, start)
    edge.children = [_build(t, child, prompts) for t, child in node.children.items()]
    edge.children += [Edge([prompts[r][-1]], node.depth, request=r) for r in node.ends]
    return edge


def _merge(edge: Edge) -> list[Edge]:
    """``edge``, or its children with its tokens in front when sharing them saves too little
    (see :data:`MIN_SHARED_TOKENS`); applied all the way down.
    """
    if edge.request is None and (len(edge.children) - 1) * len(edge.tokens) < MIN_SHARED_TOKENS:
        out: list[Edge] = []
        for child in edge.children:
            child.tokens = edge.tokens + child.tokens
            child.start = edge.start
            out += _merge(child)
        return out
    edge.children = [merged for child in edge.children for merged in _merge(child)]
    return [edge]
