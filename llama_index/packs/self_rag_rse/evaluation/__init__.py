"""Does Self-RAG or RSE make answers better on your data, and at what cost? Measure it.

Run several query engines over one question set and compare, per engine: RAGAS metrics through
RAGAS's own LlamaIndex wrappers (LlamaIndex's evaluators when ``ragas`` is not installed),
evidence recall/precision against gold passages (no model needed), latency and model calls per
question. The command ``self-rag-rse evaluate`` does it on a folder of documents; the API works
on any index and engines::

    from llama_index.packs.self_rag_rse.evaluation import default_engines, evaluate, make_judge

    engines = default_engines(index, llm)  # top-k, +RSE, Self-RAG, +RSE, +corrective loop
    result = evaluate(engines, ["How do descriptors work?"], judge=make_judge(judge_llm, embed))
    result.save("eval-out")  # report.md, report.png, records.json

Layers, bottom-up: :mod:`.evidence` and :mod:`.result` (pure), :mod:`.questions`,
:mod:`.contexts`, :mod:`.cache`, :mod:`.calls` (instrumentation), the judges behind
:mod:`.protocol` (:mod:`.ragas_judge`, :mod:`.llamaindex_judge`), :mod:`.engines`,
:mod:`.runner`, :mod:`.report`; :mod:`.models` and :mod:`.command` serve the command line.
"""

from __future__ import annotations

from typing import TYPE_CHECKING

from llama_index.packs.self_rag_rse.common.lazy import lazy_exports

if TYPE_CHECKING:
    from llama_index.packs.self_rag_rse.evaluation.engines import default_engines
    from llama_index.packs.self_rag_rse.evaluation.llamaindex_judge import (
        LlamaIndexJudge,
        make_judge,
    )
    from llama_index.packs.self_rag_rse.evaluation.protocol import Judge, JudgementError, Sample
    from llama_index.packs.self_rag_rse.evaluation.questions import Question, load_questions
    from llama_index.packs.self_rag_rse.evaluation.ragas_judge import RagasJudge
    from llama_index.packs.self_rag_rse.evaluation.result import EvaluationResult, Record
    from llama_index.packs.self_rag_rse.evaluation.runner import aevaluate, evaluate

#: Public name -> module that defines it (imported on first use: the command line stays quick).
_EXPORTS = {
    "default_engines": "engines",
    "LlamaIndexJudge": "llamaindex_judge",
    "make_judge": "llamaindex_judge",
    "Judge": "protocol",
    "JudgementError": "protocol",
    "Sample": "protocol",
    "Question": "questions",
    "load_questions": "questions",
    "RagasJudge": "ragas_judge",
    "EvaluationResult": "result",
    "Record": "result",
    "aevaluate": "runner",
    "evaluate": "runner",
}

__all__ = ["EvaluationResult", "Judge", "JudgementError", "LlamaIndexJudge", "Question", "RagasJudge", "Record", "Sample", "aevaluate", "default_engines", "evaluate", "load_questions", "make_judge"]  # fmt: skip  # noqa: E501


__getattr__, __dir__ = lazy_exports(__name__, _EXPORTS)
