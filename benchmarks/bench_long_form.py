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
* **limit**: llama.cpp alone on the same weights and threads for the same work, priced as
  ``bench_query_limit.py`` prices it (see its docstring)::

      limit_s = sum over distinct prompt positions p of prompt_s(p)
              + sum over generation steps s of step_s(width_s, depth_s)

  The distinct positions are those of every depth's prompts as one prefix tree (a path's
  context, asked again by the next depth with a new passage, counts once), each priced at
  the depth it sits at: ``prompt_s(p)`` is the per-token time of one ``llama_decode`` of 128
  prompt tokens on top of the positions before them, measured for positions 0-127,
  128-255, ... and interpolated between the bands' middles. Each depth's continuations are
  generated side by side, one depth after the other: step ``s`` of a depth feeds back token
  ``s`` of every continuation longer than ``s + 1`` tokens, ``width_s`` of them, at
  positions ``len(prompt) + s`` (the deepest ``depth_s``); ``step_s(w, d)`` is the time of one
  ``llama_decode`` of ``w`` sequences one token each, ``d`` positions deep, measured for
  every width used at the shallowest, middle and deepest step and interpolated linearly.

Each engine answers once to warm up, then ``--repeats`` times alternating with one raw sample
before each round (min and median printed; the limit prices with every raw cost's best sample,
the paired ratio divides each of our runs by the limit priced with the sample just before it).
The last stdout line is one JSON object: ``{"sequential_s", "speedup", "ours_s", "limit_s",
"ratio", "paired_ratio"}`` (fastest runs; ``ratio`` = ours / limit; no sequential figures
with ``--no-sequential``).

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

from bench_query_limit import (  # noqa: E402
    Costs,
    RawProbe,
    build_index,
    print_costs,
    print_limit,
    step_depths,
    unavoidable,
)

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
        def _run_segments(self, requests: Any) -> Any:
            out = []
            for request in requests:  # a conversation each: the KV cache starts empty
                with self.decoder.conversation() as conversation:
                    out += conversation.run([request])
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


def main() -> None:
    parser = argparse.ArgumentParser(description=(__doc__ or "").splitlines()[0])
    parser.add_argument("--question", default=QUESTION)
    parser.add_argument("--repeats", type=int, default=3)
    parser.add_argument("--max-new-tokens", type=int, default=48)
    parser.add_argument("--storage", type=Path, help="Qdrant folder kept between runs")
    parser.add_argument(
        "--no-sequential", action="store_true", help="time our engine only (no speedup printed)"
    )
    args = parser.parse_args()

    import llama_cpp
    import torch

    from llama_index.packs.self_rag_rse import SelfRAGQueryEngine
    from llama_index.packs.self_rag_rse.llamacpp.reflection_critic import ReflectionCritic

    recorder = Recorder()
    load = os.getloadavg()[0]
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
        ours_critic.decoder.stats.reset()
        answer = ours.query(args.question)
        recorder.on = False
        stats = ours_critic.decoder.stats
        evaluated = stats.prompt_tokens + stats.fed_tokens
        same = args.no_sequential or str(sequential.query(args.question)) == str(answer)
        meta = answer.metadata["self_rag"]
        positions, steps, generated = unavoidable(recorder.calls)
        at_mean = unavoidable(recorder.calls, statistics.fmean)[1]
        prompts = sorted({p for call in recorder.calls for p, _ in call}, key=len)
        decoder = ours_critic.decoder
        probe = RawProbe(
            llm, list(prompts[-1]), positions[-1], [w for w, _ in steps],
            step_depths(steps) + step_depths(at_mean), decoder.n_threads,
            bool(decoder.kv_unified),
        )  # fmt: skip
        engines = [("ours", ours)] + ([] if args.no_sequential else [("sequential", sequential)])
        times: dict[str, list[float]] = {name: [] for name, _ in engines}
        samples: list[Costs] = []
        paired: list[float] = []
        for _ in range(args.repeats):
            samples.append(probe.sample())
            for name, engine in engines:
                start = time.perf_counter()
                response = engine.query(args.question)
                times[name].append(time.perf_counter() - start)
                same = same and str(response) == str(answer)
            paired.append(times["ours"][-1] / samples[-1].limit(positions, steps))
        samples.append(probe.sample())
        probe.close()
        ours.close()
        sequential.close()
        ours_critic.close()
        seq_critic.close()
        llm.close()
        client.close()

    costs = Costs.best(samples)
    limit = costs.limit(positions, steps)
    ours_s = min(times["ours"])
    print(
        f"index: {built['files']} files, {built['chunks']} chunks; question: {args.question!r}; "
        f"llama.cpp threads {decoder.n_threads}, "
        f"KV {'unified' if decoder.kv_unified else 'split'}; "
        f"load average {load:.2f} before, {os.getloadavg()[0]:.2f} after"
    )
    print(
        f"answer ({meta['depth']} depths, {len(meta['segments'])} segments, path score "
        f"{meta['path_score']:.3f}): {str(answer)[:300]!r}"
    )
    if not args.no_sequential:
        print(f"sequential loop gives the same answer: {same}")
    print(
        f"{sum(len(c) for c in recorder.calls)} continuations in {len(recorder.calls)} calls; "
        f"llama.cpp evaluated {evaluated} tokens (prompts and fed-back segments)"
    )
    print_costs(costs, len(samples))
    print_limit(costs, positions, steps, generated, at_mean, ours_s)
    print(f"\n{'':<12}{'min':>8} {'median':>8}   ({args.repeats} repeats)")
    for name, values in times.items():
        print(f"{name:<12}{min(values):8.2f} {statistics.median(values):8.2f} s")
    print(f"limit       {limit:8.2f} s")
    result: dict[str, Any] = {}
    if "sequential" in times:
        seq_s = min(times["sequential"])
        print(f"speedup {seq_s / ours_s:.2f}x")
        result = {"sequential_s": round(seq_s, 3), "speedup": round(seq_s / ours_s, 2)}
    print(
        f"ours / limit {ours_s / limit:.2f} (fastest / best raw costs); "
        f"{statistics.median(paired):.2f} (median of each run / the raw sample just before it); "
        "target <= 1.15"
    )
    result |= {
        "ours_s": round(ours_s, 3),
        "limit_s": round(limit, 3),
        "ratio": round(ours_s / limit, 3),
        "paired_ratio": round(statistics.median(paired), 3),
    }
    print(json.dumps(result))


if __name__ == "__main__":
    main()
