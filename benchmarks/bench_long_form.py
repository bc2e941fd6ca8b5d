"""Long-form Self-RAG: our batched beam search against a sequential loop and llama.cpp's limit.

The demo's corpus (the shipped Python reference chapters, sectioned, chunked and embedded with
the offline MiniLM into Qdrant local mode, as ``bench_query_limit.py`` builds it) and model
(SmolLM2-135M with the 15 Self-RAG strings appended, as ``bench_critic.py``). SmolLM2 was never
taught to ask for evidence, so ``[Retrieval]`` gets the rows of ``"."`` (scaled by 1.05): greedy
decoding writes ``[Retrieval]`` where SmolLM2 would end a sentence, and each segment is a
sentence, as a Self-RAG model's are. The engine: ``long_form=True``, beam 2, 3 passages
(``similarity_top_k=3``), at most 4 segments of at most ``--max-new-tokens`` tokens,
``segment_retrieval="per_segment"``.

* **ours**: ``engine.query`` with the reflection critic: each depth's ``beam x passages``
  continuations decode side by side in one batched call, shared prompt positions once.
* **sequential**: the same engine with a critic that generates one candidate per call, each
  from an empty KV cache (what the official ``run_long_form_static.py`` does per generation
  call); same tokens, same scores, so the same answer, which the script checks.
* **limit**: llama.cpp alone on the same weights and threads for the same work, as
  ``bench_query_limit.py`` computes it: every distinct prompt position of the query's prompts
  (all depths, as one prefix tree) evaluated once at the raw prefill rate, plus each depth's
  generation steps at the raw step time of their width.

Each engine answers once to warm up, then ``--repeats`` times alternating (min and median
printed; raw rates are the best of their samples). The last stdout line is one JSON object:
``{"sequential_s", "ours_s", "speedup", "limit_s", "ratio"}`` (fastest runs; ``ratio`` =
ours / limit).

Run: ``.venv/bin/python benchmarks/bench_long_form.py`` (a few minutes here).
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import sys
import tempfile
import time
from collections.abc import Sequence
from pathlib import Path
from typing import Any

os.environ.setdefault("HF_HUB_OFFLINE", "1")
os.environ.setdefault("TRANSFORMERS_OFFLINE", "1")
os.environ.setdefault("TOKENIZERS_PARALLELISM", "false")

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT / "tests"))  # tiny_gguf.py
sys.path.insert(0, str(ROOT / "benchmarks"))  # bench_query_limit.py

from bench_query_limit import RawProbe, build_index, limit_seconds  # noqa: E402

QUESTION = "How do the while and for statements differ?"
MODEL = ROOT / "benchmarks" / "out" / "smollm2-135m-self-rag-long-form.gguf"


def model_path() -> Path:
    """SmolLM2 with the Self-RAG tokens, ``[Retrieval]`` where it would write ``"."``."""
    if not MODEL.exists():
        from tiny_gguf import add_self_rag_tokens

        from llama_index.packs.self_rag_rse.llamacpp.chat_format import bundled_gguf

        MODEL.parent.mkdir(parents=True, exist_ok=True)
        tmp = MODEL.with_suffix(".tmp")
        add_self_rag_tokens(bundled_gguf(), tmp, typing="user_defined", boundary_after=".")
        tmp.rename(MODEL)
    return MODEL


def sequential_critic(llm: Any, max_new_tokens: int) -> Any:
    """The reflection critic, generating one candidate per call from an empty KV cache."""
    from llama_index.packs.self_rag_rse.llamacpp.reflection_critic import ReflectionCritic

    class SequentialCritic(ReflectionCritic):
        def _write_segments(self, branches: Any, boundary_threshold: Any) -> Any:
            out = []
            for branch in branches:  # each call opens a conversation: the KV cache starts empty
                out += super()._write_segments([branch], boundary_threshold)
            return out

    return SequentialCritic(llm, max_new_tokens=max_new_tokens, n_seq_max=1)


class Recorder:
    """Every call's requests (prompt, tokens generated), one list per ``Conversation.run``."""

    def __init__(self) -> None:
        self.calls: list[list[tuple[tuple[int, ...], int]]] = []
        from llama_index.packs.self_rag_rse.llamacpp.conversation import Conversation

        real_run = Conversation.run

        def run(conversation: Any, requests: Sequence[Any]) -> Any:
            outputs = real_run(conversation, requests)
            if self.on:
                self.calls.append(
                    [
                        (tuple(r.tokens), len(o.tokens))
                        for r, o in zip(requests, outputs, strict=True)
                    ]
                )
            return outputs

        Conversation.run = run  # type: ignore[method-assign]
        self.on = False


def unavoidable(calls: Sequence[Sequence[tuple[tuple[int, ...], int]]]) -> tuple[int, list[int]]:
    """Distinct prompt positions over all calls, and the width of every generation step (the
    steps of one call side by side; calls one after another)."""
    seen: set[tuple[int, ...]] = set()
    for call in calls:
        for prompt, _ in call:
            for end in range(1, len(prompt) + 1):
                seen.add(prompt[:end])
    widths: list[int] = []
    for call in calls:
        fed = sorted((max(n - 1, 0) for _, n in call), reverse=True)
        widths += [sum(1 for f in fed if f > s) for s in range(fed[0] if fed else 0)]
    return len(seen), widths


def main() -> None:
    parser = argparse.ArgumentParser(description=(__doc__ or "").splitlines()[0])
    parser.add_argument("--question", default=QUESTION)
    parser.add_argument("--repeats", type=int, default=3)
    parser.add_argument("--max-new-tokens", type=int, default=48)
    parser.add_argument("--storage", type=Path, help="Qdrant folder kept between runs")
    args = parser.parse_args()

    import llama_cpp
    import torch

    from llama_index.packs.self_rag_rse import SelfRAGQueryEngine
    from llama_index.packs.self_rag_rse.llamacpp.reflection_critic import ReflectionCritic

    recorder = Recorder()
    with tempfile.TemporaryDirectory() as scratch:
        client, _store, index, built = build_index(args.storage or Path(scratch))
        torch.set_num_threads(1)
        llm = llama_cpp.Llama(str(model_path()), n_ctx=4096, verbose=False)
        options = dict(
            retriever=index.as_retriever(similarity_top_k=3),
            mode="always_retrieve",
            long_form=True,
            beam_width=2,
            max_segments=4,
            max_new_tokens=args.max_new_tokens,
        )
        ours_critic = ReflectionCritic(llm, max_new_tokens=args.max_new_tokens)
        seq_critic = sequential_critic(llm, args.max_new_tokens)
        ours = SelfRAGQueryEngine(critic=ours_critic, **options)
        sequential = SelfRAGQueryEngine(critic=seq_critic, **options)

        recorder.on = True
        answer = ours.query(args.question)
        recorder.on = False
        same = str(sequential.query(args.question)) == str(answer)
        meta = answer.metadata["self_rag"]
        prefill, widths = unavoidable(recorder.calls)
        prompts = sorted({p for call in recorder.calls for p, _ in call}, key=len)
        typical = list(prompts[len(prompts) // 2])
        context = int(statistics.median(len(p) for p in prompts))
        decoder = ours_critic.decoder
        threads = int(getattr(decoder, "n_threads_batch", None) or decoder._n_threads_batch)
        probe = RawProbe(llm, typical, context, widths, threads, bool(decoder.kv_unified))
        times: dict[str, list[float]] = {"ours": [], "sequential": []}
        samples = []
        for _ in range(args.repeats):
            samples.append(probe.sample())
            for name, engine in (("ours", ours), ("sequential", sequential)):
                start = time.perf_counter()
                response = engine.query(args.question)
                times[name].append(time.perf_counter() - start)
                same = same and str(response) == str(answer)
        probe.close()
        ours.close()
        sequential.close()
        ours_critic.close()
        seq_critic.close()
        llm.close()
        client.close()

    rate = max(r for r, _ in samples)
    step_s = {w: min(s[w] for _, s in samples) for w in samples[0][1]}
    limit = limit_seconds(prefill, widths, rate, step_s)
    ours_s, seq_s = min(times["ours"]), min(times["sequential"])
    print(f"index: {built['files']} files, {built['chunks']} chunks; question: {args.question!r}")
    print(
        f"answer ({meta['depth']} depths, {len(meta['segments'])} segments, path score "
        f"{meta['path_score']:.3f}): {str(answer)[:300]!r}"
    )
    print(f"sequential loop gives the same answer: {same}")
    print(f"\n{'':<12}{'min':>8} {'median':>8}   ({args.repeats} repeats)")
    for name, values in times.items():
        print(f"{name:<12}{min(values):8.2f} {statistics.median(values):8.2f} s")
    print(
        f"limit       {limit:8.2f} s   ({prefill} prompt positions at {rate:.0f} tok/s + "
        f"{len(widths)} steps, {sum(len(c) for c in recorder.calls)} continuations in "
        f"{len(recorder.calls)} calls)"
    )
    print(
        f"speedup {seq_s / ours_s:.2f}x (target >= 5); "
        f"ours / limit {ours_s / limit:.2f} (target <= 1.3)"
    )
    print(
        json.dumps(
            {
                "sequential_s": round(seq_s, 3),
                "ours_s": round(ours_s, 3),
                "speedup": round(seq_s / ours_s, 2),
                "limit_s": round(limit, 3),
                "ratio": round(ours_s / limit, 3),
            }
        )
    )


if __name__ == "__main__":
    main()
