"""Does Self-RAG or RSE make answers better on your data, and at what cost? Measure it.

Per engine, over one question set: judged metrics, evidence recall/precision, latency and model
calls; ``self-rag-rse evaluate`` on a folder of documents, :func:`evaluate` on any index and engines
(usage: ``docs/evaluate.md``). Rooms: names, questions, judges, engines, report, runner; the
command in flags (what runs before llama-index-core loads) and command.

The public names below are imported on first use, as the package's are: the command line reads
its flags from this folder without loading llama-index-core.
"""

# ruff: noqa: F401 - the TYPE_CHECKING imports are the public names, loaded on first use

from typing import TYPE_CHECKING

from llama_index.packs.self_rag_rse.common.lazy import lazy_exports

if TYPE_CHECKING:  # the public names: what type checkers see, and the lazy table
    from llama_index.packs.self_rag_rse.evaluation.engines import default_engines
    from llama_index.packs.self_rag_rse.evaluation.judges import (
        JudgementError,
        RagasMetric,
        make_judge,
    )
    from llama_index.packs.self_rag_rse.evaluation.questions import Question, load_questions
    from llama_index.packs.self_rag_rse.evaluation.report import (
        EvaluationResult,
        Record,
        write_report,
    )
    from llama_index.packs.self_rag_rse.evaluation.runner import aevaluate, evaluate

__getattr__, __dir__, __all__ = lazy_exports(__name__, __file__)
