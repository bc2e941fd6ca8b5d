"""What :class:`~llama_index.packs.self_rag_rse.RelevantSegmentPostprocessor` can be told.

The options are pydantic fields checked by validators, with ``validate_assignment``: every check
runs at construction and again whenever an option is set later (``rse.max_length = 0``
raises), and a failed assignment leaves the option as it was. Messages name the option and what
to pass. Options left ``None`` take their dsRAG preset's value (:func:`~.values.get_preset`),
except ``minimum_value`` and ``calibration``, whose defaults come with the selection policy the
postprocessor picks per call (:mod:`~.selection`: dsRAG's chunk counts, or a context budget). No
option here depends on the search code: the budget's limits come from :mod:`~.values`.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any, Literal

from llama_index.core.bridge.pydantic import (
    BaseModel,
    ConfigDict,
    Field,
    ValidationInfo,
    field_validator,
)

from llama_index.packs.self_rag_rse.common.options import require_finite
from llama_index.packs.self_rag_rse.rse.calibration import DEFAULT_COSINE_RANGE, check_calibration
from llama_index.packs.self_rag_rse.rse.values import CHARS_PER_TOKEN, MAX_BUDGET, get_preset

#: Options that count something, and what to pass instead of a bad value.
_COUNTS = {
    "max_length": "the most chunks in one segment, e.g. 10 (None: the preset's)",
    "overall_max_length": "the most chunks over all segments, e.g. 30 (None: the preset's)",
    "top_k_for_document_selection": "how many documents to search, e.g. 7 (None: the preset's)",
    "max_document_chunks": "the most nodes read back per document, e.g. 20000",
    "max_context_chars": "the size of the context the LLM may read, e.g. 3000",
    "max_context_tokens": "the size of the context the LLM may read, e.g. 800",
}
#: The largest budgets, in the user's units (the search's arrays grow with the budget).
_LIMITS = {
    "max_context_chars": (MAX_BUDGET, "characters"),
    "max_context_tokens": (MAX_BUDGET // CHARS_PER_TOKEN, "tokens"),
}


class SegmentOptions(BaseModel):
    """The options of RSE, their defaults and their checks (see the module docstring)."""

    model_config = ConfigDict(validate_assignment=True, arbitrary_types_allowed=True)

    preset: str = Field(
        default="balanced",
        description="dsRAG preset giving the defaults: 'balanced', 'precision' or 'find_all'.",
    )
    max_length: int | None = Field(default=None, description="Most chunks in one segment.")
    overall_max_length: int | None = Field(
        default=None, description="Most chunks over all segments returned."
    )
    minimum_value: float | None = Field(
        default=None,
        description=(
            "A segment's least worth: a segment the search finds worth less is not returned "
            "(None: its preset's; 1.0 under a context budget, where weaker hits come in by the "
            "fill, in rank order)."
        ),
    )
    irrelevant_chunk_penalty: float | None = Field(
        default=None,
        description=(
            "Subtracted from every chunk's value (a chunk nobody retrieved is worth minus this), "
            "so it prices each weak chunk a segment runs through: it sets how long segments "
            "grow. In dsRAG's experience, in chunks per segment: about 0.05 lets segments run "
            "very long (20 to 50); 0.1 long (10 to 20); 0.2 medium (4 to 10: the presets' 0.18 "
            "and 0.2 sit here); 0.3 short (2 to 6); 0.4 and above, very short (1 to 3: little "
            "more than the hits). Higher also means fewer segments; 0 lets segments grow to "
            "max_length through unretrieved chunks. None: the preset's."
        ),
    )
    decay_rate: float | None = Field(
        default=None, description="Rank decay: a hit at rank r is worth exp(-r / decay_rate)."
    )
    top_k_for_document_selection: int | None = Field(
        default=None, description="Only documents of the top-k hits (by best rank) are searched."
    )
    calibration: Any = Field(
        default=None,
        description=(
            "How node scores become relevance in [0, 1]: 'spread' (per query: best hit 1, median "
            "hit 0; no range to tune per embedder), 'zscore' (per query: the mean hit 0, two "
            "standard deviations above it 1), 'rank' (every hit 0.8: rank decay alone, dsRAG's "
            "ignore_absolute_relevance), 'cosine_adaptive' (linear over cosine_range, "
            "its top raised to the query's best score), 'cosine' (linear over the fixed "
            "cosine_range), 'raw' (as is), 'cohere' / 'voyage' (dsRAG's beta CDFs for those "
            "rerankers), or a callable on a numpy array (one query's scores). None (default): "
            "'spread' under a context budget, 'cosine_adaptive' without one."
        ),
    )
    cosine_range: tuple[float, float] = Field(
        default=DEFAULT_COSINE_RANGE,
        description=(
            "Similarities at or below the first count 0, at or above the second 1 ('cosine'); "
            "'cosine_adaptive' maps the query's best score to 1 when it is above the second."
        ),
    )
    chunk_length_adjustment: bool = Field(
        default=False,
        description="Scale retrieved chunks' values by max(len, 700) / 700 characters (dsRAG).",
    )
    output: Literal["segments", "chunks"] = Field(
        default="segments",
        description="'segments': one node per segment; 'chunks': the member chunks in order.",
    )
    on_unplaceable: Literal["warn", "raise"] = Field(
        default="warn",
        description=(
            "Nodes RSE cannot place (no source document, or nothing that orders them): pass "
            "through after the segments with a warning, or raise."
        ),
    )
    max_document_chunks: int = Field(
        default=20_000,
        description="Most nodes read back per document when the order must be read from the store.",
    )
    max_context_chars: int | None = Field(
        default=None,
        description=(
            "Most characters the returned nodes hand the LLM (segment text with the overlap cut, "
            "each segment's header once). Set, the search maximises value within it and fills "
            "what is left with the best remaining hits; None keeps dsRAG's chunk counts."
        ),
    )
    keep_top_hits: int = Field(
        default=1,
        ge=0,
        strict=True,
        description=(
            "Under a context budget: the best this-many hits are always in the context (as far "
            "as they fit together), and the segments worth most are chosen among those that "
            "hold them. 0: the search alone decides. Default 1: a segment of neighbours never "
            "displaces the best hit."
        ),
    )
    partial_fill: bool = Field(
        default=True,
        description=(
            "Under a budget, when no remaining hit fits whole: part of the best one (at least 100 "
            "characters, cut at a word boundary, no overlap given twice) fills what is left, "
            "marked `segment_partial`. False: only whole chunks."
        ),
    )
    max_context_tokens: int | None = Field(
        default=None, description="The same budget in tokens, counted with `tokenizer`."
    )
    segment_headers: bool = Field(
        default=True,
        description=(
            "Show each segment's header (its document and sections, from ContextualHeaders) "
            "before its text, counted in a budget. False: the text only, every character of a "
            "budget for evidence (the headers still served retrieval, embedded with the chunks)."
        ),
    )
    tokenizer: Any = Field(
        default=None,
        exclude=True,
        description=(
            "Callable text -> tokens (a sequence) for max_context_tokens; default: one token per "
            "4 characters, rounded up."
        ),
    )
    verbose: bool = Field(default=False, description="Print a readable trace.")

    # -- option checks: pydantic runs them at construction and on every assignment ----------
    @field_validator(*_COUNTS, mode="wrap")
    @classmethod
    def _count(cls, value: Any, read: Callable[[Any], Any], info: ValidationInfo) -> Any:
        name = str(info.field_name)
        if not isinstance(value, bool):  # pydantic would read True as 1
            value = read(value)
        if value is None:
            return value
        if isinstance(value, bool) or value < 1:
            raise ValueError(
                f"{name} must be a positive integer, got {value!r}: pass {_COUNTS[name]}"
            )
        if name in _LIMITS:
            limit, unit = _LIMITS[name]
            if value > limit:
                raise ValueError(
                    f"{name} must be at most {limit:,} {unit}, got {value:,}: pass a smaller "
                    "budget (the memory of the search grows with it)"
                )
        return value

    @field_validator("preset", "calibration")
    @classmethod
    def _known_name(cls, value: Any, info: ValidationInfo) -> Any:
        if info.field_name == "preset":
            get_preset(value)  # a bad name fails now, not at the first query
        elif value is not None:
            check_calibration(value)
        return value

    @field_validator("minimum_value", "irrelevant_chunk_penalty", "decay_rate")
    @classmethod
    def _finite(cls, value: float | None, info: ValidationInfo) -> float | None:
        require_finite(cls.__name__, **{str(info.field_name): value})
        return value

    @field_validator("cosine_range")
    @classmethod
    def _cosine_range(cls, value: tuple[float, float]) -> tuple[float, float]:
        low, high = value
        require_finite(cls.__name__, **{"cosine_range[0]": low, "cosine_range[1]": high})
        if not high > low:
            raise ValueError(
                f"cosine_range must be (low, high) with high > low, got {value}: e.g. (0.1, 0.5)"
            )
        return value

    @field_validator("output", "max_context_chars", "max_context_tokens", "tokenizer")
    @classmethod
    def _budget(cls, value: Any, info: ValidationInfo) -> Any:
        # Checked against the options already set: on assignment all of them, at construction
        # those defined before (output, the budgets, tokenizer: each pair is seen once).
        given = {**info.data, str(info.field_name): value}
        tokenizer = given.get("tokenizer")
        if tokenizer is not None and not callable(tokenizer):
            raise ValueError(
                f"tokenizer must be a callable text -> tokens, got {type(tokenizer).__name__}: "
                "pass e.g. tiktoken.get_encoding('cl100k_base').encode"
            )
        # At construction, a tokenizer is checked before max_context_tokens is seen (absent):
        # only a limit known to be None is missing.
        tokens_unset = "max_context_tokens" in given and given["max_context_tokens"] is None
        if tokenizer is not None and tokens_unset:
            raise ValueError(
                "tokenizer counts max_context_tokens, which is not set: pass "
                "max_context_tokens=N with it (max_context_chars counts characters), or drop "
                "tokenizer"
            )
        budget_set = (
            given.get("max_context_chars") is not None
            or given.get("max_context_tokens") is not None
        )
        if budget_set and given.get("output", "segments") != "segments":
            raise ValueError(
                "a context budget (max_context_chars / max_context_tokens) needs "
                "output='segments': member chunks repeat their overlap, which the budget cuts. "
                "Pass output='segments' (the default), or leave the budget out"
            )
        return value

    @property
    def budgeted(self) -> bool:
        """Whether a context budget is set (the segments are then sized to it)."""
        return self.max_context_chars is not None or self.max_context_tokens is not None

    def _param(self, name: str) -> Any:
        """Option ``name`` as given, else its preset's value."""
        value = getattr(self, name)
        return getattr(get_preset(self.preset), name) if value is None else value
