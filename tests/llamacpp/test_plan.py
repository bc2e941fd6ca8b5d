"""The evaluation planner (pure Python): what is evaluated once, what the cache saves."""

from __future__ import annotations

import numpy as np

from llama_index.packs.self_rag_rse.llamacpp.plan import (
    MIN_SHARED_TOKENS,
    MOST_HANDED,
    Edge,
    Held,
    Plan,
    assign,
    plan,
)

HEAD = list(range(100, 130))  # 30 tokens shared by every prompt


def evaluated(p: Plan) -> int:
    return sum(len(edge.tokens) for edge in p.edges())


def by_request(p: Plan) -> dict[int, Edge]:
    return {leaf.request: leaf for edge in p.edges() for leaf in [edge] if leaf.request is not None}


def test_a_shared_prefix_and_a_shared_paragraph_are_evaluated_once() -> None:
    para = [list(range(200 + 50 * i, 240 + 50 * i)) for i in range(3)]
    answer_tail, label_tail = [1, 2, 3, 4, 5], [6, 7, 8]
    prompts = [HEAD + p + tail for p in para for tail in (answer_tail, label_tail)]
    p = plan(prompts, {})
    assign(p, len(prompts), list(range(8)), generating={0, 2, 4})
    assert evaluated(p) == len(HEAD) + sum(len(x) for x in para) + 3 * 8
    (start,) = p.starts
    assert start.source is None and start.edge is not None and start.edge.tokens == HEAD
    # the answers generate, so they hold the lowest (consecutive) ids; labels follow
    assert [p.seq_of[r] for r in (0, 2, 4)] == [0, 1, 2]
    assert sorted(p.seq_of[r] for r in (1, 3, 5)) == [3, 4, 5]
    # every level is evaluated in the sequence of one of its leaves
    for edge in p.edges():
        leaves = {p.seq_of[leaf.request] for leaf in edge.leaves() if leaf.request is not None}
        assert edge.seq in leaves
    assert [len(level) for level in p.waves()] == [1, 3, 6]


def test_every_prompt_evaluates_its_own_last_token() -> None:
    prompts = [HEAD, HEAD, [*HEAD, 7]]
    p = plan(prompts, {})
    leaves = by_request(p)
    assert leaves[0].tokens == leaves[1].tokens == [HEAD[-1]]
    assert leaves[0].start == len(HEAD) - 1
    # the third continues past the others' last token: it evaluates that token too
    assert leaves[2].tokens == [HEAD[-1], 7] and leaves[2].start == len(HEAD) - 1


def test_short_shared_runs_are_evaluated_by_each_prompt() -> None:
    # Sharing [1, 2] between two prompts saves 2 evaluations, less than a decode pass costs.
    prompts = [[*HEAD, 1, 2, 3], [*HEAD, 1, 2, 4], [*HEAD, 5]]
    p = plan(prompts, {})
    (head,) = [s.edge for s in p.starts]
    assert head is not None and head.tokens == HEAD
    assert [c.tokens for c in head.children] == [[1, 2, 3], [1, 2, 4], [5]]
    assert MIN_SHARED_TOKENS > (2 - 1) * 2
    assert [len(level) for level in p.waves()] == [1, 3]


def test_held_sequences_are_continued_in_place_or_copied() -> None:
    answer = [*HEAD, 9, 9, 9, 50, 51, 52]  # a first round's sequence: prompt + answer
    keep = [*HEAD, 8]
    held = {3: Held(answer), 5: Held(keep, keep=True)}
    prompts = [[*HEAD, 9, 9, 9, 60, 61], [*HEAD, 70, 71, 72]]
    p = plan(prompts, held)
    assign(p, 2, [0, 1, 2], generating=())
    starts = {s.edge.tokens[0]: s for s in p.starts if s.edge is not None}
    deep, shallow = starts[60], starts[70]
    assert deep.source == 3 and deep.takeover and deep.length == len(HEAD) + 3
    assert p.seq_of[0] == 3  # continues the held answer in place
    # the other one needs only the head: a copy (the kept sequence is never continued)
    assert shallow.source in (3, 5) and not shallow.takeover and shallow.length == len(HEAD)
    assert p.claimed == {3}
    assert evaluated(p) == 2 + 3
    (only,) = plan([[*HEAD, 70]], {5: Held(keep, keep=True)}).starts
    assert only.source == 5 and not only.takeover


def test_a_prompt_held_whole_with_its_logits_costs_nothing() -> None:
    logits = np.zeros(4, dtype=np.float32)
    held = {0: Held(HEAD, logits, keep=True), 1: Held([*HEAD, 5], None)}
    p = plan([HEAD, [*HEAD, 5]], held)
    cached = [s for s in p.starts if s.edge is None]
    assert [(s.request, s.source, s.takeover) for s in cached] == [(0, 0, False)]
    # without known logits the last token is evaluated again
    (leaf,) = [s.edge for s in p.starts if s.edge is not None]
    assert leaf is not None and leaf.tokens == [5] and leaf.start == len(HEAD)


def test_without_sharing_every_prompt_is_evaluated_whole() -> None:
    prompts = [[*HEAD, 1], [*HEAD, 2]]
    p = plan(prompts, {0: Held([*HEAD, 1], np.zeros(2, dtype=np.float32))}, share=False)
    assert evaluated(p) == sum(len(x) for x in prompts)
    assert all(s.source is None for s in p.starts)


def test_a_prompts_longer_tail_hands_its_extra_tokens_to_the_shared_run() -> None:
    # Per paragraph, an answer tail of 5 tokens and a label tail of 8: the label continues
    # the paragraph in place and hands it its first 3 tokens, so every prompt's last run
    # holds 5 tokens (one micro-batch on a split cache, where 5 and 8 would make two).
    para = [list(range(200 + 50 * i, 240 + 50 * i)) for i in range(2)]
    answer_tail, label_tail = [1, 2, 3, 4, 5], [6, 7, 8, 9, 10, 11, 12, 13]
    prompts = [HEAD + p + tail for p in para for tail in (answer_tail, label_tail)]
    p = plan(prompts, {})
    assign(p, len(prompts), list(range(4)), generating={0, 2})
    assert evaluated(p) == len(HEAD) + 2 * 40 + 2 * 5 + 2 * 8  # nothing evaluated twice
    leaves = by_request(p)
    assert [len(leaves[r].tokens) for r in range(4)] == [5, 5, 5, 5]
    for r in (1, 3):
        assert leaves[r].tokens == label_tail[3:] and leaves[r].start == len(HEAD) + 40 + 3
    paragraphs = [edge for edge in p.edges() if edge.children and edge.tokens != HEAD]
    for edge, r in zip(paragraphs, (1, 3), strict=True):
        assert edge.seq == p.seq_of[r] and edge.tokens[-3:] == label_tail[:3]
    # a run far longer than the others evens nothing out: it is worth a micro-batch of its own
    long_tail = list(range(60, 60 + MOST_HANDED + 5))
    p = plan([HEAD + para[0] + answer_tail, HEAD + para[0] + long_tail], {})
    assign(p, 2, [0, 1], generating={0})
    assert sorted(len(leaf.tokens) for leaf in by_request(p).values()) == [5, MOST_HANDED + 5]
