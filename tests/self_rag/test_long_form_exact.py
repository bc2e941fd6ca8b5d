"""Long form, token for token, against an independent implementation of the algorithm.

:class:`Oracle` below is written from the algorithm's description alone and shares no code with
the package: one ``llama_cpp.Llama`` with ``logits_all=True``, one sequence at a time, the
full-vocabulary log-softmax in float64 with numpy, the beam kept in plain lists. The engine
decodes each depth's continuations side by side in one batched llama.cpp call and scores them
from tracked log-probs; both must give the same segments (text, tokens' passage, citation),
the same scores (to 1e-4: batched and serial F32 decoding differ by float rounding), the same
beams and the same response. Both token typings (CONTROL and USER_DEFINED reflection tokens),
both retrieval modes, the greedy and the adaptive ``[No Retrieval]`` boundaries, finished paths
carried over.
"""

from __future__ import annotations

import zlib
from collections.abc import Callable, Iterator
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import numpy as np
import pytest
from llama_index.core.base.base_retriever import BaseRetriever
from llama_index.core.schema import NodeWithScore, QueryBundle, TextNode
from models import load_llama

from llama_index.packs.self_rag_rse import SelfRAGQueryEngine

SPECIAL = [
    "[No Retrieval]",
    "[Retrieval]",
    "[Continue to Use Evidence]",
    "[Irrelevant]",
    "[Relevant]",
    "<paragraph>",
    "</paragraph>",
    "[Utility:1]",
    "[Utility:2]",
    "[Utility:3]",
    "[Utility:4]",
    "[Utility:5]",
    "[Fully supported]",
    "[Partially supported]",
    "[No support / Contradictory]",
]
GROUNDING = ["[Fully supported]", "[Partially supported]", "[No support / Contradictory]"]
UTILITY = [f"[Utility:{k}]" for k in range(1, 6)]
MAX_NEW = 30
TOL = 1e-4
PASSAGES = [
    ("lf-while", "The while statement repeats a suite while an expression is true.", "while"),
    ("lf-for", "The for statement iterates over the items of a sequence.", None),
    ("lf-if", "The if statement selects exactly one suite by evaluating expressions.", "if"),
    ("lf-try", "The try statement specifies exception handlers for a group of statements.", None),
]


class HashedRetriever(BaseRetriever):
    """Three of the four passages, in an order that depends on the query text (a stable hash),
    so that retrieving again with a path's last segment changes the passages.
    """

    def _retrieve(self, query_bundle: QueryBundle) -> list[NodeWithScore]:
        seed = zlib.crc32(query_bundle.query_str.encode())
        order = sorted(range(len(PASSAGES)), key=lambda i: (seed >> (3 * i)) & 7)
        nodes = []
        for rank, i in enumerate(order[:3]):
            node_id, text, title = PASSAGES[i]
            metadata = {"title": title} if title else {}
            nodes.append(
                NodeWithScore(
                    node=TextNode(id_=node_id, text=text, metadata=metadata), score=1 - rank / 10
                )
            )
        return nodes


# --- the oracle -----------------------------------------------------------------------------------


@dataclass
class Seg:
    tokens: list[int]
    text: str
    node_id: str
    stop: str  # boundary / eos / length
    stop_token: int | None
    rel: float
    sup: float
    use: float
    seq: float
    score: float


@dataclass
class Beam:
    context: list[int]
    segs: list[Seg] = field(default_factory=list)
    done: bool = False

    def score(self) -> float:
        return sum(s.score for s in self.segs) / len(self.segs) if self.segs else 0.0


class Oracle:
    def __init__(self, llm: Any) -> None:
        self.llm = llm
        self.id = {}
        for text in SPECIAL:
            tokens = llm.tokenize(text.encode(), add_bos=False, special=True)
            assert len(tokens) == 1, text
            self.id[text] = tokens[0]
        self.specials = set(self.id.values())
        self.written: list[Seg] = []  # every segment written, for the coverage check

    def user(self, text: str, bos: bool) -> list[int]:
        tokens = self.llm.tokenize(text.encode(), add_bos=bos, special=False)
        return [t for t in tokens if t not in self.specials]

    def prompt(self, query: str) -> list[int]:
        return self.user(f"### Instruction:\n{query}\n\n### Response:\n", bos=True)

    def evidence(self, paragraph: str) -> list[int]:
        head = [self.id["[Retrieval]"], self.id["<paragraph>"]]
        return head + self.user(paragraph, bos=False) + [self.id["</paragraph>"]]

    def rows(self, tokens: list[int]) -> Iterator[np.ndarray]:
        """Full-vocabulary log-softmax after ``tokens``, then after each token sent back."""
        llm = self.llm
        llm.reset()
        llm.eval(tokens)
        while True:
            logits = np.asarray(llm.scores[llm.n_tokens - 1], dtype=np.float64)
            top = logits.max()
            fed = yield logits - (top + np.log(np.exp(logits - top).sum()))
            llm.eval([fed])

    def ratio(self, row: np.ndarray, a: str, b: str) -> float:
        pa, pb = np.exp(row[self.id[a]]), np.exp(row[self.id[b]])
        return float(pa / (pa + pb)) if pa + pb > 0 else 0.0

    def group(self, row: np.ndarray, members: list[str], weights: list[float]) -> float:
        p = np.exp(np.array([row[self.id[m]] for m in members]))
        return float(np.dot(p, weights) / p.sum()) if p.sum() > 0 else 0.0

    def write(
        self, context: list[int], node_id: str, paragraph: str, threshold: float | None
    ) -> Seg:
        rows = self.rows(context + self.evidence(paragraph))
        row = next(rows)
        first_row, generated, logprobs, row_of = row, [], [], []
        stop, stop_token = "length", None
        while True:
            token = int(np.argmax(row))
            if token == self.id["[Retrieval]"] or (
                token == self.id["[No Retrieval]"]
                and threshold is not None
                and self.ratio(row, "[Retrieval]", "[No Retrieval]") > threshold
            ):
                stop, stop_token = "boundary", token
                break
            if token == self.llm.token_eos():
                stop, stop_token = "eos", token
                break
            generated.append(token)
            logprobs.append(float(row[token]))
            row_of.append(row)
            if len(generated) == MAX_NEW:
                break
            row = rows.send(token)
        rows.close()
        rel = self.ratio(first_row, "[Relevant]", "[Irrelevant]")
        sup = use = 0.0
        grounding = [self.id[t] for t in GROUNDING]
        utility = [self.id[t] for t in UTILITY]
        g = next((i for i, t in enumerate(generated) if t in grounding), None)
        if g is not None:
            sup = self.group(row_of[g], GROUNDING, [1.0, 0.5, 0.0])
        u = next((i for i, t in enumerate(generated) if t in utility), None)
        if u is not None:
            use = self.group(row_of[u], UTILITY, [-1.0, -0.5, 0.0, 0.5, 1.0])
        seq = float(np.exp(np.mean(logprobs))) if logprobs else 0.0
        seg = Seg(
            generated,
            self.text(generated),
            node_id,
            stop,
            stop_token,
            rel,
            sup,
            use,
            seq,
            1.0 * rel + 1.0 * sup + 0.5 * use,
        )
        self.written.append(seg)
        return seg

    def text(self, tokens: list[int]) -> str:
        kept, inside = [], False
        for t in tokens:
            if t == self.id["<paragraph>"]:
                inside = True
            elif t == self.id["</paragraph>"]:
                inside = False
            elif not inside and t not in self.specials and t != self.llm.token_eos():
                kept.append(t)
        return " ".join(self.llm.detokenize(kept).decode("utf-8", errors="ignore").split())

    def run(
        self,
        query: str,
        retrieve: Callable[[str], list[tuple[str, str]]],
        *,
        beam_width: int,
        max_segments: int,
        threshold: float | None,
        once: bool,
    ) -> dict[str, Any]:
        first = retrieve(query)
        beam = [Beam(self.prompt(query))]
        beams, tables, depth = [], [], 0
        while depth < max_segments and any(not b.done for b in beam):
            depth += 1
            candidates = []
            for b in beam:
                if b.done:
                    candidates.append(b)
                    continue
                passages = first if depth == 1 or once else retrieve(f"{query} {b.segs[-1].text}")
                if not passages:
                    candidates.append(Beam(b.context, b.segs, True))
                for node_id, paragraph in passages:
                    seg = self.write(b.context, node_id, paragraph, threshold)
                    candidates.append(
                        Beam(b.context + seg.tokens, [*b.segs, seg], seg.stop != "boundary")
                    )
            candidates.sort(key=Beam.score, reverse=True)
            tables.append(
                [
                    (c.score(), [g.node_id for g in c.segs], c.segs[-1].text, c.done)
                    for c in candidates
                ]
            )
            beam = candidates[:beam_width]
            beams.append([(b.score(), [s.node_id for s in b.segs]) for b in beam])
        best = beam[0]
        numbers: dict[str, int] = {}
        parts = []
        for s in best.segs:
            if s.text:
                n = numbers.setdefault(s.node_id, len(numbers) + 1)
                parts.append(f"{s.text} [{n}]")
        return {
            "answer": " ".join(parts),
            "segments": best.segs,
            "depth": depth,
            "beams": beams,
            "candidates": tables,
            "cited": list(numbers),
        }


# --- the comparison -------------------------------------------------------------------------------


@pytest.fixture(scope="module", params=["user_defined", "control"])
def models(request: pytest.FixtureRequest, long_form_ggufs: dict[str, Path]) -> Iterator[Any]:
    path = long_form_ggufs[request.param]
    llm = load_llama(path)
    reference = load_llama(path, logits_all=True)
    yield llm, Oracle(reference)
    llm.close()
    reference.close()


def passages_of(retriever: BaseRetriever) -> Callable[[str], list[tuple[str, str]]]:
    def retrieve(text: str) -> list[tuple[str, str]]:
        out = []
        for n in retriever.retrieve(text):
            title = n.node.metadata.get("title")
            body = n.node.get_content()
            out.append((n.node.node_id, f"{title}\n{body}" if title else body))
        return out

    return retrieve


CASES = [
    # (question, mode, threshold, beam_width, max_segments, segment_retrieval)
    ("What does the while statement do?", "always_retrieve", None, 2, 4, "per_segment"),
    ("What does the while statement do?", "always_retrieve", None, 3, 3, "once"),
    ("Who wrote Hamlet?", "always_retrieve", None, 2, 4, "once"),
    ("What does the while statement do?", "adaptive_retrieval", 0.3, 2, 4, "per_segment"),
    ("why is the sky blue", "adaptive_retrieval", 0.3, 2, 4, "once"),
    ("What does the while statement do?", "adaptive_retrieval", 0.0, 1, 5, "per_segment"),
    ("why is the sky blue", "always_retrieve", None, 2, 3, "per_segment"),
]


def run_case(oracle: Oracle, case: Any) -> dict[str, Any]:
    """The oracle's answer for one of CASES (the [No Retrieval] boundary in adaptive mode only)."""
    question, mode, threshold, beam_width, max_segments, segment_retrieval = case
    return oracle.run(
        question,
        passages_of(HashedRetriever()),
        beam_width=beam_width,
        max_segments=max_segments,
        threshold=threshold if mode == "adaptive_retrieval" else None,
        once=segment_retrieval == "once",
    )


@pytest.mark.parametrize("case", CASES, ids=[f"case{i}" for i in range(len(CASES))])
def test_the_engine_equals_the_oracle(models: Any, case: Any) -> None:
    llm, oracle = models
    question, mode, threshold, beam_width, max_segments, segment_retrieval = case
    engine = SelfRAGQueryEngine(
        llm=llm,
        retriever=HashedRetriever(),
        mode=mode,
        threshold=threshold,
        long_form=True,
        beam_width=beam_width,
        max_segments=max_segments,
        segment_retrieval=segment_retrieval,
        max_new_tokens=MAX_NEW,
    )
    response = engine.query(question)
    meta = response.metadata["self_rag"]
    if mode == "adaptive_retrieval":
        assert meta["retrieve"], "the case needs the gate to retrieve"
    expected = run_case(oracle, case)
    assert response.response == expected["answer"]
    assert meta["depth"] == expected["depth"]
    rows = meta["segments"]
    assert len(rows) == len(expected["segments"])
    for row, seg in zip(rows, expected["segments"], strict=True):
        assert (row["text"], row["node_id"]) == (seg.text, seg.node_id)
        assert row["relevance"] == pytest.approx(seg.rel, abs=TOL)
        assert row["support"] == pytest.approx(seg.sup, abs=TOL)
        assert row["utility"] == pytest.approx(seg.use, abs=TOL)
        assert row["seq_score"] == pytest.approx(seg.seq, abs=TOL)
        assert row["score"] == pytest.approx(seg.score, abs=TOL)
    for kept, want in zip(meta["beams"], expected["beams"], strict=True):
        assert [p["node_ids"] for p in kept] == [ids for _, ids in want]
        assert [p["score"] for p in kept] == pytest.approx([s for s, _ in want], abs=TOL)
    assert [n.node.node_id for n in response.source_nodes] == expected["cited"]
    # Every candidate of every depth, not only the kept ones: a segment that ends in the wrong
    # place changes its own text and finished flag even when it loses.
    tables = [t["candidates"] for t in meta["trace"] if t["step"] == "depth"]
    assert len(tables) == len(expected["candidates"])
    for table, want in zip(tables, expected["candidates"], strict=True):
        got = [(c["node_ids"], c["segment"], c["finished"]) for c in table]
        assert got == [(ids, text, done) for _, ids, text, done in want]
        assert [c["path_score"] for c in table] == pytest.approx([w[0] for w in want], abs=TOL)


def test_the_cases_cover_every_kind_of_stop(models: Any) -> None:
    """The comparison above means something only if the cases meet every way a segment ends:
    [Retrieval], an adaptive [No Retrieval], the end of generation and the token limit, and a
    finished path carried over.
    """
    _, oracle = models
    oracle.written.clear()
    stops: set[str] = set()
    carried = False
    for case in CASES:
        result = run_case(oracle, case)
        carried |= result["depth"] > len(result["segments"])
    for seg in oracle.written:
        kind = seg.stop
        if kind == "boundary" and seg.stop_token == oracle.id["[No Retrieval]"]:
            kind = "no_retrieval"
        stops.add(kind)
    assert {"boundary", "no_retrieval", "eos", "length"} <= stops, stops
    assert carried
