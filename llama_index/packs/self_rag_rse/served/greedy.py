"""Greedy decoding on a model server: what to send to each kind of server, and the check that
the server did decode greedily.

A served critic must generate exactly what the in-process critic generates: plain greedy
decoding, every token the most likely one under the raw logits. ``temperature: 0`` alone does not
get that. Servers apply sampling defaults of their own, and some of them change the argmax:
llama-cpp-python's server a ``repeat_penalty`` of 1.1, llama-server whatever it was started with
(``--repeat-penalty``, ``--dry-multiplier``, ``--logit-bias``, ``--samplers``...), vLLM the
model's ``generation_config.json`` (``repetition_penalty``, ``top_k``...). So the critic tells the
servers apart (:func:`server_kind`) and sends each the fields that turn those off
(:data:`GREEDY`); ``request_options`` go on top.

Some settings cannot be turned off from a request (llama-server's ``--grammar``, a vLLM logits
processor, a proxy that rewrites requests). :func:`check_greedy` catches them: every generated
token must be the most likely token of the distribution the server reports at its position
(ties within :data:`TIE` aside); when one is not, :class:`ServerNotGreedy` names the server, the
position and the option to change. Plain Python, no HTTP.
"""

from __future__ import annotations

from collections.abc import Mapping
from typing import Any

from llama_index.packs.self_rag_rse.served.errors import ServerError
from llama_index.packs.self_rag_rse.served.wire import Completion

#: Server kinds: llama.cpp's llama-server (native API or its ``/v1``), llama-cpp-python's
#: ``python -m llama_cpp.server``, vLLM, and any other OpenAI-compatible server.
LLAMA_CPP = "llama.cpp"
LLAMA_CPP_PYTHON = "llama-cpp-python"
VLLM = "vllm"
OPENAI = "openai"

#: ``/v1/models`` ``owned_by`` of each server that says who it is.
_OWNERS = {"llamacpp": LLAMA_CPP, "vllm": VLLM, "me": LLAMA_CPP_PYTHON}

#: OpenAI's own greedy fields, which every server takes (an unknown one may reject anything else).
_OPENAI_GREEDY = dict(temperature=0.0, presence_penalty=0.0, frequency_penalty=0.0, top_p=1.0)
#: The fields that make each server's decoding plain greedy (and nothing else). Neutral values:
#: penalties 1.0 (multiplicative) or 0.0 (additive); top-k/top-p/min-p that keep every token.
GREEDY: dict[str, dict[str, Any]] = {
    LLAMA_CPP: {
        **_OPENAI_GREEDY,
        # Only top-k (k=1) in the sampler chain, after the request's own logit bias (none): no
        # penalty, DRY, XTC or mirostat stage the server was started with can run.
        "samplers": ["top_k"],
        "top_k": 1,
        "min_p": 0.0,
        "typical_p": 1.0,
        "repeat_penalty": 1.0,
        "dry_multiplier": 0.0,
        "xtc_probability": 0.0,
        "mirostat": 0,
        # Clears --logit-bias and the end-of-generation ban of --ignore-eos.
        "logit_bias": [],
        "ignore_eos": False,
    },
    # llama-cpp-python's repeat_penalty defaults to 1.1.
    LLAMA_CPP_PYTHON: dict(_OPENAI_GREEDY, repeat_penalty=1.0, top_k=0, min_p=0.0, mirostat_mode=0),
    # Explicit values win over the model's generation_config.json defaults.
    VLLM: dict(_OPENAI_GREEDY, repetition_penalty=1.0, top_k=-1, min_p=0.0),
    OPENAI: _OPENAI_GREEDY,
}

#: What each server may apply that no request field turns off, for the error message.
_UNCONTROLLED = {
    LLAMA_CPP: "a --grammar or --json-schema it was started with (restart it without)",
    LLAMA_CPP_PYTHON: "a setting this version of llama_cpp.server applies by default",
    VLLM: "a --logits-processors plugin or an --override-generation-config field",
    OPENAI: (
        "a repetition penalty or other default of its own: pass the field that turns it off in "
        "request_options (e.g. {'repetition_penalty': 1.0} or {'repeat_penalty': 1.0})"
    ),
}

#: Log-prob gap below which two tokens count as tied (float32 rounding of the softmax).
TIE = 1e-4


class ServerNotGreedy(ServerError):
    """The server generated a token that was not the most likely one at its position: its
    decoding is not greedy, so answers and scores would silently differ from Self-RAG's.
    """

    def __init__(self, message: str, url: str, position: int) -> None:
        super().__init__(message, url)
        self.position = position


def server_kind(models: Any) -> str:
    """The kind of server behind a ``/v1/models`` answer (``owned_by`` of its first model);
    :data:`OPENAI` when it does not say.
    """
    try:
        owner = models["data"][0]["owned_by"]
    except (KeyError, IndexError, TypeError):
        return OPENAI
    return _OWNERS.get(owner, OPENAI) if isinstance(owner, str) else OPENAI


#: Request fields the critic reads its answers and log-probs back by: ``request_options`` may not
#: set them (``max_new_tokens`` and ``top_logprobs`` are the critic's own options for two).
CRITIC_FIELDS = frozenset(
    {"prompt", "n_predict", "max_tokens", "n_probs", "logprobs", "post_sampling_probs"}
    | {"return_tokens", "stream", "echo"}
)


def request_fields(request_options: Any) -> dict[str, Any]:
    """``request_options`` as a dict; a value that is no mapping, or one that sets any of
    :data:`CRITIC_FIELDS`, is refused with the fix.
    """
    if not isinstance(request_options, Mapping | None):
        raise TypeError(
            "ServedReflectionCritic: request_options must be a mapping of request fields, e.g. "
            f"{{'repeat_penalty': 1.0}}; got {type(request_options).__name__}"
        )
    if own := sorted(CRITIC_FIELDS.intersection(request_options or {})):
        raise ValueError(
            f"ServedReflectionCritic: request_options sets {own}, which the critic sets itself "
            "to read its answers and log-probs back: pass max_new_tokens= or top_logprobs= to "
            "the critic instead of n_predict/max_tokens/n_probs/logprobs, and leave the others out"
        )
    return dict(request_options or {})


def greedy_options(kind: str, request_options: Mapping[str, Any]) -> dict[str, Any]:
    """The greedy fields for ``kind`` with ``request_options`` on top."""
    return {**GREEDY[kind], **request_options}


def check_greedy(
    completion: Completion, *, server: str, url: str, sent: Mapping[str, Any], start: int = 0
) -> None:
    """Raise :class:`ServerNotGreedy` at the first position (from ``start``) whose token is not
    the most likely one the server reported there (positions left unreported are skipped).

    ``server`` is the kind, ``url`` the endpoint and ``sent`` the sampling fields of the request,
    so the message can name the option that made the difference.
    """
    for i, position in enumerate(completion.positions[start:], start):
        if not position.top or position.logprob is None:
            continue
        best_key, best = max(position.top.items(), key=lambda item: item[1])
        if position.logprob >= best - TIE:
            continue
        head = (
            f"{url} ({server}) did not decode greedily: at generated position {i} it produced "
            f"{position.key!r} (log-prob {position.logprob:.4f}) where it reports {best_key!r} "
            f"as likelier ({best:.4f}), so the critic's answers and scores would not be Self-RAG's"
        )
        greedy = GREEDY[server]
        changed = {k: v for k, v in sent.items() if k in greedy and v != greedy[k]}
        if changed:
            named = ", ".join(f"{k}={v!r}" for k, v in changed.items())
            fix = f": request_options sets {named}; remove it (greedy needs {greedy})"
        else:
            fix = (
                f". The critic sent {dict(sent)}, so the server applies something a request "
                f"cannot turn off: {_UNCONTROLLED[server]}, or a proxy before it rewrites requests"
            )
        raise ServerNotGreedy(head + fix, url, i)
