"""An independent reference implementation ("oracle") of long-form Self-RAG, for tests only.

The package's long-form engine (``llama_index.packs.self_rag_rse``) decodes the continuations of
each depth side by side in batched llama.cpp calls and scores them from tracked log-probs. This
module does the same algorithm the slowest, plainest way, so that the two can be compared token
for token: one ``llama_cpp.Llama`` built with ``logits_all=True``, one sequence at a time
(``reset``, ``eval``, read ``scores``), the full-vocabulary log-softmax in float64 with numpy,
the beam kept in plain lists.

It is written from the algorithm's description and must NOT import or share code with the
package (``llama_index.packs.self_rag_rse``): a bug copied into both would go unnoticed.

The algorithm, in short (see :func:`reference_long_form` for every rule):

* prompt ``### Instruction:\\n{query}\\n\\n### Response:\\n`` (with BOS), each passage as
  ``[Retrieval]<paragraph>{title\\n}{text}</paragraph>``; user text never yields a Self-RAG id;
* an optional adaptive-retrieval gate; without retrieval, the greedy answer after
  ``[No Retrieval]``;
* a segment-level beam search: every unfinished path writes one greedy segment per passage,
  ending at ``[Retrieval]`` (a boundary: the path goes on), optionally at a confident
  ``[No Retrieval]`` (a boundary too), or at end of generation / the token limit (finished);
* segment score ``w_rel·IsREL + w_sup·IsSUP + w_use·IsUSE (+ seq_score)``, path score the mean
  of its segments' scores, stable sort, keep ``beam_width``;
* the answer is the best final path's segments, each followed by its passage's citation.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from typing import Any

import numpy as np

RETRIEVAL = "[Retrieval]"
NO_RETRIEVAL = "[No Retrieval]"
RELEVANT, IRRELEVANT = "[Relevant]", "[Irrelevant]"
GROUNDING = ("[Fully supported]", "[Partially supported]", "[No support / Contradictory]")
UTILITY = tuple(f"[Utility:{i}]" for i in range(1, 6))
UTILITY_WEIGHTS = (-1.0, -0.5, 0.0, 0.5, 1.0)
OPEN, CLOSE = "<paragraph>", "</paragraph>"
#: The 15 Self-RAG special strings (13 reflection tokens and the 2 paragraph markers).
SPECIAL_STRINGS = (
    RETRIEVAL,
    NO_RETRIEVAL,
    "[Continue to Use Evidence]",
    RELEVANT,
    IRRELEVANT,
    *GROUNDING,
    *UTILITY,
    OPEN,
    CLOSE,
)
DEFAULT_TITLE_KEYS = ("title", "document_title")

#: ``retrieve(text)`` returns the passages to use: ``(node_id, paragraph_text)`` pairs, already
#: post-processed and cut to ``ndocs``.
Retrieve = Callable[[str], list[tuple[str, str]]]


def paragraph_text(
    text: str, metadata: dict[str, Any], title_keys: Sequence[str] = DEFAULT_TITLE_KEYS
) -> str:
    """The text a passage is shown as: ``title + "\\n" + text`` when one of ``title_keys``
    (first match wins) holds a non-empty value, else ``text``.
    """
    for key in title_keys:
        title = metadata.get(key)
        if title is not None and str(title).strip():
            return f"{str(title).strip()}\n{text}"
    return text


class _Model:
    """A ``logits_all`` Llama seen as: token ids, user-text tokens and full-vocab log-probs."""

    def __init__(self, llm: Any) -> None:
        import llama_cpp

        self.llm = llm
        self.ids: dict[str, int] = {}
        for text in SPECIAL_STRINGS:
            tokens = llm.tokenize(text.encode(), add_bos=False, special=True)
            assert len(tokens) == 1, f"{text!r} is not one token in this model: {tokens}"
            self.ids[text] = int(tokens[0])
        self.special = set(self.ids.values())
        vocab = llama_cpp.llama_model_get_vocab(llm.model)
        self.eog = {t for t in range(llm.n_vocab()) if llama_cpp.llama_vocab_is_eog(vocab, t)}
        self.eog.add(int(llm.token_eos()))

    def user_tokens(self, text: str, add_bos: bool) -> list[int]:
        """Plain-text tokens, without any id of the 15 special strings."""
        tokens = self.llm.tokenize(text.encode("utf-8"), add_bos=add_bos, special=False)
        return [int(t) for t in tokens if t not in self.special]

    def prompt(self, query: str) -> list[int]:
        return self.user_tokens(f"### Instruction:\n{query}\n\n### Response:\n", add_bos=True)

    def evidence(self, paragraph: str) -> list[int]:
        return [
            self.ids[RETRIEVAL],
            self.ids[OPEN],
            *self.user_tokens(paragraph, add_bos=False),
            self.ids[CLOSE],
        ]

    def generate(
        self, context: list[int], max_new_tokens: int, stop: Callable[[int, np.ndarray], bool]
    ) -> tuple[list[int], list[np.ndarray]]:
        """Greedy tokens after ``context`` (the last one is the one ``stop`` accepted, unless the
        limit came first) and the full-vocab log-prob row that produced each of them.
        """
        llm = self.llm
        llm.reset()
        llm.eval(context)
        tokens: list[int] = []
        rows: list[np.ndarray] = []
        while len(tokens) < max_new_tokens:
            logits = np.asarray(llm.scores[llm.n_tokens - 1], dtype=np.float64)
            top = logits.max()
            row = logits - (top + np.log(np.exp(logits - top).sum()))
            token = int(np.argmax(row))
            tokens.append(token)
            rows.append(row)
            if stop(token, row):
                break
            llm.eval([token])
        return tokens, rows

    def share(self, row: np.ndarray, first: str, group: Sequence[str]) -> float:
        """p(first) / Σ p(group) from a log-prob row; 0.0 when the group has no mass."""
        values = np.array([row[self.ids[t]] for t in group], dtype=np.float64)
        top = values.max()
        if not np.isfinite(top):
            return 0.0
        return float(np.exp(row[self.ids[first]] - top) / np.exp(values - top).sum())

    def gate(self, row: np.ndarray) -> float:
        """p([Retrieval]) / (p([Retrieval]) + p([No Retrieval]))."""
        return self.share(row, RETRIEVAL, (RETRIEVAL, NO_RETRIEVAL))

    def text(self, tokens: Sequence[int]) -> str:
        """Answer text: no special ids, no generated <paragraph>...</paragraph>, no EOG tokens;
        whitespace runs collapsed to one space, stripped.
        """
        kept: list[int] = []
        quoting = False
        for token in tokens:
            if token == self.ids[OPEN]:
                quoting = True
            elif token == self.ids[CLOSE]:
                quoting = False
            elif not quoting and token not in self.special and token not in self.eog:
                kept.append(token)
        return " ".join(self.llm.detokenize(kept).decode("utf-8", errors="ignore").split())


def _segment(
    model: _Model,
    context: list[int],
    node_id: str,
    paragraph: str,
    *,
    max_new_tokens: int,
    boundary_threshold: float | None,
    weights: tuple[float, float, float],
    use_seqscore: bool,
) -> dict[str, Any]:
    """One greedy segment after ``context + E(paragraph)``, scored."""
    ids = model.ids

    def stop(token: int, row: np.ndarray) -> bool:
        if token == ids[RETRIEVAL]:
            return True
        if token == ids[NO_RETRIEVAL] and boundary_threshold is not None:
            return model.gate(row) > boundary_threshold
        return token in model.eog

    generated, rows = model.generate(context + model.evidence(paragraph), max_new_tokens, stop)
    last = generated[-1]
    if stop(last, rows[-1]):
        reason = "eos" if last in model.eog else "boundary"
        tokens = generated[:-1]
    else:
        reason, tokens = "length", generated

    def first_row(group: Sequence[str]) -> np.ndarray | None:
        wanted = {ids[t] for t in group}
        return next((rows[i] for i, t in enumerate(tokens) if t in wanted), None)

    relevance = model.share(rows[0], RELEVANT, (RELEVANT, IRRELEVANT))
    support = 0.0
    if (row := first_row(GROUNDING)) is not None:
        support = model.share(row, GROUNDING[0], GROUNDING) + 0.5 * model.share(
            row, GROUNDING[1], GROUNDING
        )
    utility = 0.0
    if (row := first_row(UTILITY)) is not None:
        utility = sum(
            w * model.share(row, u, UTILITY) for w, u in zip(UTILITY_WEIGHTS, UTILITY, strict=True)
        )
    own = [rows[i][t] for i, t in enumerate(tokens)]
    seq_score = float(np.exp(np.mean(own))) if own else 0.0
    w_rel, w_sup, w_use = weights
    score = w_rel * relevance + w_sup * support + w_use * utility
    if use_seqscore:
        score += seq_score
    return {
        "text": model.text(tokens),
        "node_id": node_id,
        "citation": None,
        "relevance": relevance,
        "support": support,
        "utility": utility,
        "seq_score": seq_score,
        "score": score,
        "tokens": tokens,
        "stop": reason,
    }


def reference_long_form(
    llm: Any,
    query: str,
    retrieve: Retrieve,
    *,
    mode: str = "always_retrieve",
    threshold: float | None = None,
    beam_width: int = 2,
    max_segments: int = 3,
    max_new_tokens: int = 50,
    segment_retrieval: str = "per_segment",
    w_rel: float = 1.0,
    w_sup: float = 1.0,
    w_use: float = 0.5,
    use_seqscore: bool = False,
) -> dict[str, Any]:
    """Long-form Self-RAG, serially, on a ``logits_all=True`` Llama (the tests' oracle).

    ``mode`` is ``"always_retrieve"`` or ``"adaptive_retrieval"``; ``segment_retrieval`` is
    ``"per_segment"`` (depth 1 retrieves for the query, an unfinished path at a later depth for
    ``query + " " + its last segment's text``) or ``"once"`` (the query's passages at every
    depth). In adaptive mode with a ``threshold``, a generated ``[No Retrieval]`` whose gate
    probability exceeds it also ends a segment at a boundary.

    Returns ``{"retrieve", "retrieve_prob", "answer", "segments", "path_score", "depth",
    "beams", "cited_node_ids", "retrieval_queries", "notes"}``: ``segments`` are the answer
    path's segments (dicts with text, node_id, citation, relevance, support, utility, seq_score,
    score, tokens, stop), ``beams[d]`` the kept paths after depth ``d + 1`` as ``{"score",
    "node_ids"}``, ``notes`` why paths finished without passages.
    """
    assert mode in ("always_retrieve", "adaptive_retrieval"), mode
    assert segment_retrieval in ("per_segment", "once"), segment_retrieval
    assert beam_width >= 1 and max_segments >= 1 and max_new_tokens >= 1
    model = _Model(llm)
    prompt = model.prompt(query)
    result: dict[str, Any] = {
        "retrieve": True,
        "retrieve_prob": None,
        "answer": "",
        "segments": [],
        "path_score": 0.0,
        "depth": 0,
        "beams": [],
        "cited_node_ids": [],
        "retrieval_queries": [],
        "notes": [],
    }

    # 1. The gate.
    if mode == "adaptive_retrieval":
        retrieval = model.ids[RETRIEVAL]
        if threshold is None:
            tokens, rows = model.generate(
                prompt, max_new_tokens, lambda t, _: t == retrieval or t in model.eog
            )
            result["retrieve"] = retrieval in tokens
        else:
            _, rows = model.generate(prompt, 1, lambda t, _: True)
        result["retrieve_prob"] = model.gate(rows[0])
        if threshold is not None:
            result["retrieve"] = result["retrieve_prob"] > threshold
        if not result["retrieve"]:
            tokens, _ = model.generate(
                [*prompt, model.ids[NO_RETRIEVAL]], max_new_tokens, lambda t, _: t in model.eog
            )
            result["answer"] = model.text(tokens)
            return result

    # 2. Passages.
    def passages_for(text: str) -> list[tuple[str, str]]:
        result["retrieval_queries"].append(text)
        return list(retrieve(text))

    shared = passages_for(query) if segment_retrieval == "once" else None
    boundary_threshold = threshold if mode == "adaptive_retrieval" else None

    # 3-5. The beam: paths are dicts {context, segments, finished, score}.
    beam = [{"context": prompt, "segments": [], "finished": False, "score": 0.0}]
    for depth in range(1, max_segments + 1):
        if all(path["finished"] for path in beam):
            break
        result["depth"] = depth
        candidates = []
        for index, path in enumerate(beam):
            if path["finished"]:
                candidates.append(path)
                continue
            if shared is not None:
                passages = shared
            elif depth == 1:
                passages = passages_for(query)
            else:
                passages = passages_for(query + " " + path["segments"][-1]["text"])
            if not passages:
                result["notes"].append(f"depth {depth}: path {index} had no passages")
                candidates.append({**path, "finished": True})
                continue
            for node_id, paragraph in passages:
                segment = _segment(
                    model,
                    path["context"],
                    node_id,
                    paragraph,
                    max_new_tokens=max_new_tokens,
                    boundary_threshold=boundary_threshold,
                    weights=(w_rel, w_sup, w_use),
                    use_seqscore=use_seqscore,
                )
                segments = [*path["segments"], segment]
                candidates.append(
                    {
                        "context": path["context"] + segment["tokens"],
                        "segments": segments,
                        "finished": segment["stop"] != "boundary",
                        "score": sum(s["score"] for s in segments) / len(segments),
                    }
                )
        beam = sorted(candidates, key=lambda p: -p["score"])[:beam_width]
        result["beams"].append(
            [{"score": p["score"], "node_ids": [s["node_id"] for s in p["segments"]]} for p in beam]
        )

    # 6. The answer.
    best = beam[0]
    cited: list[str] = []
    pieces = []
    segments = [dict(s) for s in best["segments"]]
    for segment in segments:
        if not segment["text"]:
            continue
        if segment["node_id"] not in cited:
            cited.append(segment["node_id"])
        segment["citation"] = cited.index(segment["node_id"]) + 1
        pieces.append(f"{segment['text']} [{segment['citation']}]")
    result.update(
        answer=" ".join(pieces),
        segments=segments,
        path_score=best["score"],
        cited_node_ids=cited,
    )
    return result
