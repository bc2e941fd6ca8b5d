"""Does Self-RAG or RSE make answers better on your data, and at what cost? Measure it.

Per engine, over one question set: judged metrics, evidence recall/precision, latency and model
calls; ``self-rag-rse evaluate`` on a folder of documents, :func:`evaluate` on any index and engines
(usage: ``docs/evaluate.md``). Rooms: questions, judges, engines, report, runner, command.
"""

from llama_index.packs.self_rag_rse.evaluation.engines import default_engines
from llama_index.packs.self_rag_rse.evaluation.judges import JudgementError, RagasMetric, make_judge
from llama_index.packs.self_rag_rse.evaluation.questions import Question, load_questions
from llama_index.packs.self_rag_rse.evaluation.report import EvaluationResult, Record, write_report
from llama_index.packs.self_rag_rse.evaluation.runner import aevaluate, evaluate

__all__ = ["EvaluationResult", "JudgementError", "Question", "RagasMetric", "Record", "aevaluate"]
__all__ += ["default_engines", "evaluate", "load_questions", "make_judge", "write_report"]
