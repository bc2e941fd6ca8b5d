"""RSE's chunk values, the presets that set their knobs (dsRAG 0.5.6), and a budget's limits.

A chunk's value says how much including it is worth: positive for a chunk retrieved high and
judged relevant, ``-irrelevant_chunk_penalty`` for a chunk nobody retrieved.
:func:`~llama_index.packs.self_rag_rse.rse.segments.find_best_segments` then picks the spans with
the largest sums. A context budget sizes the answer in characters instead of chunks; the largest
budget and the characters a token is taken for live here, with the other knobs' bounds, so that
the options can check them without importing the search. Numpy only.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import overload

import numpy as np
from numpy.typing import ArrayLike, NDArray

FloatArray = NDArray[np.float64]

#: The largest context budget, in characters, the budgeted search takes in one piece: its arrays
#: hold ``budget + 1`` cells per state (:mod:`~.budget`).
MAX_BUDGET = 10_000_000

#: Characters taken for one token when no tokenizer is given (rounded up per text).
CHARS_PER_TOKEN = 4


@dataclass(frozen=True)
class RSEPreset:
    """A named bundle of RSE knobs, as in dsRAG's ``RSE_PARAMS_PRESETS``.

    - ``max_length``: longest segment, in chunks.
    - ``overall_max_length``: total chunks over all segments for a single query.
    - ``minimum_value``: a query stops contributing once its best remaining segment sums to less
      than this; higher means fewer, surer segments.
    - ``irrelevant_chunk_penalty``: subtracted from every chunk value (see :func:`chunk_value`);
      higher gives shorter segments.
    - ``overall_max_length_extension``: extra budget per additional query (see :meth:`budget`).
    - ``decay_rate``: how fast a chunk's value falls with its rank (see :func:`chunk_value`).
    - ``top_k_for_document_selection``: how many top hits per query pick the documents that form
      the meta-document.

    dsRAG's presets also switch its chunk-length adjustment on (:func:`adjust_for_length`).
    """

    max_length: int
    overall_max_length: int
    minimum_value: float
    irrelevant_chunk_penalty: float
    overall_max_length_extension: int
    decay_rate: float
    top_k_for_document_selection: int

    def budget(self, n_queries: int) -> int:
        """Overall length budget for ``n_queries`` queries, as dsRAG computes it.

        dsRAG grows ``overall_max_length`` by ``overall_max_length_extension`` for every query
        after the first; pass the result to :func:`find_best_segments`.
        """
        return self.overall_max_length + max(n_queries - 1, 0) * self.overall_max_length_extension


# Values from dsRAG 0.5.6 rse.RSE_PARAMS_PRESETS.
PRESETS: dict[str, RSEPreset] = {
    "balanced": RSEPreset(
        max_length=15,
        overall_max_length=30,
        minimum_value=0.5,
        irrelevant_chunk_penalty=0.18,
        overall_max_length_extension=5,
        decay_rate=30,
        top_k_for_document_selection=10,
    ),
    "precision": RSEPreset(
        max_length=15,
        overall_max_length=30,
        minimum_value=0.7,
        irrelevant_chunk_penalty=0.2,
        overall_max_length_extension=5,
        decay_rate=30,
        top_k_for_document_selection=10,
    ),
    "find_all": RSEPreset(
        max_length=40,
        overall_max_length=200,
        minimum_value=0.4,
        irrelevant_chunk_penalty=0.18,
        overall_max_length_extension=0,
        decay_rate=200,
        top_k_for_document_selection=200,
    ),
}


def get_preset(name: str) -> RSEPreset:
    """Return the preset called ``name``: ``"balanced"``, ``"precision"`` or ``"find_all"``.

    ``balanced`` suits most questions; ``precision`` keeps only strong segments (higher
    ``minimum_value`` and penalty); ``find_all`` gathers up to 200 chunks in segments of up to 40
    for exhaustive questions ("list every clause that ...").
    """
    try:
        return PRESETS[name]
    except KeyError:
        valid = ", ".join(repr(key) for key in PRESETS)
        raise ValueError(
            f"unknown RSE preset {name!r}: use one of {valid}, or build an RSEPreset yourself"
        ) from None


@overload
def chunk_value(
    rank: float, relevance: float, decay_rate: float = ..., irrelevant_chunk_penalty: float = ...
) -> float: ...
@overload
def chunk_value(
    rank: ArrayLike,
    relevance: ArrayLike,
    decay_rate: float = ...,
    irrelevant_chunk_penalty: float = ...,
) -> FloatArray: ...
def chunk_value(
    rank: ArrayLike,
    relevance: ArrayLike,
    decay_rate: float = 30,
    irrelevant_chunk_penalty: float = 0.18,
) -> float | FloatArray:
    """Value of a chunk for RSE: ``exp(-rank / decay_rate) * relevance - irrelevant_chunk_penalty``.

    - ``rank``: 0-based position of the chunk in the (reranked) results. A chunk that was not
      retrieved has no rank: dsRAG uses rank 1000 and relevance 0, which makes its value exactly
      ``-irrelevant_chunk_penalty`` (``rank=np.inf`` does the same).
    - ``relevance``: the chunk's absolute relevance in [0, 1], e.g. a calibrated reranker score
      (see ``calibration.py``). It matters as much as the rank: two chunks ranked alike but scored
      0.9 and 0.3 get very different values.
    - ``decay_rate``: larger means rank matters less (dsRAG presets: 30, or 200 for ``find_all``).
    - ``irrelevant_chunk_penalty``: the price of including a chunk. A chunk only pays for itself
      when ``exp(-rank / decay_rate) * relevance`` exceeds it, and every weak chunk inside a segment
      costs this much, so a larger penalty gives shorter and fewer segments. dsRAG's rule of thumb:
      0.05 gives segments of 20-50 chunks, 0.1 of 10-20, 0.2 of 4-10, 0.3 of 2-6 and 0.4 of 1-3.

    Scalars give a float, arrays (broadcast against each other) give a float64 array.
    """
    if not decay_rate > 0:
        raise ValueError(f"decay_rate must be > 0, got {decay_rate!r}: dsRAG uses 30 (or 200)")
    rank_arr = np.asarray(rank, dtype=np.float64)
    relevance_arr = np.asarray(relevance, dtype=np.float64)
    value = np.exp(-rank_arr / decay_rate) * relevance_arr - irrelevant_chunk_penalty
    if value.ndim == 0:
        return float(value)
    return value


@overload
def adjust_for_length(values: float, lengths: float, reference_length: float = ...) -> float: ...
@overload
def adjust_for_length(
    values: ArrayLike, lengths: ArrayLike, reference_length: float = ...
) -> FloatArray: ...
def adjust_for_length(
    values: ArrayLike, lengths: ArrayLike, reference_length: float = 700
) -> float | FloatArray:
    """Scale chunk values by chunk length: ``value * max(length, reference) / reference``.

    dsRAG's optional length adjustment: a chunk longer than ``reference_length`` characters counts
    proportionally more, shorter chunks are left alone (they are never scaled down). Negative
    values scale too, so a long irrelevant chunk costs more than a short one. dsRAG's reference is
    700 characters, the average chunk when chunks are capped at 800; set it to your own average
    chunk length. Pass length 0 for chunks whose length is unknown (dsRAG does so for chunks that
    were not retrieved): they are left unscaled.
    """
    if not reference_length > 0:
        raise ValueError(
            f"reference_length must be > 0, got {reference_length!r}: use your average chunk "
            "length in characters (dsRAG uses 700)"
        )
    values_arr = np.asarray(values, dtype=np.float64)
    lengths_arr = np.asarray(lengths, dtype=np.float64)
    if values_arr.shape != lengths_arr.shape:
        raise ValueError(
            f"values and lengths must have the same shape, got {values_arr.shape} and "
            f"{lengths_arr.shape}: pass one length per chunk value"
        )
    # Ratio first, then multiply: the same rounding as dsRAG, so values agree bit for bit.
    adjusted = values_arr * (np.maximum(lengths_arr, reference_length) / reference_length)
    if adjusted.ndim == 0:
        return float(adjusted)
    return adjusted
