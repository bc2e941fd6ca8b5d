"""Benchmark: the cost per token of streaming an in-process llama.cpp answer's text.

Run: ``.venv/bin/python benchmarks/bench_streaming.py`` (``--help`` for options).

A streamed answer is sent as it grows. Reading its text by detokenizing the whole answer after
every token (and comparing it with what was sent) costs a step in proportion to the answer so
far: quadratic in all. :class:`~llama_index.packs.self_rag_rse.llamacpp.worker.TextStream`
detokenizes each token once and holds back only an unfinished UTF-8 character and trailing
whitespace, so a step's cost stays flat. Both are timed here on the same token ids (the bundled
SmolLM2-135M tokenizer, else the tests' tiny GGUF) for answers of 50 and 1,000 tokens of mixed
ASCII, Greek and CJK text; the model itself is not run, only its tokenizer (``vocab_only``).
"""

from __future__ import annotations

import argparse
import sys
import tempfile
import time
from collections.abc import Callable, Sequence
from pathlib import Path
from typing import Any

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT / "tests"))  # tiny_gguf.py: the model builders shared with tests

TEXT = (
    "The while statement repeats a suite as long as an expression is true. "
    "Η πρόταση while επαναλαμβάνει ένα μπλοκ όσο μια έκφραση είναι αληθής. "
    "while 文は、式が真である限り処理を繰り返します。 "
)


def tokenizer(folder: Path) -> tuple[Any, str]:
    """A vocab-only Llama and which tokenizer it is."""
    import llama_cpp

    try:
        from llama_index.packs.self_rag_rse.llamacpp.chat_format import bundled_gguf

        path, name = bundled_gguf(), "SmolLM2-135M (bundled)"
        if not path.exists():
            raise FileNotFoundError(path)
    except Exception:  # the demo extra is missing: the tests' tiny GGUF has a tokenizer too
        from tiny_gguf import write_tiny_gguf

        path, name = write_tiny_gguf(folder / "tiny.gguf"), "tiny test GGUF"
    return llama_cpp.Llama(str(path), vocab_only=True, verbose=False), name


def whole_answer_each_step(llama: Any, tokens: Sequence[int]) -> str:
    """The old way: detokenize the whole answer after every token, send what grew."""
    sent = ""
    for i in range(1, len(tokens) + 1):
        text = llama.detokenize(list(tokens[:i])).decode("utf-8", errors="ignore").strip()
        if len(text) > len(sent) and text.startswith(sent):
            sent = text
    return sent


def incremental(llama: Any, tokens: Sequence[int]) -> str:
    """:class:`TextStream`: each token detokenized once."""
    from llama_index.packs.self_rag_rse.llamacpp.worker import TextStream

    stream = TextStream(llama, keep=lambda token: True)
    return "".join(stream.feed(token) for token in tokens)


def per_token_us(run: Callable[[Any, Sequence[int]], str], llama: Any, tokens: list[int]) -> float:
    """Best of 5 runs, in microseconds per token."""
    best = float("inf")
    for _ in range(5):
        began = time.perf_counter()
        run(llama, tokens)
        best = min(best, time.perf_counter() - began)
    return best / len(tokens) * 1e6


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--lengths", type=int, nargs="+", default=[50, 1000])
    args = parser.parse_args()
    with tempfile.TemporaryDirectory() as folder:
        llama, name = tokenizer(Path(folder))
        longest = max(args.lengths)
        tokens: list[int] = []
        while len(tokens) < longest:
            tokens += llama.tokenize(TEXT.encode(), add_bos=False, special=False)
        print(f"tokenizer: {name}\n")
        print("| answer tokens | whole answer each step (µs/token) | TextStream (µs/token) |")
        print("|---:|---:|---:|")
        for n in args.lengths:
            answer = tokens[:n]
            expected = llama.detokenize(answer).decode("utf-8", errors="ignore").strip()
            assert incremental(llama, answer) == expected  # the same text, only cheaper
            old = per_token_us(whole_answer_each_step, llama, answer)
            new = per_token_us(incremental, llama, answer)
            print(f"| {n:,} | {old:,.1f} | {new:,.1f} |")
        llama.close()


if __name__ == "__main__":
    main()
