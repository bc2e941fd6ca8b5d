"""The planner on random prompt sets: whatever it shares, holds or hands between runs, every
prompt's tokens are its held prefix and the tokens of the edges down to its own, each edge at
the positions it sits at.
"""

from __future__ import annotations

import numpy as np
from hypothesis import example, given, settings
from hypothesis import strategies as st

from llama_index.packs.self_rag_rse.llamacpp.plan import Held, assign, plan

# A tiny alphabet makes prompts share prefixes of every length.
token_lists = st.lists(st.integers(0, 3), min_size=1, max_size=40)
# A judgement's shape: a head, paragraphs, and each paragraph asked in tails of any lengths.
judgements = st.lists(
    st.tuples(
        st.lists(st.integers(4, 9), min_size=1, max_size=30),
        st.lists(
            st.lists(st.integers(10, 13), min_size=1, max_size=40),
            min_size=1,
            max_size=3,
        ),
    ),
    min_size=1,
    max_size=3,
).map(lambda paragraphs: [[1, 2, 3, *p, *tail] for p, tails in paragraphs for tail in tails])


@settings(max_examples=300, deadline=None)
@example(prompts=[[0] * 9, [0] * 10], held_tokens=[], generating=set(), share=True)
@given(
    prompts=st.one_of(st.lists(token_lists, min_size=1, max_size=8), judgements),
    held_tokens=st.lists(token_lists, max_size=3),
    generating=st.sets(st.integers(0, 7)),
    share=st.booleans(),
)
def test_every_prompt_is_its_held_prefix_and_its_edges(prompts, held_tokens, generating, share):
    held = {
        10 + i: Held(tokens, np.zeros(2, dtype=np.float32) if i % 2 else None, keep=i == 2)
        for i, tokens in enumerate(held_tokens)
    }
    p = plan(prompts, held, share=share)
    free = [i for i in range(20) if i not in held]
    assign(p, len(prompts), free, {g for g in generating if g < len(prompts)})
    assert sorted(p.seq_of) == list(range(len(prompts)))
    assert len(set(p.seq_of.values())) == len(prompts)  # one sequence per prompt
    found: dict[int, list[int]] = {}
    for start in p.starts:
        prefix = [] if start.source is None else held[start.source].tokens[: start.length]
        assert len(prefix) == start.length
        if start.edge is None:  # held whole, with its logits
            assert start.request is not None
            found[start.request] = list(prefix)
            continue
        stack = [(start.edge, list(prefix))]
        while stack:
            edge, before = stack.pop()
            assert edge.tokens, "an edge evaluates at least one token"
            assert edge.start == len(before)  # evaluated at the positions it sits at
            # evaluated in the sequence of a prompt below it; one child at most goes on in place
            assert edge.seq in {p.seq_of[leaf.request] for leaf in edge.leaves()}
            assert sum(child.seq == edge.seq for child in edge.children) <= 1
            text = before + edge.tokens
            if edge.request is not None:
                assert edge.seq == p.seq_of[edge.request] and not edge.children
                found[edge.request] = text
            for child in edge.children:
                # the child going on in place starts where the run ends; a copy starts at most
                # there and holds the run's tokens before its start (a run may carry the first
                # tokens of the child that goes on in place)
                assert (
                    child.start == len(text) if child.seq == edge.seq else child.start <= len(text)
                )
                stack.append((child, text[: child.start]))
    assert found == {r: list(tokens) for r, tokens in enumerate(prompts)}
