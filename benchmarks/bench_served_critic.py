"""Benchmark: the reflection critic served by llama-server vs in process, same model, same run.

Run: ``.venv/bin/python benchmarks/bench_served_critic.py`` (``--help`` for options; needs the
binary from ``make llama-server``).

Model: SmolLM2-135M-Instruct with the 15 Self-RAG strings appended to its vocabulary, the same
GGUF as ``bench_critic.py`` (built once into ``benchmarks/out/``). Paragraphs: ~100-word slices
of the shipped Python reference text. Both critics decode greedily, 50 new tokens at most.

Measured, for k = 5 and 10 paragraphs per query:

* one query: wall time of ``judge`` in process (one batched llama.cpp decode) and served
  (k concurrent ``/completion`` requests plus one ``/tokenize``), requests per query, and the
  largest score difference between the two (the weights are Q4_1, so batch shapes move the
  logits a little; on F32 weights the tests hold them to 1e-3);
* N = 1, 4, 8 queries at once against one server with 8 parallel slots, against the same N
  queries one after another: the slots batch the requests of different queries together.

The server and the in-process model get the same threads. Results go to stdout (a table) and
``benchmarks/out/bench_served_critic.json``.
"""

from __future__ import annotations

import argparse
import asyncio
import json
import os
import signal
import socket
import statistics
import subprocess
import sys
import time
from importlib.metadata import version
from pathlib import Path
from typing import Any

ROOT = Path(__file__).resolve().parents[1]
OUT = ROOT / "benchmarks" / "out"
sys.path.insert(0, str(ROOT / "tests"))
sys.path.insert(0, str(ROOT / "benchmarks"))
sys.path.insert(0, str(ROOT))

QUERIES = [
    "What does the with statement do in Python?",
    "When does the else clause of a while loop run?",
    "How are names resolved in a nested function?",
    "What is a generator expression?",
    "How does the for statement iterate over a sequence?",
    "What happens when an exception is raised in a finally clause?",
    "What does the global statement do?",
    "How are default argument values evaluated?",
]


def server_binary() -> Path:
    given = os.environ.get("SELF_RAG_RSE_LLAMA_SERVER")
    path = (
        Path(given)
        if given
        else Path.home()
        / ".cache"
        / "llama-index-packs-self-rag-rse"
        / "llama-server"
        / version("llama_cpp_python")
        / "llama-server"
    )
    if not path.is_file():
        raise SystemExit(f"no llama-server at {path}: run `make llama-server` first")
    return path


def start_server(model: Path, threads: int, parallel: int, n_ctx: int) -> tuple[Any, str]:
    import httpx

    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        port = sock.getsockname()[1]
    url = f"http://127.0.0.1:{port}"
    log = open(OUT / "bench_served_llama_server.log", "wb")  # noqa: SIM115 - lives with the server
    process = subprocess.Popen(
        [
            str(server_binary()),
            *("-m", str(model), "--host", "127.0.0.1", "--port", str(port)),
            *("-c", str(n_ctx * parallel), "-np", str(parallel)),
            *("-t", str(threads), "-tb", str(threads), "--no-warmup"),
        ],
        stdout=log,
        stderr=subprocess.STDOUT,
    )
    deadline = time.monotonic() + 120
    while time.monotonic() < deadline:
        if process.poll() is not None:
            raise SystemExit(f"llama-server exited: see {log.name}")
        try:
            if httpx.get(f"{url}/health", timeout=2).status_code == 200:
                return process, url
        except httpx.HTTPError:
            pass
        time.sleep(0.2)
    process.terminate()
    raise SystemExit("llama-server did not start in 120 s")


def timed(fn: Any, repeats: int) -> tuple[float, Any]:
    """Median wall time of ``fn()`` over ``repeats`` runs (after one warm-up) and its result."""
    result = fn()
    times = []
    for _ in range(repeats):
        started = time.perf_counter()
        result = fn()
        times.append(time.perf_counter() - started)
    return statistics.median(times), result


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--k", type=int, nargs="+", default=[5, 10])
    parser.add_argument("--concurrency", type=int, nargs="+", default=[1, 4, 8])
    parser.add_argument("--max-new-tokens", type=int, default=50)
    parser.add_argument(
        "--threads", type=int, default=1, help="llama.cpp threads, server and in process alike"
    )
    parser.add_argument("--parallel", type=int, default=8, help="server slots (-np)")
    parser.add_argument("--repeats", type=int, default=3)
    args = parser.parse_args()

    import llama_cpp
    from bench_critic import build_model, paragraphs

    from llama_index.packs.self_rag_rse.common.bridge import run_sync
    from llama_index.packs.self_rag_rse.llamacpp.reflection_critic import ReflectionCritic
    from llama_index.packs.self_rag_rse.served import ServedReflectionCritic

    OUT.mkdir(parents=True, exist_ok=True)
    # A terminated run still stops its server (the finally block below).
    signal.signal(signal.SIGTERM, lambda *_: sys.exit(143))
    model, origin = build_model()
    n_ctx = 2048
    process, url = start_server(model, args.threads, args.parallel, n_ctx)
    llm = llama_cpp.Llama(
        str(model), n_ctx=n_ctx, n_threads=args.threads, n_threads_batch=args.threads, verbose=0
    )
    rows: list[dict[str, Any]] = []
    try:
        for k in args.k:
            texts = paragraphs(k)
            local = ReflectionCritic(llm, max_new_tokens=args.max_new_tokens, n_seq_max=k)
            served = ServedReflectionCritic(
                url, max_new_tokens=args.max_new_tokens, num_workers=args.parallel, timeout=600
            )
            served.connect()
            t_local, expected = timed(lambda: local.judge(QUERIES[0], texts), args.repeats)  # noqa: B023
            before = served.requests
            t_served, got = timed(lambda: served.judge(QUERIES[0], texts), args.repeats)  # noqa: B023
            per_query = (served.requests - before) / (args.repeats + 1)
            diff = max(
                abs(getattr(a, n) - getattr(b, n))
                for a, b in zip(got, expected, strict=True)
                for n in ("relevance", "support", "utility")
            )
            same_answers = sum(a.answer == b.answer for a, b in zip(got, expected, strict=True))
            row: dict[str, Any] = {
                "k": k,
                "in_process_s": t_local,
                "served_s": t_served,
                "requests_per_query": per_query,
                "max_score_diff": diff,
                "same_answers": f"{same_answers}/{k}",
            }
            for n in args.concurrency:
                queries = [QUERIES[i % len(QUERIES)] for i in range(n)]

                async def together(qs: list[str] = queries) -> Any:
                    return await asyncio.gather(*(served.ajudge(q, texts) for q in qs))  # noqa: B023

                started = time.perf_counter()
                for q in queries:
                    served.judge(q, texts)
                serial = time.perf_counter() - started
                started = time.perf_counter()
                run_sync(together())
                concurrent = time.perf_counter() - started
                started = time.perf_counter()
                for q in queries:
                    local.judge(q, texts)
                local_serial = time.perf_counter() - started
                row[f"N={n}"] = {
                    "served_serial_s": serial,
                    "served_concurrent_s": concurrent,
                    "speedup": serial / concurrent,
                    "in_process_serial_s": local_serial,
                }
            rows.append(row)
            print(json.dumps(row), flush=True)
            local.close()
            served.close()
    finally:
        llm.close()
        process.terminate()
        process.wait(timeout=30)

    print(f"model: {model.name} ({origin}); {args.threads} threads; server -np {args.parallel}")
    print("| k | in-process judge | served judge | requests/query | max |score diff| | answers |")
    print("|---|---|---|---|---|---|")
    for r in rows:
        print(
            f"| {r['k']} | {r['in_process_s']:.2f} s | {r['served_s']:.2f} s | "
            f"{r['requests_per_query']:.1f} | {r['max_score_diff']:.2e} | {r['same_answers']} |"
        )
    print("\n| k | N | served, serial | served, N at once | speedup | in process, serial |")
    print("|---|---|---|---|---|---|")
    for r in rows:
        for n in args.concurrency:
            c = r[f"N={n}"]
            print(
                f"| {r['k']} | {n} | {c['served_serial_s']:.2f} s | "
                f"{c['served_concurrent_s']:.2f} s | {c['speedup']:.2f}x | "
                f"{c['in_process_serial_s']:.2f} s |"
            )
    (OUT / "bench_served_critic.json").write_text(
        json.dumps({"model": str(model.name), "args": vars(args), "rows": rows}, indent=2)
    )


if __name__ == "__main__":
    main()
