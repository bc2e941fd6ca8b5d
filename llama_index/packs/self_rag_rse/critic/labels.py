"""How the prompted critic reads a reply: label scales, label probabilities, tolerant parsing.

Each judgement (retrieve?, relevant?, supported?, useful?) has a :class:`LabelScale`: the words
the prompt asks for and the score each stands for, on the same scales as Self-RAG's reflection
scores. With token log-probs the score is the expectation over the labels; without them
:func:`parse_reply` reads whatever a small model wrote (JSON, fences, synonyms, numbers in words,
refusals) and says how it read it. Plain Python: no LlamaIndex import.
"""

from __future__ import annotations

import json
import math
import numbers
import re
from collections.abc import Sequence
from dataclasses import dataclass
from typing import Any

from llama_index.packs.self_rag_rse.critic.reflection import (
    MISSING_LOGPROB,
    UTILITY_WEIGHTS,
    logsumexp,
)


@dataclass(frozen=True)
class LabelScale:
    """The reply vocabulary of one judgement and the score each reply stands for.

    ``labels`` are the words the prompt asks for; their first tokens are what the log-prob path
    reads, so they must start with distinct tokens. ``values[i]`` is the score of ``labels[i]``;
    with label probabilities the score is the expectation Σ values_i·p_i. ``synonyms`` map other
    words a model may write (lower case) to a label index. ``number_range`` accepts a numeric reply
    in ``[lo, hi]``, mapped linearly onto ``[min(values), max(values)]``. ``fallback`` is the score
    of a reply that cannot be read: neutral, so it neither promotes nor buries a paragraph.
    """

    name: str
    labels: tuple[str, ...]
    values: tuple[float, ...]
    synonyms: tuple[tuple[str, int], ...] = ()
    number_range: tuple[float, float] | None = None
    fallback: float = 0.0

    def expected_value(self, label_logprobs: Sequence[float]) -> float:
        """Σ values_i·p_i with p normalised over the labels only (in log space, no underflow)."""
        probs = normalised_probabilities(label_logprobs)
        return float(sum(v * p for v, p in zip(self.values, probs, strict=True)))

    def value_of_number(self, number: float) -> float | None:
        """The score of a numeric reply, or ``None`` when it lies outside ``number_range``."""
        if self.number_range is None:
            return None
        lo, hi = self.number_range
        if not lo <= number <= hi:
            return None
        lowest, highest = min(self.values), max(self.values)
        return lowest + (number - lo) / (hi - lo) * (highest - lowest)


def _synonyms(*per_label: str) -> tuple[tuple[str, int], ...]:
    """``(phrase, label index)`` pairs from one ``|``-separated string of phrases per label."""
    return tuple((p, i) for i, phrases in enumerate(per_label) for p in phrases.split("|") if p)


#: Gate: 1.0 for "retrieve". An unreadable verdict retrieves (evidence is the safe default).
RETRIEVAL_SCALE = LabelScale(
    name="retrieval",
    labels=("Yes", "No"),
    values=(1.0, 0.0),
    synonyms=_synonyms("true", "false|not needed|no need|unnecessary"),
    number_range=(0.0, 1.0),
    fallback=1.0,
)
#: IsREL: p(Yes), in [0, 1]; unreadable replies score 0.5.
RELEVANCE_SCALE = LabelScale(
    name="relevance",
    labels=("Yes", "No"),
    values=(1.0, 0.0),
    synonyms=_synonyms("true|relevant", "false|irrelevant|not relevant|isn't relevant|unrelated"),
    number_range=(0.0, 1.0),
    fallback=0.5,
)
#: IsSUP: p(Yes) + 0.5·p(Partly), in [0, 1]; unreadable replies score 0.5.
SUPPORT_SCALE = LabelScale(
    name="support",
    labels=("Yes", "Partly", "No"),
    values=(1.0, 0.5, 0.0),
    synonyms=_synonyms(
        "true|fully|full|fully supported|supported|completely|entirely",
        "partially|partial|partially supported|somewhat|not fully",
        "false|not supported|unsupported|no support|not support|contradicts|contradictory"
        "|contradicted",
    ),
    number_range=(0.0, 1.0),
    fallback=0.5,
)
#: IsUSE: Σ w_k·p(k) with w = (-1, -0.5, 0, 0.5, 1), in [-1, 1]; unreadable replies score 0.
UTILITY_SCALE = LabelScale(
    name="utility",
    labels=("1", "2", "3", "4", "5"),
    values=UTILITY_WEIGHTS,
    number_range=(1.0, 5.0),
    fallback=0.0,
)


#: How far above 0 a log-prob may lie and still read as 0: a probability of 1 rounded up (a
#: float32 softmax, a server printing decimals). Anything higher is no log-prob.
LOGPROB_ROUNDING = 1e-4


class InvalidLogprob(ValueError):
    """A number given as a log-prob that no probability has (NaN, ±inf, above 0)."""


def checked_logprob(value: Any) -> float:
    """``value`` as a log-prob from outside (a server, an LLM): a finite number <= 0.

    A positive value up to :data:`LOGPROB_ROUNDING` is rounding and reads as 0. Anything else
    (NaN, ±inf, a larger positive number, a non-number) raises :class:`InvalidLogprob`: softmax
    would turn it into a NaN score or a probability above 1, and NaN outranks every real score.
    """
    if isinstance(value, bool) or not isinstance(value, numbers.Real):
        raise InvalidLogprob(f"{value!r} is not a log-prob (a finite number <= 0)")
    number = float(value)
    if not math.isfinite(number) or number > LOGPROB_ROUNDING:
        raise InvalidLogprob(f"{number!r} is not a log-prob (a finite number <= 0)")
    return min(number, 0.0)


def normalised_probabilities(label_logprobs: Sequence[float]) -> list[float]:
    """Softmax of ``label_logprobs`` among themselves; uniform when every label has no mass.

    Raises :class:`InvalidLogprob` on NaN or +inf, which have no softmax (``max`` with a NaN
    even depends on the order).
    """
    values = [float(v) for v in label_logprobs]
    if any(math.isnan(v) or v == math.inf for v in values):
        raise InvalidLogprob(f"label log-probs {values} hold NaN or +inf: no probabilities")
    top = max(values)
    if top == -math.inf:
        return [1.0 / len(values)] * len(values)
    weights = [math.exp(v - top) for v in values]
    total = sum(weights)
    return [w / total for w in weights]


@dataclass(frozen=True)
class Reading:
    """How one reply was read: ``score`` is ``None`` when it could not be, and ``note`` says why."""

    score: float | None
    method: str  # "logprobs" | "parsed" | "fallback"
    note: str | None = None


_FENCE = re.compile(r"```[A-Za-z0-9_-]*\s*(.*?)```", re.S)
_WORDS = ("zero", "one", "two", "three", "four", "five", "six", "seven", "eight", "nine", "ten")
_NUMBER_WORDS = {word: n for n, word in enumerate(_WORDS)}
_NUMBER = re.compile(
    r"(?<![\w.])(?P<num>\d+(?:\.\d+)?|" + "|".join(_NUMBER_WORDS) + r")"
    r"(?:\s*(?:/|out\s+of)\s*(?P<den>\d+(?:\.\d+)?|" + "|".join(_NUMBER_WORDS) + r"))?"
    r"(?![\w])",
    re.I,
)
_REFUSAL = re.compile(
    r"\b(?:i\s+can(?:no|')?t|i\s+cannot|i'?m\s+sorry|i\s+am\s+sorry|i\s+am\s+unable|"
    r"i'?m\s+unable|i\s+(?:do\s+not|don'?t)\s+know|as\s+an\s+ai|unable\s+to\s+(?:determine|"
    r"answer|say|judge|assess)|cannot\s+(?:determine|answer|say|judge|assess))\b",
    re.I,
)
#: JSON keys that most likely hold the verdict, in order of preference: generic names first,
#: then the names of the judgements.
_VERDICT_KEYS = (
    *("score", "label", "answer", "verdict", "rating", "result", "value"),
    *("relevant", "relevance", "supported", "support"),
    *("utility", "useful", "retrieve", "retrieval"),
)
_KEY_VALUE = re.compile(
    r"[\"']?(?P<key>[A-Za-z_][\w ]*?)[\"']?\s*:\s*(?P<value>\"[^\"]*\"?|'[^']*'?|[^,}\n]+)"
)


def parse_reply(text: str, scale: LabelScale) -> Reading:
    """Read a model's reply to one judgement question, as tolerantly as is safe.

    Tries, in order: a JSON object (inside code fences or prose, repaired if malformed, or as
    bare ``key: value`` pairs), then the earliest label word, synonym or number in the text
    (``"Yes."``, ``"**No**"``, ``"not relevant"``, ``"four"``, ``"4/5"``). A refusal or a reply
    that only lists the options gives ``score=None`` with a note; so does a number outside the
    scale's range. ``method`` is ``"parsed"`` on success and ``"fallback"`` otherwise (the caller
    then uses ``scale.fallback``).
    """
    stripped = text.strip()
    if not stripped:
        return Reading(None, "fallback", "empty reply")
    fenced = _FENCE.search(stripped)
    body = fenced.group(1) if fenced else stripped.replace("```", "")

    found_object, values = _json_candidates(body)
    for value in values:
        reading = _read_value(value, scale)
        if reading.score is not None or reading.note:
            return reading
    if found_object and values:
        # Scanning the raw JSON would read its keys ("relevant": ...) as verdicts.
        return Reading(None, "fallback", f"no label in JSON reply: {_clip(stripped)}")

    if _REFUSAL.search(body):
        return Reading(None, "fallback", f"refusal: {_clip(stripped)}")
    return _scan_text(body, scale, original=stripped)


def label_logprobs_from_top(
    positions: Sequence[Sequence[tuple[str, float]]],
    scale: LabelScale,
    missing: float = MISSING_LOGPROB,
) -> list[float] | None:
    """Per-label log-probs at the first generated position whose top list names a label.

    ``positions[i]`` lists ``(token_text, logprob)`` pairs at generated position ``i`` (an
    OpenAI-style ``top_logprobs`` list). A token counts for a label when its stripped,
    lower-cased text is a non-empty prefix of that label's word and of no other label's
    (``"Yes"``, ``" yes"``, ``"Part"``); several tokens of one label add up. A label absent there
    gets ``missing``. Returns ``None`` when no position names any label.

    Raises :class:`InvalidLogprob`, naming the position and token, when a label's log-prob is
    not a finite number <= 0 (see :func:`checked_logprob`).
    """
    words = [label.lower() for label in scale.labels]
    for position, entries in enumerate(positions):
        per_label: list[list[float]] = [[] for _ in words]
        for token, logprob in entries:
            piece = token.strip().lower()
            if not piece:
                continue
            owners = [i for i, word in enumerate(words) if word.startswith(piece)]
            if len(owners) == 1:
                try:
                    per_label[owners[0]].append(checked_logprob(logprob))
                except InvalidLogprob as exc:
                    raise InvalidLogprob(f"position {position}, token {token!r}: {exc}") from None
        if any(per_label):
            return [logsumexp(lps) if lps else missing for lps in per_label]
    return None


def _clip(text: str, limit: int = 80) -> str:
    text = " ".join(text.split())
    return text if len(text) <= limit else text[: limit - 3] + "..."


def _json_candidates(body: str) -> tuple[bool, list[Any]]:
    """Whether ``body`` holds a JSON-ish object, and its values, most verdict-like first."""
    start = body.find("{")
    if start == -1:
        return False, []
    end = body.rfind("}")
    snippet = body[start : end + 1] if end > start else body[start:] + "}"
    repaired = re.sub(r",\s*}", "}", snippet.replace("'", '"'))
    repaired = re.sub(r"([{,]\s*)([A-Za-z_]\w*)\s*:", r'\1"\2":', repaired)
    for attempt in (snippet, repaired):
        try:
            obj = json.loads(attempt)
        except ValueError:
            continue
        if isinstance(obj, dict):
            return True, _order_values(list(obj.items()))
        return True, [obj]
    pairs = [
        (m.group("key").strip(), _bare_value(m.group("value")))
        for m in _KEY_VALUE.finditer(snippet.strip("{}"))
    ]
    return True, _order_values(pairs)


def _bare_value(text: str) -> Any:
    """A malformed-JSON value: a quoted string, a number, true/false, or the bare text."""
    text = text.strip()
    if text[:1] in "\"'":
        return text.strip("\"'").strip()
    lowered = text.lower()
    if lowered in ("true", "false"):
        return lowered == "true"
    try:
        return float(text)
    except ValueError:
        return text


def _order_values(pairs: list[tuple[Any, Any]]) -> list[Any]:
    def rank(pair: tuple[Any, Any]) -> int:
        key = str(pair[0]).strip().lower()
        return _VERDICT_KEYS.index(key) if key in _VERDICT_KEYS else len(_VERDICT_KEYS)

    return [value for _, value in sorted(pairs, key=rank) if value is not None]


def _read_value(value: Any, scale: LabelScale) -> Reading:
    """Interpret one JSON value: a bool, a number or a string holding a label."""
    if isinstance(value, bool):
        if scale.number_range is not None and scale.number_range[0] >= 1:
            return Reading(None, "fallback")  # true/false means nothing on a 1..5 scale
        return Reading(scale.values[0 if value else len(scale.labels) - 1], "parsed")
    if isinstance(value, int | float):
        score = scale.value_of_number(float(value))
        if score is None:
            return Reading(None, "fallback", f"number {value} outside {scale.number_range}")
        return Reading(score, "parsed")
    if isinstance(value, str) and value.strip():
        reading = _scan_text(value, scale, original=value)
        if reading.score is not None or (reading.note and reading.note.startswith("number")):
            return reading
    return Reading(None, "fallback")


def _scan_text(text: str, scale: LabelScale, original: str) -> Reading:
    """The earliest label word, synonym or number in ``text`` decides."""
    lowered = text.lower()
    label_words = [label.lower() for label in scale.labels]
    # "Yes or No", "yes/partly/no", "1, 2, 3, 4 or 5": the options repeated, none chosen.
    # ("4/5" is a rating, not a listing: digits are listed only with commas and "or".)
    alternatives = "|".join(re.escape(w) for w in sorted(label_words, key=len, reverse=True))
    separator = r",\s*or\b|,|\bor\b" + ("" if label_words[0].isdigit() else "|/")
    listing = re.compile(rf"\b(?:{alternatives})(?:\s*(?:{separator})\s*(?:{alternatives})\b)+")

    def blank(match: re.Match[str]) -> str:
        found = re.findall(rf"\b(?:{alternatives})\b", match.group(0))
        return " " * len(match.group(0)) if len(set(found)) == len(found) else match.group(0)

    lowered = listing.sub(blank, lowered)

    # Each phrase's first match and the first number: the earliest (then the longest) wins.
    found: list[tuple[int, int, Reading]] = []  # (start, -length, reading)
    phrases = [(word, i) for i, word in enumerate(label_words) if not word.isdigit()]
    for phrase, index in [*phrases, *scale.synonyms]:
        match = re.search(rf"(?<![\w']){re.escape(phrase)}(?![\w'])", lowered)
        if match:
            found.append((match.start(), -len(phrase), Reading(scale.values[index], "parsed")))
    if scale.number_range is not None and (match := _NUMBER.search(lowered)):
        number = _number(match.group("num"))
        denominator = match.group("den")
        if denominator is not None and scale.number_range[1] != _number(denominator):
            # "8/10" on a 1..5 scale: rescale the fraction onto the range.
            lo, hi = scale.number_range
            number = lo + number / max(_number(denominator), 1e-9) * (hi - lo)
        score = scale.value_of_number(number)
        reading = Reading(score, "parsed")
        if score is None:
            reading = Reading(None, "fallback", f"number {match.group(0)} outside range")
        found.append((match.start(), -len(match.group(0)), reading))
    if not found:
        if lowered.strip() == "":
            return Reading(None, "fallback", f"reply lists the options: {_clip(original)}")
        return Reading(None, "fallback", f"no label in reply: {_clip(original)}")
    return min(found, key=lambda candidate: candidate[:2])[2]


def _number(text: str) -> float:
    word = text.lower()
    return float(_NUMBER_WORDS[word]) if word in _NUMBER_WORDS else float(word)
