"""Critic prompts as llama.cpp token ids, fitted to the context, and label token ids.

Three jobs the llama.cpp backend needs before it can decode:

* **tokenize a prompt** exactly as llama.cpp would tokenize the whole formatted text, except
  that only the chat markup the *template* spells becomes control tokens: a document that
  quotes ``<|im_start|>`` cannot inject a turn;
* **fit it** to the context by shortening the paragraph from its end (with a warning);
* **find each label's first-token ids** ("Yes", " Yes", "yes", " yes"), whose next-token
  probabilities are the critic's scores.
"""

from __future__ import annotations

import itertools
import logging
import re
import warnings
from collections.abc import Mapping
from typing import TYPE_CHECKING, Any

from llama_index.core.prompts import BasePromptTemplate

from llama_index.packs.self_rag_rse.critic.labels import LabelScale
from llama_index.packs.self_rag_rse.critic.prompts import VARIABLES
from llama_index.packs.self_rag_rse.llamacpp import compat
from llama_index.packs.self_rag_rse.llamacpp.chat_format import chat_formatter

if TYPE_CHECKING:
    import llama_cpp

logger = logging.getLogger(__name__)

# Private-use characters mark where each variable goes in the formatted template.
_MARK_OPEN = "\ue000"
_MARK_CLOSE = "\ue001"
_MARKER = re.compile(f"{_MARK_OPEN}(query_str|context_str|answer_str){_MARK_CLOSE}")


class PromptTokenizer:
    """Token ids of critic prompts for one llama.cpp model.

    Args:
        llama: the model.
        owner: the LlamaIndex LLM wrapping it (its ``messages_to_prompt``, ``system_prompt``), or
            the ``Llama`` itself.
        n_ctx: positions available to one sequence (prompt + generated tokens).
    """

    def __init__(self, llama: llama_cpp.Llama, owner: Any, n_ctx: int) -> None:
        self.llama = llama
        self.n_ctx = n_ctx
        self._format, self.prompt_format = chat_formatter(llama, owner)
        self._bos = int(llama.token_bos())
        self._add_bos = compat.adds_bos(llama)
        self._label_ids: dict[str, tuple[list[int], list[list[int]]]] = {}
        self._skeletons: dict[int, tuple[BasePromptTemplate, list[tuple[str, str]]]] = {}
        self._control_runs: dict[str, list[str | int]] = {}

    def _skeleton(self, template: BasePromptTemplate) -> list[tuple[str, str]]:
        """The formatted prompt as ``(variable, "")`` slots between template text pieces."""
        cached = self._skeletons.get(id(template))
        if cached is not None and cached[0] is template:
            return cached[1]
        marked = {name: f"{_MARK_OPEN}{name}{_MARK_CLOSE}" for name in VARIABLES}
        full = self._format(template, marked)
        # split() keeps the marker's group: text, variable, text, ..., text.
        pieces = [(p, "") if i % 2 else ("", p) for i, p in enumerate(_MARKER.split(full))]
        self._skeletons[id(template)] = (template, pieces)
        return pieces

    def _controls(self, text: str) -> list[str | int]:
        """Template text split into plain strings and the ids of the control tokens it spells."""
        cached = self._control_runs.get(text)
        if cached is not None:
            return cached
        ids = self.llama.tokenize(text.encode("utf-8"), add_bos=False, special=True)
        controls = {
            compat.token_text(self.llama, t): int(t)
            for t in ids
            if compat.is_control_token(self.llama, t)
        }
        runs: list[str | int] = [text]
        if controls:
            pattern = "|".join(re.escape(c) for c in sorted(controls, key=len, reverse=True))
            parts = re.split(f"({pattern})", text)  # text, control, text, ..., text
            runs = [controls[p] if i % 2 else p for i, p in enumerate(parts)]
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

    def fitted(
        self, template: BasePromptTemplate, values: dict[str, Any], max_new: int
    ) -> tuple[list[int], int]:
        """Prompt tokens, the paragraph shortened (from its end) until prompt + answer fit, and
        how many of the paragraph's tokens that left out.
        """
        tokens = self.tokens(template, values)
        limit = self.n_ctx - max_new
        paragraph = values.get("context_str")
        if len(tokens) <= limit or not paragraph:
            if len(tokens) > limit:
                raise ValueError(
                    f"prompt has {len(tokens)} tokens, {max_new} more to generate, but n_ctx is "
                    f"{self.n_ctx}: shorten the query, lower max_new_tokens or raise n_ctx"
                )
            return tokens, 0
        own = self.llama.tokenize(paragraph.encode("utf-8"), add_bos=False, special=False)
        keep = len(own) - (len(tokens) - limit)
        for margin in (0, 4, 16, 64):
            kept = max(keep - margin, 0)
            cut = self.llama.detokenize(own[:kept]).decode("utf-8", "ignore")
            tokens = self.tokens(template, {**values, "context_str": cut})
            if len(tokens) <= limit:
                message = (
                    f"paragraph truncated from {len(own)} to about {kept} tokens to fit "
                    f"n_ctx={self.n_ctx}: raise n_ctx or send shorter paragraphs"
                )
                logger.warning(message)
                warnings.warn(message, stacklevel=6)
                return tokens, len(own) - kept
        raise ValueError(
            f"prompt does not fit n_ctx={self.n_ctx} even without the paragraph: "
            "shorten the query or raise n_ctx"
        )

    def label_ids(self, scale: LabelScale) -> tuple[list[int], list[list[int]]]:
        """``(lead, ids)``: the first-token ids of each label's spellings ("Yes", " Yes", "yes",
        " yes") read after the prompt and ``lead`` (an id two labels share, or whitespace, is
        dropped). ``lead`` is empty unless a label has no id of its own and all start with the
        same whitespace tokens ("1" is "▁", "1" in a SentencePiece vocabulary without "▁1"),
        whose probability they share.
        """
        cached = self._label_ids.get(scale.name)
        if cached is None:
            cached = self._first_ids(scale, [])
            spelt = self.llama.tokenize(scale.labels[0].encode("utf-8"), add_bos=False)
            lead = list(itertools.takewhile(lambda t: not self._piece(t), spelt[:-1]))
            if not all(cached[1]) and lead:
                # A label with no id of its own: read the labels after the whitespace tokens
                # they all start with, when every label has an id there.
                after = self._first_ids(scale, lead)
                if all(after[1]):
                    cached = after
            empty = [label for label, ids in zip(scale.labels, cached[1], strict=True) if not ids]
            if empty:
                raise ValueError(
                    f"the {scale.name} labels {list(scale.labels)} do not start with distinct "
                    f"tokens for this model ({', '.join(empty)} has none of its own): use the "
                    "reflection critic, or a model whose vocabulary spells them apart"
                )
            self._label_ids[scale.name] = cached
        return cached

    def _first_ids(self, scale: LabelScale, lead: list[int]) -> tuple[list[int], list[list[int]]]:
        groups: list[set[int]] = []
        for label in scale.labels:
            ids: set[int] = set()
            for spelling in {label, " " + label, label.lower(), " " + label.lower()}:
                tokens = self.llama.tokenize(spelling.encode("utf-8"), add_bos=False, special=False)
                if tokens[: len(lead)] != lead or len(tokens) == len(lead):
                    continue
                piece = self._piece(tokens[len(lead)])
                if piece and spelling.strip().lower().startswith(piece.lower()):
                    ids.add(int(tokens[len(lead)]))
            groups.append(ids)
        shared = {t for i, g in enumerate(groups) for t in g for h in groups[i + 1 :] if t in h}
        return lead, [sorted(g - shared) for g in groups]

    def _piece(self, token: int) -> str:
        return self.llama.detokenize([token]).decode("utf-8", "ignore").strip()
