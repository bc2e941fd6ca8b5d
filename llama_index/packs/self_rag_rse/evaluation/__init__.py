"""Does Self-RAG or RSE make answers better on your data, and at what cost? Measure it.

Run several query engines over one question set and compare, per engine: RAGAS metrics (or
LlamaIndex's evaluators without ``ragas``), evidence recall/precision against gold passages (no
model needed), latency and model calls per question. ``self-rag-rse evaluate`` does it on a
folder of documents; the API works on any index and engines::

    from llama_index.packs.self_rag_rse.evaluation import (
        default_engines, evaluate, make_judge, write_report,
    )

    engines = default_engines(index, llm)  # top-k, +RSE, Self-RAG, +RSE, +corrective loop
    result = evaluate(engines, ["How do descriptors work?"], judge=make_judge(judge_llm, embed))
    write_report(result, "eval-out")  # report.md, report.png, records.json

Bottom-up: :mod:`.questions` and :mod:`.result` (data, evidence scores, the cache),
:mod:`.calls` (instrumentation), :mod:`.judges`, :mod:`.engines` (the index and engines),
:mod:`.runner` (judging through core's ``BatchEvalRunner``), :mod:`.report`, :mod:`.command`.
"""

# ruff: noqa: F401 - the TYPE_CHECKING imports only show the lazy exports to type checkers

from __future__ import annotations

from typing import TYPE_CHECKING

from llama_index.packs.self_rag_rse.common.lazy import lazy_exports

if TYPE_CHECKING:  # what type checkers and IDEs see of the names below
    from llama_index.packs.self_rag_rse.evaluation.engines import default_engines
    from llama_index.packs.self_rag_rse.evaluation.judges import (
        Judge,
        JudgementError,
        LlamaIndexJudge,
        RagasJudge,
        Sample,
        make_judge,
    )
    from llama_index.packs.self_rag_rse.evaluation.questions import Question, load_questions
    from llama_index.packs.self_rag_rse.evaluation.report import write_report
    from llama_index.packs.self_rag_rse.evaluation.result import EvaluationResult, Record
    from llama_index.packs.self_rag_rse.evaluation.runner import aevaluate, evaluate

#: Module -> the public names it defines, each imported on first use (the command line stays quick).
_MODULES = {
    "runner": ("evaluate", "aevaluate"),
    "engines": ("default_engines",),
    "judges": ("make_judge", "Judge", "JudgementError", "LlamaIndexJudge", "RagasJudge", "Sample"),
    "questions": ("Question", "load_questions"),
    "result": ("EvaluationResult", "Record"),
    "report": ("write_report",),
}
_EXPORTS = {name: module for module, names in _MODULES.items() for name in names}

__all__ = sorted(_EXPORTS)

__getattr__, __dir__ = lazy_exports(__name__, _EXPORTS)
