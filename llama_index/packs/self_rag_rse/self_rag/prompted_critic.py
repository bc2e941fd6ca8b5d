"""The prompted critic: Self-RAG's judgements asked of an ordinary LLM, one question at a time.

Models without reflection tokens are asked four short questions instead, each written for small
instruct models and answered with one label word:

* the gate: does the question need documents? (Yes / No)
* IsREL: is the paragraph relevant to the question? (Yes / No)
* IsSUP: does the paragraph support the answer? (Yes / Partly / No)
* IsUSE: how useful is the answer, 1 to 5?

The replies are turned into scores on the reflection critic's scales, so both critics rank alike:
relevance and support in [0, 1] (support = p(Yes) + 0.5·p(Partly)), utility in [-1, 1] (weights
-1, -0.5, 0, 0.5, 1 over 1..5), gate probability p(Yes) / (p(Yes) + p(No)).

How the label probabilities are read depends on the backend:

* **llama.cpp** (``LlamaCPP`` or a raw ``llama_cpp.Llama``): the exact next-token log-probs of the
  label words' first tokens, read from one multi-sequence decode over all paragraphs
  (:class:`~.llama_cpp_decoding.BatchedDecoder`); the answers are generated in one batched decode
  too, the same one as relevance when both prompts read the same tokens up to the end of the
  paragraph (the defaults do), so each paragraph is evaluated once for both. Scores are
  expectations under those probabilities, like the paper's.
* **any other LlamaIndex LLM**: one call per paragraph and question, run concurrently (bounded by
  ``num_workers``). When the response carries log-probs (``ChatResponse.logprobs``, e.g. OpenAI
  with ``logprobs=True, top_logprobs=5``) the label probabilities come from them; otherwise the
  reply is parsed tolerantly (JSON, code fences, prose, any case, numbers in words) and a reply
  that cannot be read falls back to a neutral score (:data:`FALLBACK_NOTE`).

Every :class:`~.critic.ParagraphJudgement` records in ``details`` how each score was obtained
(``"logprobs"``, ``"parsed"`` or ``"fallback"``). The reply parsing and label scoring functions at
the top of this module are plain Python and can be used on their own.
"""

from __future__ import annotations

import asyncio
import concurrent.futures
import contextvars
import logging
import re
import threading
import warnings
from collections.abc import Callable, Coroutine, Mapping, Sequence
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any, TypeVar

from llama_index.core.async_utils import run_jobs
from llama_index.core.base.llms.types import ChatMessage, MessageRole
from llama_index.core.instrumentation import get_dispatcher
from llama_index.core.llms import LLM
from llama_index.core.prompts import BasePromptTemplate, PromptTemplate
from llama_index.core.prompts.mixin import PromptDictType, PromptMixin, PromptMixinType

from llama_index.packs.self_rag_rse.self_rag.contract import ParagraphJudgement, RetrievalDecision
from llama_index.packs.self_rag_rse.self_rag.labels import (
    RELEVANCE_SCALE,
    RETRIEVAL_SCALE,
    SUPPORT_SCALE,
    UTILITY_SCALE,
    LabelScale,
    Reading,
    label_logprobs_from_top,
    logsumexp,
    parse_reply,
)
from llama_index.packs.self_rag_rse.llamacpp.compat import llama_of
from llama_index.packs.self_rag_rse.self_rag.reflection import sequence_score

if TYPE_CHECKING:
    import llama_cpp

    from llama_index.packs.self_rag_rse.llamacpp.decoder import BatchedDecoder, SequenceOutput

logger = logging.getLogger(__name__)
dispatcher = get_dispatcher(__name__)

T = TypeVar("T")

# ================================================================================================
# Prompts
# ================================================================================================

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
_DEFAULT_PROMPTS: dict[str, BasePromptTemplate] = {
    "retrieval_prompt": DEFAULT_RETRIEVAL_PROMPT,
    "relevance_prompt": DEFAULT_RELEVANCE_PROMPT,
    "support_prompt": DEFAULT_SUPPORT_PROMPT,
    "utility_prompt": DEFAULT_UTILITY_PROMPT,
    "answer_prompt": DEFAULT_ANSWER_PROMPT,
    "no_evidence_prompt": DEFAULT_NO_EVIDENCE_PROMPT,
}
_VARIABLES = ("query_str", "context_str", "answer_str")
#: llama.cpp's LLAMA_TOKEN_ATTR_CONTROL (kept here so the module imports without llama_cpp).
_TOKEN_ATTR_CONTROL = 8
_MARK_OPEN, _MARK_CLOSE = "\ue000", "\ue001"
_MARKER = re.compile(f"{_MARK_OPEN}(query_str|context_str|answer_str){_MARK_CLOSE}")


def _as_template(prompt: BasePromptTemplate | str, key: str) -> BasePromptTemplate:
    template = PromptTemplate(prompt) if isinstance(prompt, str) else prompt
    mappings = template.template_var_mappings or {}
    provided = set(template.template_vars) | set((template.function_mappings or {}).keys())
    missing = [v for v in PROMPT_VARIABLES[key] if mappings.get(v, v) not in provided]
    if missing:
        raise ValueError(
            f"{key} must use {', '.join('{' + v + '}' for v in missing)}: the critic fills "
            f"{', '.join(PROMPT_VARIABLES[key])} (query, paragraph text, answer)"
        )
    return template


# ================================================================================================
# Backends
# ================================================================================================


@dataclass
class _Scored:
    """One label judgement of one sequence."""

    score: float
    method: str
    note: str | None = None
    generated_tokens: int | None = None


@dataclass
class _Generated:
    """One generated answer."""

    text: str
    seq_score: float | None = None
    generated_tokens: int | None = None


@dataclass
class _Plan:
    """Jobs for ``run_jobs`` and how to turn their results into one item per sequence."""

    jobs: list[Coroutine[Any, Any, Any]]
    collect: Callable[[list[Any]], list[Any]]


def _fallback(scale: LabelScale, reading: Reading, tokens: int | None) -> _Scored:
    if reading.score is not None:
        return _Scored(reading.score, reading.method, reading.note, tokens)
    return _Scored(scale.fallback, "fallback", reading.note or "unreadable reply", tokens)


class _LlamaCppBackend:
    """Batched label probabilities and answers on llama.cpp, with the model's chat template."""

    def __init__(
        self,
        llama: llama_cpp.Llama,
        owner: Any,
        *,
        max_new_tokens: int,
        n_seq_max: int,
        n_ctx: int | None,
        n_threads: int | None,
    ) -> None:
        from llama_index.packs.self_rag_rse.llamacpp.decoder import BatchedDecoder

        self.llama = llama
        self.max_new_tokens = max_new_tokens
        self.decoder: BatchedDecoder = BatchedDecoder(
            llama,
            n_seq_max=n_seq_max,
            n_ctx=n_ctx,
            n_batch=max(512, n_seq_max),
            n_threads=n_threads,
        )
        self._format, self.prompt_format = _chat_formatter(llama, owner)
        self._bos = int(llama.token_bos())
        self._add_bos = bool(llama._model.add_bos_token()) and self._bos >= 0
        self._label_ids: dict[str, list[list[int]]] = {}
        self._skeletons: dict[int, tuple[BasePromptTemplate, list[tuple[str, str]]]] = {}
        self._control_runs: dict[str, list[str | int]] = {}

    # --- prompts to tokens ---------------------------------------------------------------------

    def _skeleton(self, template: BasePromptTemplate) -> list[tuple[str, str]]:
        """The formatted prompt as ``(variable, "")`` slots between template text pieces."""
        cached = self._skeletons.get(id(template))
        if cached is not None and cached[0] is template:
            return cached[1]
        marked = {name: f"{_MARK_OPEN}{name}{_MARK_CLOSE}" for name in _VARIABLES}
        full = self._format(template, marked)
        pieces: list[tuple[str, str]] = []
        last = 0
        for match in _MARKER.finditer(full):
            pieces.append(("", full[last : match.start()]))
            pieces.append((match.group(1), ""))
            last = match.end()
        pieces.append(("", full[last:]))
        self._skeletons[id(template)] = (template, pieces)
        return pieces

    def _controls(self, text: str) -> list[str | int]:
        """Template text split into plain strings and the ids of the control tokens it spells."""
        cached = self._control_runs.get(text)
        if cached is not None:
            return cached
        model = self.llama._model
        ids = self.llama.tokenize(text.encode("utf-8"), add_bos=False, special=True)
        controls = {
            model.token_get_text(t): int(t)
            for t in ids
            if model.token_get_attr(t) & _TOKEN_ATTR_CONTROL
        }
        runs: list[str | int] = []
        if controls:
            pattern = "|".join(re.escape(c) for c in sorted(controls, key=len, reverse=True))
            last = 0
            for match in re.finditer(pattern, text):
                runs.append(text[last : match.start()])
                runs.append(controls[match.group(0)])
                last = match.end()
            runs.append(text[last:])
        else:
            runs.append(text)
        self._control_runs[text] = runs
        return runs

    def tokens(self, template: BasePromptTemplate, values: Mapping[str, str]) -> list[int]:
        """Token ids of one prompt, as llama.cpp would tokenize the whole text with special=True.

        Only control tokens the *template* spells (chat markup such as ``<|im_start|>``) become
        control ids; the query, paragraph and answer are tokenized as plain text together with
        the template text around them (so word boundaries match whole-string tokenization), which
        keeps a document from injecting chat markup.
        """
        out: list[int] = []
        text: list[str] = []

        def flush() -> None:
            run = "".join(text)
            text.clear()
            if run:
                out.extend(self.llama.tokenize(run.encode("utf-8"), add_bos=False, special=False))

        for kind, piece in self._skeleton(template):
            if kind:
                text.append(values.get(kind, ""))
                continue
            for run in self._controls(piece):
                if isinstance(run, int):
                    flush()
                    out.append(run)
                else:
                    text.append(run)
        flush()
        if self._add_bos and (not out or out[0] != self._bos):
            out.insert(0, self._bos)
        return out

    def _fitted(
        self, template: BasePromptTemplate, values: dict[str, Any], max_new: int
    ) -> list[int]:
        """Prompt tokens, the paragraph shortened (from its end) until prompt + answer fit."""
        tokens = self.tokens(template, values)
        limit = self.decoder.n_ctx - max_new
        paragraph = values.get("context_str")
        if len(tokens) <= limit or not paragraph:
            if len(tokens) > limit:
                raise ValueError(
                    f"prompt has {len(tokens)} tokens, {max_new} more to generate, but n_ctx is "
                    f"{self.decoder.n_ctx}: shorten the query or raise n_ctx"
                )
            return tokens
        own = self.llama.tokenize(paragraph.encode("utf-8"), add_bos=False, special=False)
        keep = len(own) - (len(tokens) - limit)
        for margin in (0, 4, 16, 64):
            cut = self.llama.detokenize(own[: max(keep - margin, 0)]).decode("utf-8", "ignore")
            tokens = self.tokens(template, {**values, "context_str": cut})
            if len(tokens) <= limit:
                message = (
                    f"paragraph truncated from {len(own)} to about {max(keep - margin, 0)} tokens "
                    f"to fit n_ctx={self.decoder.n_ctx}: raise n_ctx or send shorter paragraphs"
                )
                logger.warning(message)
                warnings.warn(message, stacklevel=5)
                return tokens
        raise ValueError(
            f"prompt does not fit n_ctx={self.decoder.n_ctx} even without the paragraph: "
            "shorten the query or raise n_ctx"
        )

    def label_ids(self, scale: LabelScale) -> list[list[int]]:
        """First-token ids of each label's spellings ("Yes", " Yes", "yes", " yes").

        An id shared by two labels, or one that decodes to whitespace, tells nothing and is
        dropped.
        """
        cached = self._label_ids.get(scale.name)
        if cached is not None:
            return cached
        groups: list[set[int]] = []
        for label in scale.labels:
            ids: set[int] = set()
            for spelling in {label, " " + label, label.lower(), " " + label.lower()}:
                tokens = self.llama.tokenize(spelling.encode("utf-8"), add_bos=False, special=False)
                if not tokens:
                    continue
                piece = self.llama.detokenize([tokens[0]]).decode("utf-8", "ignore").strip()
                if piece and spelling.strip().lower().startswith(piece.lower()):
                    ids.add(int(tokens[0]))
            groups.append(ids)
        shared = {t for i, g in enumerate(groups) for t in g for h in groups[i + 1 :] if t in h}
        result = [sorted(g - shared) for g in groups]
        empty = [label for label, ids in zip(scale.labels, result, strict=True) if not ids]
        if empty:
            raise ValueError(
                f"the {scale.name} labels {list(scale.labels)} do not start with distinct tokens "
                f"for this model ({', '.join(empty)} has none of its own)"
            )
        self._label_ids[scale.name] = result
        return result

    # --- judgements ----------------------------------------------------------------------------

    def score(
        self,
        scale: LabelScale,
        template: BasePromptTemplate,
        query: str,
        paragraphs: Sequence[str | None],
        answers: Sequence[str | None],
    ) -> list[_Scored | Exception]:
        """Label probabilities of every sequence from one multi-sequence decode (1 new token)."""
        groups = self.label_ids(scale)
        prompts = self._prompts(template, query, paragraphs, answers, 1)
        outputs = self._decode(prompts, 1, [t for g in groups for t in g])
        return [self._scored(out, scale, groups) for out in outputs]

    def generate(
        self,
        template: BasePromptTemplate,
        query: str,
        paragraphs: Sequence[str | None],
    ) -> list[_Generated | Exception]:
        """Greedy answers for every paragraph from one multi-sequence decode."""
        prompts = self._prompts(template, query, paragraphs, [None] * len(paragraphs))
        return [self._generated(out) for out in self._decode(prompts, self.max_new_tokens, [])]

    def generate_and_score(
        self,
        answer_template: BasePromptTemplate,
        scale: LabelScale,
        template: BasePromptTemplate,
        query: str,
        paragraphs: Sequence[str],
    ) -> tuple[list[_Generated | Exception], list[_Scored | Exception]]:
        """Answers and label probabilities for every paragraph, each paragraph evaluated once.

        The two prompts usually agree up to the end of the paragraph (question, then paragraph,
        then the instruction): the decoder evaluates that once per paragraph and continues it
        with each instruction (``tails``). Templates that differ before that, or instructions
        that tokenize differently after different paragraphs, get one decode each, as
        :meth:`generate` and :meth:`score` would; so does a decoder of one sequence at a time.
        """
        groups = self.label_ids(scale)
        answer_prompts = self._prompts(answer_template, query, paragraphs, [None] * len(paragraphs))
        label_prompts = self._prompts(template, query, paragraphs, [None] * len(paragraphs), 1)
        n_prefix = _common_prefix_length([*answer_prompts, *label_prompts])
        forks = [
            _common_prefix_length(pair) for pair in zip(answer_prompts, label_prompts, strict=True)
        ]
        answer_tails = {tuple(p[f:]) for p, f in zip(answer_prompts, forks, strict=True)}
        label_tails = {tuple(p[f:]) for p, f in zip(label_prompts, forks, strict=True)}
        track = [t for g in groups for t in g]
        shared = n_prefix > 0 and len(answer_tails) == len(label_tails) == 1
        if not shared or self.decoder.n_seq_max < 2:
            answer_outputs = self._decode(answer_prompts, self.max_new_tokens, [])
            label_outputs = self._decode(label_prompts, 1, track)
        else:
            outputs = self.decoder.generate(
                answer_prompts[0][:n_prefix],
                [p[n_prefix:f] for p, f in zip(answer_prompts, forks, strict=True)],
                tails=[*answer_tails, *label_tails],
                max_new_tokens=[self.max_new_tokens, 1],
                track_ids=track,
            )
            answer_outputs, label_outputs = outputs[0::2], outputs[1::2]
        return (
            [self._generated(out) for out in answer_outputs],
            [self._scored(out, scale, groups) for out in label_outputs],
        )

    def gate(self, template: BasePromptTemplate, query: str) -> _Scored:
        """Gate probability from the first-position log-probs of the gate prompt."""
        groups = self.label_ids(RETRIEVAL_SCALE)
        prompt = self._fitted(template, {"query_str": query}, 1)
        with self.decoder.session(prompt) as session:
            row = session.logprobs([t for g in groups for t in g])
        label_lps = _group_logprobs(row, groups)
        return _Scored(RETRIEVAL_SCALE.expected_value(label_lps), "logprobs", None, 1)

    def _prompts(
        self,
        template: BasePromptTemplate,
        query: str,
        paragraphs: Sequence[str | None],
        answers: Sequence[str | None],
        max_new: int | None = None,
    ) -> list[list[int]]:
        """One fitted prompt per paragraph (``max_new`` defaults to the answer length)."""
        new = self.max_new_tokens if max_new is None else max_new
        return [
            self._fitted(template, _values(query, paragraph, answer), new)
            for paragraph, answer in zip(paragraphs, answers, strict=True)
        ]

    def _generated(self, out: SequenceOutput) -> _Generated | Exception:
        if out.error is not None:
            return RuntimeError(out.error)
        kept = [t for t in out.tokens if not self.decoder.is_eog(t)]
        text = self.llama.detokenize(kept).decode("utf-8", errors="ignore").strip()
        return _Generated(text, sequence_score(out.token_logprobs), len(out.tokens))

    @staticmethod
    def _scored(
        out: SequenceOutput, scale: LabelScale, groups: Sequence[Sequence[int]]
    ) -> _Scored | Exception:
        if out.error is not None or len(out.tracked_logprobs) == 0:
            return RuntimeError(out.error or "no logits")
        label_lps = _group_logprobs(out.tracked_logprobs[0], groups)
        return _Scored(scale.expected_value(label_lps), "logprobs", None, 1)

    def _decode(
        self, prompts: list[list[int]], max_new: int, track: list[int]
    ) -> list[SequenceOutput]:
        """Decode the prompts together: their common head once, then one sequence each."""
        n_prefix = _common_prefix_length(prompts)
        if n_prefix == 0:  # nothing shared (no BOS, no chat markup): decode one by one
            return [
                self.decoder.generate(p, [[]], max_new_tokens=max_new, track_ids=track)[0]
                for p in prompts
            ]
        rests = [p[n_prefix:] for p in prompts]
        n_tail = _common_prefix_length([r[::-1] for r in rests])
        return self.decoder.generate(
            prompts[0][:n_prefix],
            [r[: len(r) - n_tail] for r in rests],
            max_new_tokens=max_new,
            track_ids=track,
            suffix_tail=rests[0][len(rests[0]) - n_tail :],
        )

    def close(self) -> None:
        self.decoder.close()


def _common_prefix_length(sequences: Sequence[Sequence[int]]) -> int:
    if not sequences:
        return 0
    n = min(len(s) for s in sequences)
    first = sequences[0]
    for i in range(n):
        if any(s[i] != first[i] for s in sequences[1:]):
            return i
    return n


def _group_logprobs(row: Sequence[float] | Any, groups: Sequence[Sequence[int]]) -> list[float]:
    """Per-label log-prob: log Σ p over the label's first-token ids (columns in group order)."""
    values = [float(v) for v in row]
    out, start = [], 0
    for group in groups:
        out.append(logsumexp(values[start : start + len(group)]))
        start += len(group)
    return out


def _chat_formatter(
    llama: llama_cpp.Llama, owner: Any
) -> tuple[Callable[[BasePromptTemplate, dict[str, str]], str], str]:
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
                messages = _with_system(template.format_messages(**values), system)
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
            eos_token=llama._model.token_get_text(eos) if eos >= 0 else "",
            bos_token=llama._model.token_get_text(bos) if bos >= 0 else "",
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
            render(_with_system([ChatMessage(role=MessageRole.USER, content="x")], system))
        except Exception as exc:  # e.g. a template that refuses a system message
            if system is None:
                logger.warning("GGUF chat template failed (%s); using plain prompts", exc)
                template_text = None
            else:
                system = None
        if template_text:

            def with_template(template: BasePromptTemplate, values: dict[str, Any]) -> str:
                return render(_with_system(template.format_messages(**values), system))

            return with_template, "gguf_chat_template"

    def plain(template: BasePromptTemplate, values: dict[str, Any]) -> str:
        return template.format(**values) + "\n\nAnswer:"

    return plain, "plain"


def _with_system(messages: list[ChatMessage], system: str | None) -> list[ChatMessage]:
    if system and not any(m.role == MessageRole.SYSTEM for m in messages):
        return [ChatMessage(role=MessageRole.SYSTEM, content=system), *messages]
    return list(messages)


@dataclass
class _Reply:
    text: str
    logprobs: list[list[tuple[str, float]]] | None
    generated_tokens: int | None


class _LLMBackend:
    """One LlamaIndex LLM call per sequence; the critic runs them concurrently."""

    def __init__(self, llm: LLM, llm_kwargs: Mapping[str, Any]) -> None:
        self.llm = llm
        self.llm_kwargs = dict(llm_kwargs)

    async def call(self, template: BasePromptTemplate, values: dict[str, Any]) -> _Reply:
        """Ask once; chat models get a user message (plus the LLM's system prompt)."""
        llm = self.llm
        if llm.metadata.is_chat_model:
            messages = _with_system(template.format_messages(**values), llm.system_prompt)
            chat = await llm.achat(messages, **self.llm_kwargs)
            return _Reply(
                chat.message.content or "", _logprob_pairs(chat.logprobs), _usage(chat.raw)
            )
        text = template.format(**values)
        if llm.system_prompt:
            text = f"{llm.system_prompt}\n\n{text}"
        completion = await llm.acomplete(text, **self.llm_kwargs)
        return _Reply(completion.text, _logprob_pairs(completion.logprobs), _usage(completion.raw))

    async def score_one(
        self, scale: LabelScale, template: BasePromptTemplate, values: dict[str, Any]
    ) -> _Scored:
        reply = await self.call(template, values)
        if reply.logprobs:
            label_lps = label_logprobs_from_top(reply.logprobs, scale)
            if label_lps is not None:
                return _Scored(
                    scale.expected_value(label_lps), "logprobs", None, reply.generated_tokens
                )
        return _fallback(scale, parse_reply(reply.text, scale), reply.generated_tokens)

    async def generate_one(
        self, template: BasePromptTemplate, values: dict[str, Any]
    ) -> _Generated:
        reply = await self.call(template, values)
        return _Generated(reply.text.strip(), None, reply.generated_tokens)


def _logprob_pairs(logprobs: Any) -> list[list[tuple[str, float]]] | None:
    if not logprobs:
        return None
    return [[(lp.token, float(lp.logprob)) for lp in position] for position in logprobs]


def _usage(raw: Any) -> int | None:
    """Completion tokens from an OpenAI-style ``usage`` (dict or object), when present."""
    usage = raw.get("usage") if isinstance(raw, Mapping) else getattr(raw, "usage", None)
    if usage is None:
        return None
    value = (
        usage.get("completion_tokens")
        if isinstance(usage, Mapping)
        else getattr(usage, "completion_tokens", None)
    )
    return int(value) if isinstance(value, int) else None


async def _guard(job: Coroutine[Any, Any, T]) -> T | Exception:
    """Turn one sequence's exception into a value, so it cannot sink the others."""
    try:
        return await job
    except Exception as exc:
        logger.warning("critic call failed: %r", exc)
        return exc


class _LoopThread:
    """A private event loop in a daemon thread, for running async LLM jobs from sync code.

    One loop for the critic's lifetime, so async clients an LLM caches (bound to the loop that
    created them) keep working across calls; it works the same whether or not the caller is
    inside a running loop (only the calling thread blocks).
    """

    def __init__(self) -> None:
        self._loop: asyncio.AbstractEventLoop | None = None
        self._thread: threading.Thread | None = None
        self._lock = threading.Lock()

    def run(self, coro: Coroutine[Any, Any, T]) -> T:
        loop = self._ensure()
        if threading.current_thread() is self._thread:
            coro.close()
            raise RuntimeError("sync critic method called from the critic's own loop: await it")
        context = contextvars.copy_context()  # keep the caller's instrumentation span
        done: concurrent.futures.Future[T] = concurrent.futures.Future()

        def start() -> None:
            task = context.run(loop.create_task, coro)

            def finish(t: asyncio.Task[T]) -> None:
                if t.cancelled():
                    done.cancel()
                elif (exc := t.exception()) is not None:
                    done.set_exception(exc)
                else:
                    done.set_result(t.result())

            task.add_done_callback(finish)

        loop.call_soon_threadsafe(start)
        return done.result()

    def _ensure(self) -> asyncio.AbstractEventLoop:
        with self._lock:
            if self._loop is None or self._loop.is_closed():
                loop = asyncio.new_event_loop()
                thread = threading.Thread(
                    target=loop.run_forever, name="prompted-critic-loop", daemon=True
                )
                thread.start()
                self._loop, self._thread = loop, thread
            return self._loop

    def close(self) -> None:
        with self._lock:
            loop, thread = self._loop, self._thread
            self._loop = self._thread = None
        if loop is not None and thread is not None:
            loop.call_soon_threadsafe(loop.stop)
            thread.join(timeout=5)
            loop.close()


# ================================================================================================
# The critic
# ================================================================================================


@dataclass
class _Paragraph:
    """Everything gathered for one paragraph while judging."""

    answer: _Generated | Exception | None = None
    scores: dict[str, _Scored | Exception] = field(default_factory=dict)


class PromptedCritic(PromptMixin):
    """:class:`~.critic.Critic` for ordinary LLMs: Self-RAG's judgements asked as short prompts.

    Args:
        llm: the judging LLM: any LlamaIndex ``LLM``, or a raw ``llama_cpp.Llama``. ``None`` uses
            ``Settings.llm`` (resolved here, once). A ``LlamaCPP`` (or raw ``Llama``) is read
            through batched llama.cpp decoding with exact label probabilities.
        generator_llm: the LLM that writes the per-paragraph and no-evidence answers; defaults to
            ``llm``. A bigger generator with a small judge (or the reverse) is a common split.
        retrieval_prompt, relevance_prompt, support_prompt, utility_prompt: the four judgement
            templates (``PromptTemplate`` or string). They fill ``{query_str}``, ``{context_str}``
            (the paragraph) and ``{answer_str}``, and must keep the reply words the scores read:
            Yes/No, Yes/Partly/No and 1-5.
        answer_prompt, no_evidence_prompt: the answer templates, with and without the paragraph.
        max_new_tokens: answer length cap on llama.cpp (other LLMs use their own
            ``max_tokens``; pass ``llm_kwargs`` to override per call). Short answers keep IsSUP
            and IsUSE about one claim.
        num_workers: concurrent LLM calls for non-llama.cpp LLMs (``run_jobs``). One judgement of
            k paragraphs makes 4·k calls in two rounds; ``num_workers >= 2k`` makes each round as
            slow as its slowest call.
        use_batched_decoding: read llama.cpp models through :class:`BatchedDecoder` (default).
            ``False`` treats a ``LlamaCPP`` like any LLM (one ``complete`` per question, parsed).
        llm_kwargs: extra keyword arguments for every ``achat``/``acomplete`` call (e.g.
            ``{"max_tokens": 8}``), non-llama.cpp LLMs only.
        n_seq_max, n_ctx, n_threads: batched llama.cpp decoding: sequences per decode, positions
            per sequence (default: the model's ``n_ctx``; longer paragraphs are truncated with a
            warning), CPU threads (default: the model's).

    Each judgement's ``details`` says how each score was obtained: ``"logprobs"`` (label
    probabilities), ``"parsed"`` (label read from the reply) or ``"fallback"`` (unreadable reply,
    neutral score; ``details["notes"]`` says why), plus, when known, ``answer_tokens`` and
    ``generated_tokens`` (answer and label replies together). A failed paragraph has ``"error"``
    there.
    Synchronous methods on non-llama.cpp LLMs run the async calls on a private event loop, so
    they are as parallel as the async ones.
    """

    name = "prompted"

    def __init__(
        self,
        llm: LLM | llama_cpp.Llama | None = None,
        *,
        generator_llm: LLM | llama_cpp.Llama | None = None,
        retrieval_prompt: BasePromptTemplate | str | None = None,
        relevance_prompt: BasePromptTemplate | str | None = None,
        support_prompt: BasePromptTemplate | str | None = None,
        utility_prompt: BasePromptTemplate | str | None = None,
        answer_prompt: BasePromptTemplate | str | None = None,
        no_evidence_prompt: BasePromptTemplate | str | None = None,
        max_new_tokens: int = 64,
        num_workers: int = 4,
        use_batched_decoding: bool = True,
        llm_kwargs: Mapping[str, Any] | None = None,
        n_seq_max: int = 8,
        n_ctx: int | None = None,
        n_threads: int | None = None,
    ) -> None:
        if max_new_tokens < 1:
            raise ValueError(f"max_new_tokens must be >= 1, got {max_new_tokens}")
        if num_workers < 1:
            raise ValueError(f"num_workers must be >= 1, got {num_workers}")
        if llm is None:
            from llama_index.core import Settings

            llm = Settings.llm
        self.llm = llm
        self.generator_llm = generator_llm if generator_llm is not None else llm
        self.num_workers = num_workers
        self.max_new_tokens = max_new_tokens
        given = {
            "retrieval_prompt": retrieval_prompt,
            "relevance_prompt": relevance_prompt,
            "support_prompt": support_prompt,
            "utility_prompt": utility_prompt,
            "answer_prompt": answer_prompt,
            "no_evidence_prompt": no_evidence_prompt,
        }
        self._prompts: dict[str, BasePromptTemplate] = {
            key: _as_template(value if value is not None else _DEFAULT_PROMPTS[key], key)
            for key, value in given.items()
        }
        self._loop = _LoopThread()
        backends: dict[int, _LlamaCppBackend | _LLMBackend] = {}
        for model in (self.llm, self.generator_llm):
            if id(model) in backends:
                continue
            llama = llama_of(model) if use_batched_decoding else None
            if llama is not None:
                backends[id(model)] = _LlamaCppBackend(
                    llama,
                    model,
                    max_new_tokens=max_new_tokens,
                    n_seq_max=n_seq_max,
                    n_ctx=n_ctx,
                    n_threads=n_threads,
                )
            elif isinstance(model, LLM):
                backends[id(model)] = _LLMBackend(model, llm_kwargs or {})
            else:
                raise TypeError(
                    f"llm must be a LlamaIndex LLM or a llama_cpp.Llama, got {type(model).__name__}"
                )
        self._judge = backends[id(self.llm)]
        self._generator = backends[id(self.generator_llm)]

    @property
    def decoder(self) -> BatchedDecoder | None:
        """The judge's batched llama.cpp decoder, or ``None`` for other LLMs."""
        return self._judge.decoder if isinstance(self._judge, _LlamaCppBackend) else None

    @property
    def prompt_format(self) -> str:
        """How llama.cpp prompts are formatted (``"gguf_chat_template"``, ``"plain"``, ...)."""
        if isinstance(self._judge, _LlamaCppBackend):
            return self._judge.prompt_format
        return "llm"

    # --- PromptMixin ---------------------------------------------------------------------------

    def _get_prompts(self) -> PromptDictType:
        """The six templates, keyed as in :data:`PROMPT_VARIABLES`."""
        return dict(self._prompts)

    def _get_prompt_modules(self) -> PromptMixinType:
        """No sub-modules."""
        return {}

    def _update_prompts(self, prompts_dict: PromptDictType) -> None:
        """Replace templates by key; unknown keys are ignored like in LlamaIndex modules."""
        for key, prompt in prompts_dict.items():
            if key in self._prompts:
                self._prompts[key] = _as_template(prompt, key)

    # --- Critic protocol (sync) ----------------------------------------------------------------

    @dispatcher.span
    def decide_retrieval(
        self, query: str, threshold: float | None, answer_if_skipped: bool = True
    ) -> RetrievalDecision:
        """Ask whether ``query`` needs documents.

        With label probabilities, retrieve when p(Yes)/(p(Yes)+p(No)) exceeds ``threshold``
        (``None``: when Yes is the likelier label). A parsed verdict has no probability
        (``probability=None``) and decides alone; an unreadable one retrieves. When retrieval is
        skipped and ``answer_if_skipped``, the no-evidence answer is generated too.
        """
        result: RetrievalDecision = self._loop.run(
            self.adecide_retrieval(query, threshold, answer_if_skipped)
        )
        return result

    @dispatcher.span
    def judge(self, query: str, paragraphs: Sequence[str]) -> list[ParagraphJudgement]:
        """Answer ``query`` from each paragraph and score each answer, in input order.

        Two rounds: the answers and the relevance of every paragraph, then support and utility
        of every answer. On llama.cpp each judgement is one multi-sequence decode (answers and
        relevance share one when their prompts agree up to the paragraph's end); on other LLMs
        each round is a set of concurrent calls (at most ``num_workers`` at once). A paragraph
        whose call failed comes back with ``error`` set and zero scores.
        """
        result: list[ParagraphJudgement] = self._loop.run(self.ajudge(query, paragraphs))
        return result

    @dispatcher.span
    def generate(self, query: str) -> str:
        """Answer ``query`` with no evidence (``no_evidence_prompt``)."""
        result: str = self._loop.run(self.agenerate(query))
        return result

    # --- Critic protocol (async) ---------------------------------------------------------------

    @dispatcher.span
    async def adecide_retrieval(
        self, query: str, threshold: float | None, answer_if_skipped: bool = True
    ) -> RetrievalDecision:
        """Async :meth:`decide_retrieval`."""
        template = self._prompts["retrieval_prompt"]
        judge = self._judge
        if isinstance(judge, _LlamaCppBackend):
            scored = await asyncio.to_thread(judge.gate, template, query)
        else:
            scored = await judge.score_one(RETRIEVAL_SCALE, template, {"query_str": query})
        if scored.method == "logprobs":
            probability: float | None = scored.score
            cut = 0.5 if threshold is None else threshold
            retrieve = scored.score > cut
        else:
            probability = None
            retrieve = scored.score >= 0.5
        answer = None
        if not retrieve and answer_if_skipped:
            answer = await self.agenerate(query)
        logger.debug(
            "retrieval gate (%s): p=%s threshold=%s retrieve=%s%s",
            scored.method,
            probability,
            threshold,
            retrieve,
            f" ({scored.note})" if scored.note else "",
        )
        return RetrievalDecision(retrieve=retrieve, probability=probability, answer=answer)

    @dispatcher.span
    async def ajudge(self, query: str, paragraphs: Sequence[str]) -> list[ParagraphJudgement]:
        """Async :meth:`judge`."""
        if not paragraphs:
            return []
        texts = list(paragraphs)
        state = [_Paragraph() for _ in texts]
        judge = self._judge
        if judge is self._generator and isinstance(judge, _LlamaCppBackend):
            answers, relevance = await asyncio.to_thread(
                judge.generate_and_score,
                self._prompts["answer_prompt"],
                RELEVANCE_SCALE,
                self._prompts["relevance_prompt"],
                query,
                texts,
            )
        else:
            answers_plan = self._generate_plan(self._prompts["answer_prompt"], query, texts)
            relevance_plan = self._score_plan(
                RELEVANCE_SCALE,
                self._prompts["relevance_prompt"],
                query,
                texts,
                [None] * len(texts),
            )
            answers, relevance = await self._run_plans(answers_plan, relevance_plan)
        for item, answer, rel in zip(state, answers, relevance, strict=True):
            item.answer = answer
            item.scores["relevance"] = rel

        live = [i for i, item in enumerate(state) if isinstance(item.answer, _Generated)]
        if live:
            live_texts = [texts[i] for i in live]
            live_answers = [_answer_text(state[i].answer) for i in live]
            support_plan = self._score_plan(
                SUPPORT_SCALE, self._prompts["support_prompt"], query, live_texts, live_answers
            )
            utility_plan = self._score_plan(
                UTILITY_SCALE,
                self._prompts["utility_prompt"],
                query,
                [None] * len(live),
                live_answers,
            )
            support, utility = await self._run_plans(support_plan, utility_plan)
            for i, sup, use in zip(live, support, utility, strict=True):
                state[i].scores["support"] = sup
                state[i].scores["utility"] = use
        return [self._judgement(item) for item in state]

    @dispatcher.span
    async def agenerate(self, query: str) -> str:
        """Async :meth:`generate`."""
        plan = self._generate_plan(self._prompts["no_evidence_prompt"], query, [None])
        (results,) = await self._run_plans(plan)
        result = results[0]
        if isinstance(result, Exception):
            raise result
        return str(result.text)

    def close(self) -> None:
        """Free the llama.cpp contexts and the private event loop (the LLMs stay open)."""
        for backend in {id(b): b for b in (self._judge, self._generator)}.values():
            if isinstance(backend, _LlamaCppBackend):
                backend.close()
        self._loop.close()

    # --- plumbing ------------------------------------------------------------------------------

    def _score_plan(
        self,
        scale: LabelScale,
        template: BasePromptTemplate,
        query: str,
        paragraphs: Sequence[str | None],
        answers: Sequence[str | None],
    ) -> _Plan:
        judge = self._judge
        if isinstance(judge, _LlamaCppBackend):
            job = asyncio.to_thread(judge.score, scale, template, query, paragraphs, answers)
            return _Plan([job], lambda results: list(results[0]))
        jobs = [
            _guard(judge.score_one(scale, template, _values(query, paragraph, answer)))
            for paragraph, answer in zip(paragraphs, answers, strict=True)
        ]
        return _Plan(jobs, list)

    def _generate_plan(
        self, template: BasePromptTemplate, query: str, paragraphs: Sequence[str | None]
    ) -> _Plan:
        generator = self._generator
        if isinstance(generator, _LlamaCppBackend):
            job = asyncio.to_thread(generator.generate, template, query, paragraphs)
            return _Plan([job], lambda results: list(results[0]))
        jobs = [
            _guard(generator.generate_one(template, _values(query, paragraph, None)))
            for paragraph in paragraphs
        ]
        return _Plan(jobs, list)

    async def _run_plans(self, *plans: _Plan) -> list[list[Any]]:
        """Run every plan's jobs together, at most ``num_workers`` at once."""
        jobs = [job for plan in plans for job in plan.jobs]
        results = await run_jobs(jobs, workers=self.num_workers)
        out, start = [], 0
        for plan in plans:
            out.append(plan.collect(results[start : start + len(plan.jobs)]))
            start += len(plan.jobs)
        return out

    @staticmethod
    def _judgement(item: _Paragraph) -> ParagraphJudgement:
        failures = [item.answer] if isinstance(item.answer, Exception) else []
        failures += [s for s in item.scores.values() if isinstance(s, Exception)]
        if failures:
            return ParagraphJudgement(
                answer="",
                relevance=0.0,
                support=0.0,
                utility=0.0,
                error=f"{type(failures[0]).__name__}: {failures[0]}",
                details={"relevance": "error", "support": "error", "utility": "error"},
            )
        assert isinstance(item.answer, _Generated)
        scores = {k: v for k, v in item.scores.items() if isinstance(v, _Scored)}
        details: dict[str, Any] = {name: scores[name].method for name in scores}
        notes = {name: s.note for name, s in scores.items() if s.note}
        if notes:
            details["notes"] = notes
        counts = [item.answer.generated_tokens, *(s.generated_tokens for s in scores.values())]
        if all(c is not None for c in counts):
            details["generated_tokens"] = sum(c for c in counts if c is not None)
        if item.answer.generated_tokens is not None:
            details["answer_tokens"] = item.answer.generated_tokens
        return ParagraphJudgement(
            answer=item.answer.text,
            relevance=scores["relevance"].score,
            support=scores["support"].score,
            utility=scores["utility"].score,
            seq_score=item.answer.seq_score,
            details=details,
        )


def _values(query: str, paragraph: str | None, answer: str | None) -> dict[str, Any]:
    values: dict[str, Any] = {"query_str": query}
    if paragraph is not None:
        values["context_str"] = paragraph
    if answer is not None:
        values["answer_str"] = answer
    return values


def _answer_text(answer: _Generated | Exception | None) -> str:
    return answer.text if isinstance(answer, _Generated) else ""
