"""How a critic prompt becomes model text for a llama.cpp model.

The LLM's own formatter when it has one (a ``LlamaCPP`` with custom ``messages_to_prompt`` /
``completion_to_prompt`` formats the critic's prompts the way it formats its own calls), else the
GGUF's ``tokenizer.chat_template``, else plain text followed by ``"\n\nAnswer:"``.
"""

from __future__ import annotations

import logging
from collections.abc import Callable
from typing import TYPE_CHECKING, Any

from llama_index.core.base.llms.types import ChatMessage, MessageRole
from llama_index.core.llms import LLM
from llama_index.core.prompts import BasePromptTemplate

from llama_index.packs.self_rag_rse.llamacpp import compat
from llama_index.packs.self_rag_rse.self_rag.llm_backend import with_system

if TYPE_CHECKING:
    import llama_cpp

logger = logging.getLogger(__name__)

#: Renders one prompt template with its values into the model's prompt text.
Formatter = Callable[[BasePromptTemplate, dict[str, Any]], str]


def chat_formatter(llama: llama_cpp.Llama, owner: Any) -> tuple[Formatter, str]:
    """How a prompt becomes model text: the LLM's own formatter, the GGUF chat template, or plain.

    A ``LlamaCPP`` with custom ``messages_to_prompt``/``completion_to_prompt`` is formatted the way
    it formats its own calls. Otherwise the GGUF's ``tokenizer.chat_template`` is applied (with the
    LLM's ``system_prompt``, if any); a model without one gets the text plus ``"\\n\\nAnswer:"``.
    """
    from llama_index.core.base.llms.generic_utils import messages_to_prompt as generic_m2p
    from llama_index.core.llms.llm import default_completion_to_prompt

    system = getattr(owner, "system_prompt", None) if isinstance(owner, LLM) else None
    if isinstance(owner, LLM):
        m2p = owner.messages_to_prompt
        c2p = owner.completion_to_prompt
        if m2p is not None and m2p is not generic_m2p:

            def with_messages(template: BasePromptTemplate, values: dict[str, Any]) -> str:
                messages = with_system(template.format_messages(**values), system)
                return m2p(messages)

            return with_messages, "messages_to_prompt"
        if c2p is not None and c2p is not default_completion_to_prompt:

            def with_completion(template: BasePromptTemplate, values: dict[str, Any]) -> str:
                return c2p(template.format(**values))

            return with_completion, "completion_to_prompt"

    template_text = (getattr(llama, "metadata", None) or {}).get("tokenizer.chat_template")
    if template_text:
        from llama_cpp.llama_chat_format import Jinja2ChatFormatter

        eos, bos = llama.token_eos(), llama.token_bos()
        formatter = Jinja2ChatFormatter(
            template=template_text,
            eos_token=compat.token_text(llama, eos) if eos >= 0 else "",
            bos_token=compat.token_text(llama, bos) if bos >= 0 else "",
            add_generation_prompt=True,
        )

        def render(messages: list[ChatMessage]) -> str:
            return str(
                formatter(
                    messages=[
                        {"role": m.role.value, "content": m.content or ""}  # type: ignore[misc]
                        for m in messages
                    ]
                ).prompt
            )

        try:
            render(with_system([ChatMessage(role=MessageRole.USER, content="x")], system))
        except Exception as exc:  # e.g. a template that refuses a system message
            if system is None:
                logger.warning("GGUF chat template failed (%s); using plain prompts", exc)
                template_text = None
            else:
                system = None
        if template_text:

            def with_template(template: BasePromptTemplate, values: dict[str, Any]) -> str:
                return render(with_system(template.format_messages(**values), system))

            return with_template, "gguf_chat_template"

    def plain(template: BasePromptTemplate, values: dict[str, Any]) -> str:
        return template.format(**values) + "\n\nAnswer:"

    return plain, "plain"
