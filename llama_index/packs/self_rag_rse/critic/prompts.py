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

#: Prompt keys (for ``get_prompts``/``update_prompts``) and the variables each must use.
PROMPT_VARIABLES: dict[str, tuple[str, ...]] = {
    "retrieval_prompt": ("query_str",),
    "relevance_prompt": ("query_str", "context_str"),
    "support_prompt": ("context_str", "answer_str"),
    "utility_prompt": ("query_str", "answer_str"),
    "answer_prompt": ("query_str", "context_str"),
    "no_evidence_prompt": ("query_str",),
}
#: The prompted critic's default templates: its four judgements and two answers.
DEFAULT_PROMPTS: dict[str, BasePromptTemplate] = {
    "retrieval_prompt": PromptTemplate(
        "Question: {query_str}\n\n"
        "Do you need to look up facts in documents to answer this question well?\n"
        "Reply with one word: Yes or No."
    ),
    "relevance_prompt": PromptTemplate(
        "Question: {query_str}\n\n"
        "Paragraph:\n{context_str}\n\n"
        "Is this paragraph relevant to the question? Reply with one word: Yes or No."
    ),
    "support_prompt": PromptTemplate(
        "Question: {query_str}\n\n"
        "Paragraph:\n{context_str}\n\n"
        "Answer: {answer_str}\n\n"
        "Does the paragraph support the answer? Reply with one word: Yes, Partly or No."
    ),
    "utility_prompt": PromptTemplate(
        "Question: {query_str}\n\n"
        "Answer: {answer_str}\n\n"
        "How useful is this answer to the question, from 1 (useless) to 5 (complete and helpful)?\n"
        "Reply with one digit: 1, 2, 3, 4 or 5."
    ),
    "answer_prompt": PromptTemplate(
        "Question: {query_str}\n\n"
        "Paragraph:\n{context_str}\n\n"
        "Answer the question using the paragraph, in one or two short sentences."
    ),
    "no_evidence_prompt": PromptTemplate(
        "Question: {query_str}\n\nAnswer the question in one or two short sentences."
    ),
}
VARIABLES = ("query_str", "context_str", "answer_str")

# The corrective loop's prompts (the engine's own; they fill {query_str} only).
ENGINE_PROMPTS: dict[str, BasePromptTemplate] = {
    "query2doc_prompt": PromptTemplate(
        "Write a short encyclopedia-style passage that answers the question below. "
        "Answer with the passage only.\n\nQuestion: {query_str}"
    ),
    "rewrite_prompt": PromptTemplate(
        "Rewrite the question below as a short search query that names its key terms. "
        "Answer with the query only.\n\nQuestion: {query_str}"
    ),
    "grounded_prompt": PromptTemplate(
        "{query_str}\n\nAnswer using only facts stated in the paragraph."
    ),
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
