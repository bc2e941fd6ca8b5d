"""The critic backend on in-process llama.cpp: batched decodes, exact label probabilities.

Every judgement over k paragraphs is one multi-sequence decode
(:class:`~.decoder.BatchedDecoder`): the prompts' common head is evaluated once, each paragraph in
its own sequence. Label probabilities are the exact next-token log-probs of each label's first
tokens under the full-vocabulary softmax, and scores are expectations under them, like the
paper's. Answers and relevance share one decode when their prompts agree up to the end of the
paragraph (the default prompts do), so each paragraph is evaluated once for both.

All decoding runs on one worker thread per backend, in order (see
:class:`~llama_index.packs.self_rag_rse.common.bridge.SerialWorker`).
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from typing import TYPE_CHECKING, Any, TypeVar

from llama_index.core.prompts import BasePromptTemplate

from llama_index.packs.self_rag_rse.common.bridge import SerialWorker
from llama_index.packs.self_rag_rse.llamacpp.decoder import BatchedDecoder, SequenceOutput
from llama_index.packs.self_rag_rse.llamacpp.prompt_tokens import PromptTokenizer
from llama_index.packs.self_rag_rse.self_rag.backend import CriticBackend, Generated, Scored, Values
from llama_index.packs.self_rag_rse.self_rag.labels import LabelScale, logsumexp
from llama_index.packs.self_rag_rse.self_rag.reflection import sequence_score

if TYPE_CHECKING:
    import llama_cpp

T = TypeVar("T")


class LlamaCppBackend(CriticBackend):
    """:class:`~llama_index.packs.self_rag_rse.self_rag.backend.CriticBackend` on llama.cpp.

    Args:
        llama: a loaded ``llama_cpp.Llama``; its weights are shared with a second,
            multi-sequence context. The backend never closes it.
        owner: the LlamaIndex LLM wrapping ``llama`` (a ``LlamaCPP``: its prompt formatting and
            system prompt are used), or ``llama`` itself.
        max_new_tokens: answer length cap.
        n_seq_max: sequences decoded together.
        n_ctx: positions per sequence (default: the model's ``n_ctx``); longer paragraphs are
            shortened from their end with a warning.
        n_threads: CPU threads for decoding (default: the model's).
    """

    def __init__(
        self,
        llama: llama_cpp.Llama,
        owner: Any = None,
        *,
        max_new_tokens: int = 64,
        n_seq_max: int = 8,
        n_ctx: int | None = None,
        n_threads: int | None = None,
    ) -> None:
        self.llama = llama
        self.max_new_tokens = max_new_tokens
        self.decoder = BatchedDecoder(
            llama,
            n_seq_max=n_seq_max,
            n_ctx=n_ctx,
            n_batch=max(512, n_seq_max),
            n_threads=n_threads,
        )
        self.tokenizer = PromptTokenizer(
            llama, llama if owner is None else owner, self.decoder.n_ctx
        )
        self.prompt_format = self.tokenizer.prompt_format
        self._worker = SerialWorker("llama-cpp-critic")

    # --- CriticBackend -------------------------------------------------------------------------

    async def generate(
        self, template: BasePromptTemplate, values: Sequence[Values]
    ) -> list[Generated | Exception]:
        """Greedy answers for every prompt from one multi-sequence decode."""
        return await self._worker.run(self._held, self.generate_blocking, template, values)

    async def score(
        self, scale: LabelScale, template: BasePromptTemplate, values: Sequence[Values]
    ) -> list[Scored | Exception]:
        """Label probabilities of every prompt from one multi-sequence decode (1 new token)."""
        return await self._worker.run(self._held, self.score_blocking, scale, template, values)

    async def generate_and_score(
        self,
        answer_template: BasePromptTemplate,
        scale: LabelScale,
        label_template: BasePromptTemplate,
        values: Sequence[Values],
    ) -> tuple[list[Generated | Exception], list[Scored | Exception]]:
        """Answers and labels with each paragraph evaluated once for both (see the module)."""
        return await self._worker.run(
            self._held,
            self.generate_and_score_blocking,
            answer_template,
            scale,
            label_template,
            values,
        )

    def close(self) -> None:
        """Wait for running work, then free the decoder's context (the model stays open)."""
        self._worker.close()
        self.decoder.close()

    def describe(self) -> dict[str, Any]:
        """Backend, prompt format and KV layout."""
        return {**super().describe(), "kv_unified": self.decoder.kv_unified}

    # --- blocking implementations --------------------------------------------------------------

    def score_blocking(
        self, scale: LabelScale, template: BasePromptTemplate, values: Sequence[Values]
    ) -> list[Scored | Exception]:
        """:meth:`score` in the calling thread."""
        self._check_open()
        groups = self.tokenizer.label_ids(scale)
        prompts = self._prompts(template, values, 1)
        outputs = self._decode(prompts, 1, [t for g in groups for t in g])
        return [_scored(out, scale, groups) for out in outputs]

    def generate_blocking(
        self, template: BasePromptTemplate, values: Sequence[Values]
    ) -> list[Generated | Exception]:
        """:meth:`generate` in the calling thread."""
        self._check_open()
        prompts = self._prompts(template, values, self.max_new_tokens)
        return [self._generated(out) for out in self._decode(prompts, self.max_new_tokens, [])]

    def generate_and_score_blocking(
        self,
        answer_template: BasePromptTemplate,
        scale: LabelScale,
        label_template: BasePromptTemplate,
        values: Sequence[Values],
    ) -> tuple[list[Generated | Exception], list[Scored | Exception]]:
        """:meth:`generate_and_score` in the calling thread.

        The two prompts usually agree up to the end of the paragraph (question, then paragraph,
        then the instruction): the decoder evaluates that once per paragraph and continues it
        with each instruction (``tails``). Templates that differ before that, or instructions
        that tokenize differently after different paragraphs, get one decode each, as
        :meth:`generate` and :meth:`score` would; so does a decoder of one sequence at a time.
        """
        self._check_open()
        groups = self.tokenizer.label_ids(scale)
        answer_prompts = self._prompts(answer_template, values, self.max_new_tokens)
        label_prompts = self._prompts(label_template, values, 1)
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
            [_scored(out, scale, groups) for out in label_outputs],
        )

    # --- helpers -------------------------------------------------------------------------------

    def _check_open(self) -> None:
        # llama-cpp-python's tokenize on a closed Llama touches freed memory: check first.
        self.decoder.check_open()

    def _held(self, func: Callable[..., T], *args: Any) -> T:
        """Run ``func`` holding the decoder, so the model cannot be closed half-way."""
        with self.decoder.hold():
            return func(*args)

    def _prompts(
        self, template: BasePromptTemplate, values: Sequence[Values], max_new: int
    ) -> list[list[int]]:
        """One fitted prompt per values mapping."""
        return [self.tokenizer.fitted(template, dict(v), max_new) for v in values]

    def _generated(self, out: SequenceOutput) -> Generated | Exception:
        if out.error is not None:
            return RuntimeError(out.error)
        kept = [t for t in out.tokens if not self.decoder.is_eog(t)]
        text = self.llama.detokenize(kept).decode("utf-8", errors="ignore").strip()
        return Generated(text, sequence_score(out.token_logprobs), len(out.tokens))

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


def _scored(
    out: SequenceOutput, scale: LabelScale, groups: Sequence[Sequence[int]]
) -> Scored | Exception:
    if out.error is not None or len(out.tracked_logprobs) == 0:
        return RuntimeError(out.error or "no logits")
    label_lps = group_logprobs(out.tracked_logprobs[0], groups)
    return Scored(scale.expected_value(label_lps), "logprobs", None, 1)


def _common_prefix_length(sequences: Sequence[Sequence[int]]) -> int:
    if not sequences:
        return 0
    n = min(len(s) for s in sequences)
    first = sequences[0]
    for i in range(n):
        if any(s[i] != first[i] for s in sequences[1:]):
            return i
    return n


def group_logprobs(row: Sequence[float] | Any, groups: Sequence[Sequence[int]]) -> list[float]:
    """Per-label log-prob: log Σ p over the label's first-token ids (columns in group order)."""
    values = [float(v) for v in row]
    out, start = [], 0
    for group in groups:
        out.append(logsumexp(values[start : start + len(group)]))
        start += len(group)
    return out
