"""The names an evaluation speaks: its engines and metrics, and what each built-in metric needs.

Plain data with no LlamaIndex import, so the command line checks ``--engines`` and ``--metrics``
(and prints ``--help``) before llama-index-core loads.
"""

#: Engine names in report order, with what each one is.
ENGINE_DESCRIPTIONS = {
    "top-k": "RetrieverQueryEngine, top-k chunks",
    "top-k+rse": "RetrieverQueryEngine + RelevantSegmentPostprocessor",
    "self-rag": "SelfRAGQueryEngine on top-k chunks",
    "self-rag+rse": "SelfRAGQueryEngine on RSE segments",
    "self-rag+corrective": "SelfRAGQueryEngine on top-k chunks, corrective loop",
}
ENGINE_NAMES = tuple(ENGINE_DESCRIPTIONS)

#: What a built-in metric needs of an answer, in report order (other metrics apply always):
#: retrieved contexts, a reference answer, or no reference answer.
CONTEXTS = "contexts"
REFERENCE = "reference"
NO_REFERENCE = "no reference"
RAGAS_METRICS = {
    "faithfulness": {CONTEXTS},
    "answer_relevancy": set(),
    "context_precision": {CONTEXTS, REFERENCE},
    "context_utilization": {CONTEXTS, NO_REFERENCE},
    "context_recall": {CONTEXTS, REFERENCE},
}
LLAMAINDEX_METRICS = {
    "li_faithfulness": {CONTEXTS},
    "li_relevancy": {CONTEXTS},
    "li_answer_relevancy": set(),
    "li_context_relevancy": {CONTEXTS},
    "li_correctness": {REFERENCE},
    "li_semantic_similarity": {REFERENCE},
}
#: Metrics computed from the retrieved text and the gold evidence, without any model.
EVIDENCE_METRICS = ("evidence_recall", "evidence_precision")

#: The command's fixed figures and names, shared by the flags and the run.
CACHE_FILE = "cache.jsonl"
#: A judge's reply length: room for RAGAS's JSON lists.
JUDGE_TOKENS = 512
#: The bundled judge's reply length: its long replies are unusable anyway, and cost minutes.
BUNDLED_JUDGE_TOKENS = 128
#: --rse-overall-max-length when neither it nor --rse-context-chars is given.
RSE_CHUNKS = 12
BUNDLED = "bundled"
#: The forms --llm and --judge take.
MODEL_FORMS = "bundled, PATH.gguf or URL[#MODEL]"
