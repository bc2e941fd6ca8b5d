"""What completion servers send back, read into one shape: generated tokens and their log-probs.

Two wire formats carry token log-probabilities, and each server speaks one or both:

* **llama.cpp's native** ``/completion`` with ``n_probs``: every generated token with its id, its
  raw bytes, its log-prob and the ids and log-probs of the top ``n_probs`` candidates, computed
  from the raw logits (``post_sampling_probs: false``: the full-vocabulary softmax, untouched by
  the sampler). ``return_tokens: true`` adds every generated id, which matters because the server
  leaves out of ``completion_probabilities`` a token that ends inside a UTF-8 character: the ids
  tell where such gaps are.
* **OpenAI-style** ``/v1/completions`` with ``logprobs: N``: the generated tokens and per
  position a dict of the top N candidates *keyed by their decoded text* (vLLM, llama-cpp-python's
  server, OpenAI), or llama.cpp's variant of it (``logprobs.content``, a list of entries like the
  native ones). Keys are strings, so two tokens that decode alike are one key, and a token that
  decodes to "" (a CONTROL-typed Self-RAG token on llama.cpp, a special token on vLLM with
  ``skip_special_tokens``) cannot be told apart. vLLM's ``return_tokens_as_token_ids`` turns the
  keys into ``token_id:<id>``, which identifies them again.

Tokens are named by *keys* here: ``token_id:<id>`` when the server gave an id, else the decoded
text. Numbers are checked as they are read: a log-prob must be finite and <= 0 (a positive value
within float rounding reads as 0), a probability must lie in [0, 1], a count must be a positive
integer; a NaN let through would score NaN, and NaN outranks every real score. Plain Python, no
HTTP.
"""

from __future__ import annotations

import math
import re
from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass, field
from typing import Any

from llama_index.packs.self_rag_rse.critic.labels import (
    LOGPROB_ROUNDING,
    InvalidLogprob,
    checked_logprob,
)

#: Key of a token known by id (the form vLLM's ``return_tokens_as_token_ids`` uses too).
ID_PREFIX = "token_id:"
_ID_KEY = re.compile(r"^token_id:(-?\d+)$")
#: A UTF-8 character spans at most 4 bytes: at most 3 tokens in a row can end inside one.
_MAX_GAP = 3


class MalformedBody(ValueError):
    """A response body that does not have the fields the wire format promises."""


def id_key(token: int) -> str:
    """The key of token ``token``."""
    return f"{ID_PREFIX}{int(token)}"


def key_id(key: str) -> int | None:
    """The id inside an id key, or ``None`` for a text key."""
    match = _ID_KEY.match(key)
    return int(match.group(1)) if match else None


@dataclass
class Position:
    """One generated position as the server reported it.

    ``top`` maps candidate keys to log-probs; ``None`` (with ``logprob``) when the server
    reported nothing for this position. ``pieces`` maps candidate keys to their raw bytes
    (llama.cpp only). ``offset`` is where the token's text starts (OpenAI's ``text_offset``).
    """

    key: str
    logprob: float | None = None
    top: dict[str, float] | None = None
    pieces: dict[str, bytes] = field(default_factory=dict)
    offset: int | None = None

    @property
    def piece(self) -> bytes | None:
        """The generated token's raw bytes, when the server sent them."""
        return self.pieces.get(self.key)

    @property
    def reported(self) -> bool:
        """Whether the server sent log-probs for this position."""
        return self.top is not None and self.logprob is not None


@dataclass
class Completion:
    """One completion: its positions, the text and whether it ended on end-of-generation;
    ``finished``: whether the server said the answer ends here (a streamed one's last event).
    """

    positions: list[Position]
    text: str
    stopped: bool
    extra: dict[str, Any] = field(default_factory=dict)
    finished: bool = True

    @property
    def keys(self) -> list[str]:
        """The generated tokens' keys, in order."""
        return [p.key for p in self.positions]

    def extend(self, chunk: Completion) -> None:
        """Append the next piece of a streamed completion."""
        self.positions.extend(chunk.positions)
        self.text += chunk.text
        self.stopped = self.stopped or chunk.stopped
        self.finished = chunk.finished
        self.extra.update({k: v for k, v in chunk.extra.items() if v is not None})


def _require(body: Any, name: str, kind: type | tuple[type, ...]) -> Any:
    if not isinstance(body, Mapping) or name not in body:
        raise MalformedBody(f"missing field {name!r}")
    value = body[name]
    if not isinstance(value, kind):
        raise MalformedBody(f"field {name!r} is {type(value).__name__}, not {kind}")
    return value


def _first_choice(body: Any) -> Mapping[str, Any]:
    choices = _require(body, "choices", list)
    if not choices or not isinstance(choices[0], Mapping):
        raise MalformedBody("'choices' is empty")
    return choices[0]


def _logprob(value: Any, position: int, what: str) -> float:
    """A log-prob the server sent at generated ``position`` (see the module docs)."""
    try:
        return checked_logprob(value)
    except InvalidLogprob as exc:
        raise MalformedBody(f"position {position}: {what}: {exc}") from None


def _probability(value: Any, position: int, what: str) -> float:
    """A probability the server sent: in [0, 1] (just above 1 is rounding and reads as 1)."""
    if isinstance(value, bool) or not isinstance(value, int | float):
        raise MalformedBody(f"position {position}: {what} {value!r} is not a probability")
    if not 0.0 <= value <= 1.0 + LOGPROB_ROUNDING:
        raise MalformedBody(
            f"position {position}: {what} {value!r} is not a probability (a number in [0, 1])"
        )
    return min(float(value), 1.0)


def positive_count(value: Any) -> int | None:
    """A size the server reported (``n_ctx``, ``n_vocab``) when it is a positive integer, else
    ``None`` (``True``, ``0``, ``-1`` or ``2.5`` are no sizes).
    """
    if isinstance(value, bool) or not isinstance(value, int) or value < 1:
        return None
    return value


def _entry_top(
    entry: Mapping[str, Any], with_ids: bool, position: int
) -> tuple[dict[str, float], dict[str, bytes]]:
    """Candidates of one llama.cpp-style entry: key -> log-prob, key -> raw bytes."""
    top: dict[str, float] = {}
    pieces: dict[str, bytes] = {}
    for cand in _require(entry, "top_logprobs", list):
        if not isinstance(cand, Mapping):
            raise MalformedBody("top_logprobs holds a non-object")
        if with_ids and "id" in cand:
            key = id_key(_token_id(cand["id"], position))
        else:
            key = str(cand.get("token", ""))
        top.setdefault(key, _logprob(cand.get("logprob"), position, f"candidate {key!r}"))
        raw = _bytes(cand.get("bytes"), position, key)
        if raw is not None:
            pieces.setdefault(key, raw)
    return top, pieces


def _bytes(raw: Any, position: int, key: str) -> bytes | None:
    """A token's raw bytes as sent (``None`` when not sent): unsigned (0..255) or, from a
    signed char, -128..127.
    """
    if not isinstance(raw, list):
        return None
    if not all(isinstance(b, int) and not isinstance(b, bool) and -128 <= b < 256 for b in raw):
        raise MalformedBody(f"position {position}: candidate {key!r} has bytes {raw!r}")
    return bytes(b & 0xFF for b in raw)


def _token_id(value: Any, position: int) -> int:
    if isinstance(value, bool) or not isinstance(value, int):
        raise MalformedBody(f"position {position}: token id {value!r} is not an integer")
    return value


def parse_native(body: Any) -> Completion:
    """Read a llama.cpp ``/completion`` response (``n_probs`` > 0, ``return_tokens: true``).

    Positions follow the generated ids; one the server did not report (a token ending inside a
    UTF-8 character) has no ``top``/``logprob`` and the caller fetches it separately.
    """
    tokens = _require(body, "tokens", list)
    entries = body.get("completion_probabilities") or []
    if not isinstance(entries, list):
        raise MalformedBody("field 'completion_probabilities' is not a list")
    positions: list[Position] = []
    k = 0
    for i, raw in enumerate(tokens):
        if isinstance(raw, bool) or not isinstance(raw, int):
            raise MalformedBody(f"generated token {raw!r} is not an id")
        position = Position(id_key(raw))
        if k < len(entries):
            entry = entries[k]
            if not isinstance(entry, Mapping) or "id" not in entry:
                raise MalformedBody("a completion_probabilities entry has no 'id'")
            if entry["id"] == raw:
                position.top, position.pieces = _entry_top(entry, with_ids=True, position=i)
                position.logprob = _logprob(entry.get("logprob"), i, "the token's logprob")
                k += 1
        positions.append(position)
    if k != len(entries):
        raise MalformedBody(
            f"{len(entries)} completion_probabilities entries do not follow the "
            f"{len(tokens)} generated tokens"
        )
    run = 0  # unreported positions in a row
    for position in positions:
        run = 0 if position.reported else run + 1
        if run > _MAX_GAP:
            raise MalformedBody(
                f"{run} tokens in a row without completion_probabilities: the server ignored "
                "n_probs"
            )
    text = body.get("content", "")
    predicted = body.get("tokens_predicted")
    return Completion(
        positions=positions,
        text=text if isinstance(text, str) else "",
        stopped=body.get("stop_type") == "eos",
        extra={"tokens_predicted": predicted if isinstance(predicted, int) else None},
        finished=body.get("stop") is not False,  # a streamed event says whether it is the last
    )


class StreamedCompletion:
    """``parse`` for the events of one streamed completion, read in order: each must continue
    the one before, by the positions the server reports (the count of tokens generated:
    llama.cpp's ``tokens_predicted`` on every native event, ``usage.completion_tokens`` on
    llama-server's last ``/v1`` one; the ``text_offset`` of OpenAI's legacy log-probs). An event
    sent twice would put its tokens in the answer twice: :class:`MalformedBody`. Tokens counted
    but never streamed (llama-server holds back a token that ends inside a UTF-8 character and
    sends its text, not its id, with the next one) add up in each chunk's ``extra["left_out"]``.
    More tokens than the ``most`` asked for (a server or proxy that ignores the length, or
    repeats events without a count) would lengthen the answer: :class:`MalformedBody`.
    """

    def __init__(self, parse: Callable[[Any], Completion], most: int) -> None:
        self.parse = parse
        self.most = most
        self.generated = 0  # the server's count at its last report
        self.since = 0  # positions read since then
        self.text_end: int | None = None  # where the text of the last token read ends
        self.left_out = 0

    def __call__(self, event: Any) -> Completion:
        chunk = self.parse(event)
        self.since += len(chunk.positions)
        count = chunk.extra.get("tokens_predicted", chunk.extra.get("completion_tokens"))
        if count is not None:
            if count < self.generated + self.since:
                raise MalformedBody(
                    f"the server counts {count} tokens generated where {self.generated} and "
                    f"{self.since} more were streamed: the stream repeats or reorders events"
                )
            self.left_out += count - self.generated - self.since
            self.generated, self.since = count, 0  # the counters restart together
        if self.generated + self.since > self.most:
            raise MalformedBody(
                f"the server streamed {self.generated + self.since} tokens, more than the "
                f"{self.most} asked for: it ignores the answer's length (max_tokens, n_predict), "
                "or the stream repeats events"
            )
        for position in chunk.positions:
            if position.offset is None:
                continue
            if self.text_end is not None and position.offset < self.text_end:
                raise MalformedBody(
                    f"a token at text offset {position.offset} starts before the text read so "
                    f"far ends ({self.text_end}): the stream repeats or reorders events"
                )
            # A text key is the token's text; an id key stands for text of unknown length.
            text = len(position.key) if key_id(position.key) is None else 0
            self.text_end = position.offset + text
        chunk.extra["left_out"] = self.left_out
        return chunk


def parse_native_post_sampling(body: Any) -> dict[str, float]:
    """Log-probs of the candidates llama.cpp kept after sampling, at the first generated position
    (a ``/completion`` with ``post_sampling_probs: true``; zero-probability candidates are left
    out by the server). Each ``prob`` must lie in [0, 1].
    """
    entries = _require(body, "completion_probabilities", list)
    if not entries or not isinstance(entries[0], Mapping):
        raise MalformedBody("no completion_probabilities entry")
    out: dict[str, float] = {}
    for cand in _require(entries[0], "top_probs", list):
        if not isinstance(cand, Mapping) or "id" not in cand:
            raise MalformedBody("a top_probs candidate has no 'id'")
        key = id_key(_token_id(cand["id"], 0))
        prob = _probability(cand.get("prob"), 0, f"the prob of candidate {key!r}")
        if prob > 0:
            out[key] = math.log(prob)
    return out


def parse_openai(body: Any, with_ids: bool = False, chunk: bool = False) -> Completion:
    """Read an OpenAI-style ``/v1/completions`` response with ``logprobs``.

    Accepts the legacy format (``tokens``, ``token_logprobs``, ``top_logprobs`` dicts) and
    llama.cpp's (``logprobs.content`` entries). Keys are decoded strings, except vLLM's
    ``token_id:<id>`` strings, which are ids already, and llama.cpp's entries with ``with_ids``
    (they carry each token's id and bytes, like the native format). ``usage.completion_tokens``,
    when sent, goes to ``extra`` (llama-server leaves out of its log-probs a token that ends inside
    a UTF-8 character: the count tells). ``chunk``: one event of a streamed completion, where the
    last one (``finish_reason`` set, no text) may carry no ``logprobs``.
    """
    choice = _first_choice(body)
    text = choice.get("text", "")
    if not isinstance(text, str):
        raise MalformedBody("choices[0].text is not a string")
    stopped = choice.get("finish_reason") == "stop"
    finished = not chunk or choice.get("finish_reason") is not None
    logprobs = choice.get("logprobs")
    usage = body.get("usage")
    generated = (
        positive_count(usage.get("completion_tokens")) if isinstance(usage, Mapping) else None
    )
    extra: dict[str, Any] = {"completion_tokens": generated} if generated is not None else {}
    if chunk and logprobs is None and not text:
        return Completion(positions=[], text=text, stopped=stopped, extra=extra, finished=finished)
    if not isinstance(logprobs, Mapping):
        raise MalformedBody("choices[0].logprobs is missing: the server ignored 'logprobs'")
    positions: list[Position] = []
    if "content" in logprobs and isinstance(logprobs["content"], list):
        for i, entry in enumerate(logprobs["content"]):
            if not isinstance(entry, Mapping):
                raise MalformedBody("logprobs.content holds a non-object")
            top, pieces = _entry_top(entry, with_ids=with_ids, position=i)
            if with_ids and "id" in entry:
                key = id_key(_token_id(entry["id"], i))
                raw = _bytes(entry.get("bytes"), i, key)
                if raw is not None:
                    pieces.setdefault(key, raw)
            else:
                key = str(entry.get("token", ""))
                pieces = {}
            logprob = _logprob(entry.get("logprob"), i, "the token's logprob")
            positions.append(Position(key, logprob, top, pieces))
        return Completion(
            positions=positions, text=text, stopped=stopped, extra=extra, finished=finished
        )
    tokens = _require(logprobs, "tokens", list)
    token_logprobs = _require(logprobs, "token_logprobs", list)
    tops = logprobs.get("top_logprobs") or [None] * len(tokens)
    offsets = logprobs.get("text_offset") or [None] * len(tokens)
    if not (len(tokens) == len(token_logprobs) == len(tops) == len(offsets)):
        raise MalformedBody("tokens, token_logprobs, top_logprobs and text_offset differ in length")
    for i, (token, lp, top, offset) in enumerate(
        zip(tokens, token_logprobs, tops, offsets, strict=True)
    ):
        if not isinstance(token, str):
            raise MalformedBody(f"token {token!r} is not a string")
        if top is not None and not isinstance(top, Mapping):
            raise MalformedBody("a top_logprobs entry is not an object")
        candidates = (
            {str(k): _logprob(v, i, f"candidate {str(k)!r}") for k, v in top.items()}
            if top is not None
            else None
        )
        chosen = None if lp is None else _logprob(lp, i, "the token's logprob")
        if offset is not None and (isinstance(offset, bool) or not isinstance(offset, int)):
            raise MalformedBody(f"text_offset {offset!r} is not an integer")
        positions.append(Position(token, chosen, candidates, offset=offset))
    return Completion(
        positions=positions, text=text, stopped=stopped, extra=extra, finished=finished
    )


def parse_echo_tokens(body: Any) -> list[str]:
    """The prompt tokens an OpenAI-style ``echo`` response lists (legacy or llama.cpp format)."""
    logprobs = _first_choice(body).get("logprobs")
    if not isinstance(logprobs, Mapping):
        raise MalformedBody("choices[0].logprobs is missing")
    if isinstance(logprobs.get("content"), list):
        return [str(e.get("token", "")) for e in logprobs["content"] if isinstance(e, Mapping)]
    return [str(t) for t in _require(logprobs, "tokens", list)]


def split_tokens(tokens: Sequence[Any], separator: int) -> list[list[int]]:
    """Split a token list at ``separator`` (how one ``/tokenize`` call tokenizes many texts)."""
    parts: list[list[int]] = [[]]
    for token in tokens:
        if isinstance(token, Mapping):  # {"id": .., "piece": ..} when with_pieces was set
            token = token.get("id")
        if isinstance(token, bool) or not isinstance(token, int):
            raise MalformedBody(f"token {token!r} is not an id")
        if token == separator:
            parts.append([])
        else:
            parts[-1].append(token)
    return parts


def completion_counts(answer: Any) -> tuple[str, int, int]:
    """A completion's text, the prompt tokens the server evaluated for it and the tokens it
    generated, as its answer reports them (for tracing): llama-server's ``timings``
    (``prompt_n``: what its prompt cache did not hold; ``predicted_n``), else OpenAI's
    ``usage`` (``prompt_tokens``, ``completion_tokens``: vLLM, llama-cpp-python), else
    llama.cpp's native ``tokens_evaluated`` and ``tokens_predicted``. What an answer leaves out
    or gets wrong (its parser reports that) shows as "" or 0: tracing never fails a request.
    """
    body = _mapping(answer)
    timings = _mapping(body.get("timings"))
    usage = _mapping(body.get("usage"))
    text = body.get("content")
    choices = body.get("choices")
    if isinstance(choices, list) and choices and isinstance(choices[0], Mapping):
        text = choices[0].get("text")
    prompt = usage.get("prompt_tokens", body.get("tokens_evaluated"))
    completion = usage.get("completion_tokens", body.get("tokens_predicted"))
    prompt_tokens = _count(timings.get("prompt_n", prompt))
    completion_tokens = _count(timings.get("predicted_n", completion))
    return text if isinstance(text, str) else "", prompt_tokens, completion_tokens


def _mapping(value: Any) -> Mapping[str, Any]:
    """``value`` when it is a mapping, else an empty one."""
    return value if isinstance(value, Mapping) else {}


def _count(value: Any) -> int:
    """A token count an answer reported, else 0."""
    is_count = isinstance(value, int) and not isinstance(value, bool) and value >= 0
    return value if is_count else 0
