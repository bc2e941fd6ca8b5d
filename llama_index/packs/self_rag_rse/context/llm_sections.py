"""The LLM sectioning strategy: numbered lines in, titled sections out, window by window.

Each window of a document's lines goes to the LLM through LlamaIndex structured output
(``llm.astructured_predict(SectionPartition, ...)``: function calling where the model supports
it, JSON parsed into the Pydantic model otherwise). Every answer is checked and repaired by
:mod:`~llama_index.packs.self_rag_rse.context.partition`; windows are stitched so a section cut by
a window's end is read again whole by the next window. Windows run one after another (each
starts where the previous one's last section began); documents run concurrently.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any

from llama_index.core.bridge.pydantic import BaseModel, Field
from llama_index.core.output_parsers.base import OutputParserException
from llama_index.core.prompts import BasePromptTemplate

from llama_index.packs.self_rag_rse.context.partition import (
    PartitionError,
    plan_next_window,
    render_window,
    repair_partition,
    window_end,
)
from llama_index.packs.self_rag_rse.context.sections import LineIndex, SectionStart


class SectionSpan(BaseModel):
    """One section of the numbered lines."""

    title: str = Field(description="A short title saying what the section is about.")
    start_line: int = Field(description="Number of the section's first line.")
    end_line: int = Field(description="Number of the section's last line.")


class SectionPartition(BaseModel):
    """The sections of the numbered lines, in order, together covering every line once."""

    sections: list[SectionSpan] = Field(description="The sections, in order of their lines.")


@dataclass
class LLMSectioning:
    """What the LLM strategy found for one document: section starts, LLM calls made, windows
    whose answer was rejected (with the reason) and repairs made to accepted ones.
    """

    starts: list[SectionStart]
    calls: int = 0
    rejected: list[str] = field(default_factory=list)
    repairs: list[str] = field(default_factory=list)


async def llm_section_starts(
    index: LineIndex,
    llm: Any,
    prompt: BasePromptTemplate,
    *,
    window_chars: int,
    max_line_chars: int,
    min_section_lines: int,
    on_invalid: str,
    fallback: Callable[[int, int], list[SectionStart]],
    name: str,
) -> LLMSectioning:
    """Section starts for the document behind ``index``, asked of ``llm`` window by window.

    A window whose answer cannot be parsed or repaired raises :class:`PartitionError` naming the
    document and the window when ``on_invalid == "raise"``; with ``"fallback"`` that window takes
    ``fallback(first, last)`` (the structural sections inside it) and the reason is recorded.
    """
    result = LLMSectioning(starts=[])
    first: int | None = 0
    while first is not None:
        last = window_end(index, first, window_chars, max_line_chars)
        where = f"{name}, window lines {first}-{last}"
        lines = render_window(index, first, last, max_line_chars)
        if not lines:
            starts = [SectionStart(first, "")]
        else:
            try:
                result.calls += 1
                answer = await llm.astructured_predict(
                    SectionPartition, prompt, first=first, last=last, lines=lines
                )
                if not isinstance(answer, SectionPartition):
                    raise PartitionError(
                        f"{where}: the LLM's structured answer was a {type(answer).__name__}, not "
                        "a SectionPartition"
                    )
                proposed = [(s.title, s.start_line, s.end_line) for s in answer.sections]
                repaired = repair_partition(
                    proposed, index, first, last, min_lines=min_section_lines, window_name=where
                )
                starts = repaired.starts
                result.repairs.extend(f"{where}: {r}" for r in repaired.repairs)
            except (PartitionError, OutputParserException, ValueError, TypeError) as error:
                reason = (
                    str(error) if isinstance(error, PartitionError) else _unparsed(where, error)
                )
                if on_invalid == "raise":
                    raise PartitionError(
                        f"{reason}. Fix: use a stronger model, smaller windows (window_chars), or "
                        "on_invalid='fallback' to use the document's headings for such windows"
                    ) from error
                result.rejected.append(reason)
                starts = fallback(first, last) or [SectionStart(first, "")]
                if starts[0].line != first:
                    starts.insert(0, SectionStart(first, ""))
        kept, first = plan_next_window(starts, first, last, len(index))
        result.starts.extend(kept)
    return result


def _unparsed(where: str, error: BaseException) -> str:
    detail = " ".join(str(error).split())
    if len(detail) > 300:
        detail = detail[:300] + "…"
    return f"{where}: the LLM's answer is not a valid section partition ({detail})"
