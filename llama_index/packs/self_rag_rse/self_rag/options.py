"""What :class:`~llama_index.packs.self_rag_rse.SelfRAGQueryEngine` can be told.

The options are pydantic fields checked by validators, with ``validate_assignment``: every check
runs at construction and again whenever an option is set later (``engine.ndocs = 0`` raises), a
failed assignment leaves the option as it was, and a misspelt option is a ``TypeError`` naming
the closest one, set later or passed to the constructor. Messages name the option, the value
and what to pass instead.
"""

from __future__ import annotations

import logging
import math
from typing import Any, Literal

from llama_index.core.bridge.pydantic import (
    BaseModel,
    ConfigDict,
    Field,
    ValidationInfo,
    field_validator,
    model_validator,
)
from llama_index.core.postprocessor.types import BaseNodePostprocessor

from llama_index.packs.self_rag_rse.common.options import (
    pydantic_fields,
    reject_unknown,
    require_finite,
)
from llama_index.packs.self_rag_rse.critic.contract import ParagraphJudgement
from llama_index.packs.self_rag_rse.self_rag.short_form import Corrective

logger = logging.getLogger(__name__)

#: The thresholds, the scale each is read on and a value to pass: the gate, relevance and
#: support are probabilities; utility is IsUSE, in [-1, 1].
_SCALES = {
    "threshold": (
        0.0,
        1.0,
        "e.g. 0.2 (Self-RAG's on PopQA), or None to let greedy decoding decide",
    ),
    "rewrite_threshold": (0.0, 1.0, "a relevance, e.g. 0.5"),
    "support_threshold": (0.0, 1.0, "a support, e.g. 0.5"),
    "utility_threshold": (-1.0, 1.0, "a utility, e.g. 0.0"),
}
#: Options that must be finite numbers (``threshold`` may be None).
_NUMBERS = ["w_rel", "w_sup", "w_use", *_SCALES]
#: Options that count something, and what to pass instead of a bad value.
_COUNTS = {
    "max_new_tokens": "the tokens generated per answer, e.g. 50",
    "max_retrieval_rounds": "the retrievals per query, the first one included, e.g. 3",
    "beam_width": "the paths long form keeps at each depth, e.g. 2",
    "max_segments": "the most segments of a long-form answer, e.g. 6",
    "ndocs": "the most paragraphs judged per retrieval, e.g. 10, or None for all of them",
}


#: Keyword arguments of the upstream constructor that are not options.
CONSTRUCTOR_ARGS = {
    "model_path",
    "model_kwargs",
    "generate_kwargs",
    "llm",
    "critic",
    "generator_llm",
}


class SelfRAGOptions(BaseModel):
    """The options of Self-RAG, their defaults and their checks (see the module docstring)."""

    model_config = ConfigDict(validate_assignment=True, arbitrary_types_allowed=True)

    retriever: Any = Field(
        description="Any LlamaIndex retriever (anything with retrieve(); aretrieve() is used "
        "by aquery when it has one)."
    )
    mode: Literal["adaptive_retrieval", "always_retrieve", "no_retrieval"] = Field(
        default="adaptive_retrieval",
        description=(
            "When to retrieve: 'adaptive_retrieval' lets the critic decide per query (the gate), "
            "'always_retrieve' always does, 'no_retrieval' never does (the model answers alone)."
        ),
    )
    threshold: float | None = Field(
        default=None,
        description=(
            "The gate retrieves when p([Retrieval]) / (p([Retrieval]) + p([No Retrieval])) is "
            "above this threshold. None lets the greedy output decide, as the upstream pack "
            "does. Self-RAG uses 0.2 on PopQA."
        ),
    )
    w_rel: float = Field(
        default=1.0, description="Weight of IsREL (relevance, in [0, 1]) in the final score."
    )
    w_sup: float = Field(
        default=1.0, description="Weight of IsSUP (support, in [0, 1]) in the final score."
    )
    w_use: float = Field(
        default=0.5, description="Weight of IsUSE (utility, in [-1, 1]) in the final score."
    )
    use_seqscore: bool = Field(
        default=False,
        description=(
            "Add the answer's sequence score, exp(mean token log-prob), to its final score: "
            "it favours fluent, confident answers."
        ),
    )
    ndocs: int | None = Field(
        default=10,
        description=(
            "At most this many paragraphs are judged per retrieval; empty paragraphs take no "
            "place. None judges every paragraph retrieved."
        ),
    )
    max_new_tokens: int = Field(
        default=50,
        description=(
            "Tokens generated per answer (long form: per segment). Read once, when the critic "
            "is built."
        ),
    )
    node_postprocessors: list[BaseNodePostprocessor] = Field(
        default_factory=list,
        description=(
            "Run on the retrieved nodes before the critic judges them (e.g. "
            "RelevantSegmentPostprocessor, to judge whole segments). None: none."
        ),
    )
    corrective: bool = Field(
        default=False,
        description=(
            "Turn on the corrective loop: when no paragraph is relevant, or the best answer is "
            "of low utility, retrieve again with a pseudo-document (query2doc) or a rewritten "
            "query; regenerate an unsupported answer."
        ),
    )
    rewrite_threshold: float = Field(
        default=0.5,
        description=(
            "Corrective loop: a paragraph whose relevance is below this does not count as "
            "relevant; with none relevant, the loop searches with query2doc, then a rewrite."
        ),
    )
    support_threshold: float = Field(
        default=0.5,
        description=(
            "Corrective loop: the chosen answer's support below this triggers its "
            "regeneration, then the next-best supported answer."
        ),
    )
    utility_threshold: float = Field(
        default=0.0,
        description=(
            "Corrective loop: the best relevant answer's utility below this triggers a "
            "rewritten query."
        ),
    )
    max_retrieval_rounds: int = Field(
        default=3,
        description="Corrective loop: retrievals per query, the first one included.",
    )
    max_regenerations: int = Field(
        default=1,
        ge=0,
        description=(
            "Corrective loop: how many times an unsupported best answer is regenerated before "
            "the next-best supported one is taken (0: never)."
        ),
    )
    title_key: str | list[str] | None = Field(
        default=["title", "document_title"],
        description=(
            "Node metadata key(s) whose value becomes the paragraph's first line (the first "
            "non-empty one wins); None: no title line."
        ),
    )
    streaming: bool = Field(
        default=False,
        description=(
            "query returns a StreamingResponse, aquery an AsyncStreamingResponse, with its "
            "sources and metadata complete. The model's own answer (no retrieval) streams "
            "token by token; an answer chosen among paragraphs, or a long-form answer (one "
            "piece per segment), is known once the search ends, before the response is returned."
        ),
    )
    long_form: bool = Field(
        default=False,
        description=(
            "Write the answer segment by segment, each citing its passage (beam search over "
            "per-passage continuations; needs a Self-RAG model). max_new_tokens is per segment."
        ),
    )
    beam_width: int = Field(
        default=2, description="Long form: the paths kept at each depth of the beam search."
    )
    max_segments: int = Field(
        default=6, description="Long form: the most segments (depths) of one answer."
    )
    segment_retrieval: Literal["per_segment", "once"] = Field(
        default="per_segment",
        description=(
            "Long form: retrieve again for each path with the query and its last segment "
            "(per_segment), or use the query's passages at every depth (once)."
        ),
    )
    verbose: bool = Field(
        default=False,
        description="Print a table of every judged paragraph (long form: of every depth) and "
        "the trace of each query.",
    )

    # -- option checks: pydantic runs them at construction and on every assignment ----------
    @field_validator(*_NUMBERS)
    @classmethod
    def _finite(cls, value: float | None, info: ValidationInfo) -> float | None:
        name = str(info.field_name)
        require_finite(cls.__name__, **{name: value})
        if value is None or name not in _SCALES:
            return value
        low, high, example = _SCALES[name]
        if not low <= value <= high:
            raise ValueError(
                f"{name} must be in [{low:g}, {high:g}], the scale it is read on, got {value}: "
                f"pass {example}"
            )
        return value

    @field_validator(*_NUMBERS, *_COUNTS, "max_regenerations", mode="before")
    @classmethod
    def _not_a_bool(cls, value: Any, info: ValidationInfo) -> Any:
        # pydantic would read True as 1 and False as 0, without a word.
        if isinstance(value, bool):
            raise ValueError(
                f"{info.field_name} must be a number, got {value}: pass a number (True would "
                "be read as 1)"
            )
        return value

    @field_validator(*_COUNTS)
    @classmethod
    def _at_least_one(cls, value: int | None, info: ValidationInfo) -> int | None:
        name = str(info.field_name)
        if value is not None and value < 1:
            none = " or None" if name == "ndocs" else ""
            raise ValueError(f"{name} must be at least 1{none}, got {value}: pass {_COUNTS[name]}")
        return value

    @field_validator("node_postprocessors", mode="before")
    @classmethod
    def _no_postprocessors(cls, value: Any) -> Any:
        # None means none, as core's query engines read it.
        return [] if value is None else value

    @field_validator("retriever")
    @classmethod
    def _retriever(cls, value: Any) -> Any:
        if not callable(getattr(value, "retrieve", None)):
            raise TypeError(
                f"retriever must be a LlamaIndex retriever (with retrieve()), got "
                f"{type(value).__name__}: pass e.g. retriever=index.as_retriever()"
            )
        return value

    @model_validator(mode="after")
    def _long_form_alone(self) -> SelfRAGOptions:
        if self.long_form and self.corrective:
            raise ValueError(
                "long_form=True and corrective=True cannot be combined: the corrective loop "
                "re-retrieves and regenerates short-form answers, while long form retrieves per "
                "segment (segment_retrieval='per_segment'): set one of them to False"
            )
        return self

    def __setattr__(self, name: str, value: Any) -> None:
        if name.startswith("_"):
            return super().__setattr__(name, value)
        # A misspelt option is an error, as in the constructor.
        reject_unknown(type(self).__name__, [name], pydantic_fields(type(self)))
        before = self.__dict__.get(name)
        try:
            super().__setattr__(name, value)
            if name == "max_new_tokens" and value != before:
                raise ValueError(
                    "max_new_tokens is read once, when the critic is built: pass "
                    f"{type(self).__name__}(max_new_tokens={value!r}, ...) to a new engine"
                )
        except ValueError:
            # pydantic has already set the field when a check of the whole model fails.
            self.__dict__[name] = before
            raise

    # -- what the options decide -------------------------------------------------------------
    def final_score(self, judgement: ParagraphJudgement) -> float:
        """A judgement's final score, ``[seq_score] + w_rel·IsREL + w_sup·IsSUP + w_use·IsUSE``;
        ``-inf`` for a paragraph the critic failed on. A NaN score fails the paragraph (it would
        win or lose a ``max()`` by where it stands), with the reason in its ``error``.
        """
        if judgement.error is not None:
            return -math.inf
        score = judgement.score(
            w_rel=self.w_rel,
            w_sup=self.w_sup,
            w_use=self.w_use,
            use_seqscore=self.use_seqscore,
        )
        if math.isnan(score):
            judgement.error = (
                "its score is NaN: the critic read log-probabilities that are not numbers (a "
                "damaged model file or a numeric overflow); ranked last: check the model file"
            )
            return -math.inf
        return score

    def corrective_loop(self) -> Corrective | None:
        """The corrective loop's knobs, or ``None`` when the loop is off."""
        if not self.corrective:
            return None
        return Corrective(
            max_retrieval_rounds=self.max_retrieval_rounds,
            rewrite_threshold=self.rewrite_threshold,
            support_threshold=self.support_threshold,
            utility_threshold=self.utility_threshold,
            max_regenerations=self.max_regenerations,
        )


def read_generate_kwargs(
    generate_kwargs: dict[str, Any] | None, options: dict[str, Any], critic: Any
) -> None:
    """The upstream constructor's ``generate_kwargs``, read into the engine's ``options``.

    An answer length (``max_tokens``) becomes ``max_new_tokens`` (checked as the option is)
    unless that is set already; a temperature of 0 is greedy decoding already; anything else is
    ignored, with a warning: Self-RAG scores its greedy decodes. A ``critic`` passed built
    writes its own answer length, which the engine cannot change: another one is refused.
    """
    ignored = dict(generate_kwargs or {})
    # The keys that give the answer length: llama_cpp's name, and the engine's.
    for key in ("max_tokens", "max_new_tokens"):
        if key in ignored and "max_new_tokens" not in options:
            options["max_new_tokens"] = ignored.pop(key)
    if ignored.get("temperature", 0) in (None, 0):
        ignored.pop("temperature", None)
    if ignored:
        # Sampling, stops and penalties would change what is scored.
        logger.warning(
            "Self-RAG scores greedy decodes; ignoring %s: remove them from generate_kwargs",
            ignored,
        )
    own = getattr(critic, "max_new_tokens", None)
    if own is not None and options.get("max_new_tokens", own) != own:
        raise ValueError(
            f"max_new_tokens={options['max_new_tokens']!r}: the critic passed writes {own} "
            "tokens: set it there (where the critic is built), or leave max_new_tokens out"
        )
