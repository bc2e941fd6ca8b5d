"""Draw chunk values along each document with the chosen segments shaded.

Useful to see what ``irrelevant_chunk_penalty`` does: raise it and the bars sink, the shaded
spans shrink. Needs matplotlib (``pip install "llama-index-packs-self-rag-rse[plot]"``). The
figure is drawn on its own Agg canvas, never through pyplot, so the caller's backend and open
figures are left alone.
"""

from __future__ import annotations

from collections.abc import Sequence
from pathlib import Path
from typing import TYPE_CHECKING, Any

import numpy as np

from llama_index.packs.self_rag_rse.common.optional import optional_import

if TYPE_CHECKING:
    from llama_index.packs.self_rag_rse.rse.types import SegmentExtraction


def plot_segments(
    extraction: SegmentExtraction | None = None,
    path: str | Path = "segments.png",
    *,
    values: Sequence[float] | None = None,
    segments: Sequence[tuple[int, int]] | None = None,
    document_splits: Sequence[int] | None = None,
    title: str | None = None,
) -> Path:
    """Write a PNG of chunk values (bars) with the extracted segments shaded; return its path.

    Pass either the :class:`~llama_index.packs.self_rag_rse.SegmentExtraction` returned by
    ``RelevantSegmentPostprocessor.extract(nodes)``, or the raw ``values`` / ``segments`` /
    ``document_splits`` that ``find_best_segments`` took and returned (segment ends exclusive).
    """
    figure_module: Any = optional_import("matplotlib.figure", "plot_segments")
    agg: Any = optional_import("matplotlib.backends.backend_agg", "plot_segments")

    labels: list[str] = []
    if extraction is not None:
        values = list(extraction.values)
        document_splits = extraction.document_splits
        found = (extraction.offsets(segment) for segment in extraction.segments)
        segments = [span for span in found if span is not None]
        labels = [f"{r.doc_id[:16]} @{r.positions[0]}" for r in extraction.regions]
    if values is None:
        raise ValueError(
            "plot_segments got nothing to plot: pass a SegmentExtraction or values=... "
            "(rse.extract(nodes) gives the extraction)"
        )
    data = np.asarray(values, dtype=float)
    splits = list(document_splits) if document_splits else [len(data)]

    fig = figure_module.Figure(figsize=(max(6.0, min(24.0, len(data) * 0.12)), 3.2))
    agg.FigureCanvasAgg(fig)  # attaches itself to the figure: savefig renders with Agg
    ax = fig.add_subplot()
    ax.bar(np.arange(len(data)), data, width=0.85, color=np.where(data >= 0, "#2b7bba", "#c44e52"))
    for start, end in segments or []:
        ax.axvspan(start - 0.5, end - 0.5, color="#f2c14e", alpha=0.35, lw=0)
    for split in splits[:-1]:
        ax.axvline(split - 0.5, color="black", lw=0.8, ls="--")
    for i, label in enumerate(labels):
        ax.text([0, *splits][i], ax.get_ylim()[1], label, fontsize=7, va="top")
    ax.axhline(0, color="black", lw=0.6)
    ax.set_xlabel("chunk (documents laid end to end; dashed lines split documents)")
    ax.set_ylabel("chunk value")
    ax.set_title(title or "Relevant segment extraction: values and chosen segments (shaded)")
    fig.tight_layout()
    out = Path(path)
    fig.savefig(out, dpi=110)
    return out
