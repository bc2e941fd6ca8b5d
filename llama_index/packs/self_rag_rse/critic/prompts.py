"""Prompt templates: the prompted critic's four judgements and two answers, and the
corrective loop's rewrites.

Each template fills some of ``{query_str}`` (the question), ``{context_str}`` (the paragraph)
and ``{answer_str}`` (an answer). They are exposed through ``get_prompts()`` /
``update_prompts()`` of the critic and the engine, like any LlamaIndex module's prompts; a
replacement must use the variables the critic fills (:data:`PROMPT_VARIABLES`) and keep the
reply words the scores read (Yes/No, Yes/Partly/No, 1-5).
"""

from __future__ import annotations

from llama_index.core.prompts import BasePromptTemplate, PromptTemplate

DEFAULT_RETRIEVAL_PROMPT = PromptTemplate(
    "Question: {query_str}\n\n"
    "Do you need to look up facts in documents to answer this question well?\n"
    "Reply with one word: Yes or No."
)
DEFAULT_RELEVANCE_PROMPT = PromptTemplate(
    "Question: {query_str}\n\n"
    "Paragraph:\n{context_str}\n\n"
    "Is this paragraph relevant to the question? Reply with one word: Yes or No."
)
DEFAULT_SUPPORT_PROMPT = PromptTemplate(
    "Question: {query_str}\n\n"
    "Paragraph:\n{context_str}\n\n"
    "Answer: {answer_str}\n\n"
    "Does the paragraph support the answer? Reply with one word: Yes, Partly or No."
)
DEFAULT_UTILITY_PROMPT = PromptTemplate(
    "Question: {query_str}\n\n"
    "Answer: {answer_str}\n\n"
    "How useful is this answer to the question, from 1 (useless) to 5 (complete and helpful)?\n"
    "Reply with one digit: 1, 2, 3, 4 or 5."
)
DEFAULT_ANSWER_PROMPT = PromptTemplate(
    "Question: {query_str}\n\n"
    "Paragraph:\n{context_str}\n\n"
    "Answer the question using the paragraph, in one or two short sentences."
)
DEFAULT_NO_EVIDENCE_PROMPT = PromptTemplate(
    "Question: {query_str}\n\nAnswer the question in one or two short sentences."
)

#: Prompt keys (for ``get_prompts``/``update_prompts``) and the variables each must use.
PROMPT_VARIABLES: dict[str, tuple[str, ...]] = {
    "retrieval_prompt": ("query_str",),
    "relevance_prompt": ("query_str", "context_str"),
    "support_prompt": ("context_str", "answer_str"),
    "utility_prompt": ("query_str", "answer_str"),
    "answer_prompt": ("query_str", "context_str"),
    "no_evidence_prompt": ("query_str",),
}
DEFAULT_PROMPTS: dict[str, BasePromptTemplate] = {
    "retrieval_prompt": DEFAULT_RETRIEVAL_PROMPT,
    "relevance_prompt": DEFAULT_RELEVANCE_PROMPT,
    "support_prompt": DEFAULT_SUPPORT_PROMPT,
    "utility_prompt": DEFAULT_UTILITY_PROMPT,
    "answer_prompt": DEFAULT_ANSWER_PROMPT,
    "no_evidence_prompt": DEFAULT_NO_EVIDENCE_PROMPT,
}
VARIABLES = ("query_str", "context_str", "answer_str")

# The corrective loop's prompts (the engine's own; they fill {query_str} only).
DEFAULT_QUERY2DOC_PROMPT = PromptTemplate(
    "Write a short encyclopedia-style passage that answers the question below. "
    "Answer with the passage only.\n\nQuestion: {query_str}"
)
DEFAULT_REWRITE_PROMPT = PromptTemplate(
    "Rewrite the question below as a short search query that names its key terms. "
    "Answer with the query only.\n\nQuestion: {query_str}"
)
DEFAULT_GROUNDED_PROMPT = PromptTemplate(
    "{query_str}\n\nAnswer using only facts stated in the paragraph."
)
ENGINE_PROMPTS: dict[str, BasePromptTemplate] = {
    "query2doc_prompt": DEFAULT_QUERY2DOC_PROMPT,
    "rewrite_prompt": DEFAULT_REWRITE_PROMPT,
    "grounded_prompt": DEFAULT_GROUNDED_PROMPT,
}
ENGINE_PROMPT_VARIABLES: dict[str, tuple[str, ...]] = {
    key: ("query_str",) for key in ENGINE_PROMPTS
}


def as_template(
    prompt: BasePromptTemplate | str, key: str, variables: dict[str, tuple[str, ...]] | None = None
) -> BasePromptTemplate:
    """``prompt`` as a template, checked to use every variable the caller fills for ``key``."""
    template = PromptTemplate(prompt) if isinstance(prompt, str) else prompt
    mappings = template.template_var_mappings or {}
    provided = set(template.template_vars) | set((template.function_mappings or {}).keys())
    needed = (variables or PROMPT_VARIABLES)[key]
    if missing := [v for v in needed if mappings.get(v, v) not in provided]:
        raise ValueError(
            f"{key} must use {', '.join('{' + v + '}' for v in missing)}: the critic fills "
            f"{', '.join(needed)} (query, paragraph text, answer)"
        )
    return template
