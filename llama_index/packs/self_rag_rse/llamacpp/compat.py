"""Every access to llama-cpp-python beyond its documented API, in one place.

The batched decoder and the llama.cpp critic backend need a few things ``llama_cpp.Llama`` does
not expose publicly: the native model pointer (to open a second, multi-sequence context on the
same weights), the exit stack that frees the model (to free our context first and to learn that
the model was closed), the context and model parameters it was created with, token attributes
and texts, and whether the GGUF asks for a BOS token. A llama-cpp-python release that renames one
of these breaks this module only; everything else imports from here.

Tested against llama-cpp-python 0.3.x (0.3.16 and later).
"""

from __future__ import annotations

import contextlib
import weakref
from collections.abc import Callable
from typing import TYPE_CHECKING, Any

from llama_index.packs.self_rag_rse.common.optional import optional_import

if TYPE_CHECKING:
    import llama_cpp

#: llama.cpp's LLAMA_TOKEN_ATTR_CONTROL (kept here so callers import without llama_cpp).
TOKEN_ATTR_CONTROL = 8

#: The message every use of a freed model raises, instead of touching freed memory.
MODEL_CLOSED_MESSAGE = (
    "the llama.cpp model was closed (Llama.close() or LlamaCPP._model.close()); "
    "create the engine (or critic) again with an open model"
)


#: The callbacks :func:`on_close` holds per exit stack (one stack per model), all run by one
#: registration on that stack. Weak keys: an entry goes with its model.
_CLOSE_CALLBACKS: weakref.WeakKeyDictionary[Any, set[Callable[[], None]]] = (
    weakref.WeakKeyDictionary()
)


class ModelClosedError(RuntimeError):
    """The ``llama_cpp.Llama`` this object was built on has been closed."""

    def __init__(self, message: str = MODEL_CLOSED_MESSAGE) -> None:
        super().__init__(message)


def import_llama_cpp(feature: str = "the llama.cpp backend") -> Any:
    """``import llama_cpp`` with an install hint."""
    return optional_import("llama_cpp", feature, "llama-cpp")


def llama_of(llm: Any, owner: str | None = None) -> Any:
    """The ``llama_cpp.Llama`` behind ``llm`` (itself, or a ``LlamaCPP``'s ``_model``), if any;
    with an ``owner`` that needs one, a ``TypeError`` naming it when there is none.
    """
    with contextlib.suppress(ImportError):  # without llama_cpp there is no Llama either
        import llama_cpp

        model = llm if isinstance(llm, llama_cpp.Llama) else getattr(llm, "_model", None)
        if isinstance(model, llama_cpp.Llama):
            return model
    if owner is not None:
        raise TypeError(f"{owner} needs a LlamaCPP or a llama_cpp.Llama, got {type(llm).__name__}")
    return None


def _internal_model(llama: llama_cpp.Llama) -> Any:
    """llama-cpp-python's ``_internals.LlamaModel`` wrapper, or raise if the Llama was closed."""
    if is_closed(llama):
        raise ModelClosedError()
    return llama._model


def is_closed(llama: llama_cpp.Llama) -> bool:
    """Whether the ``Llama``'s native model has been freed.

    Both ``Llama.close()`` and ``llama._model.close()`` leave ``llama._model`` in place with its
    ``model`` pointer set to None; that is what this reads.
    """
    return getattr(getattr(llama, "_model", None), "model", None) is None


def closed_check(llama: llama_cpp.Llama) -> Callable[[], bool]:
    """:func:`is_closed` for this ``Llama`` as a function that does not keep the ``Llama`` alive.

    It holds llama-cpp-python's model wrapper only, which that wrapper's own exit stack already
    keeps in a reference cycle: an :func:`on_close` callback may hold it without making the
    ``Llama`` outlive its users' last reference.
    """
    wrapper = _internal_model(llama)
    return lambda: getattr(wrapper, "model", None) is None


def model_pointer(llama: llama_cpp.Llama) -> Any:
    """The native ``llama_model *`` the ``Llama`` holds."""
    return _internal_model(llama).model


def on_close(llama: llama_cpp.Llama, callback: Callable[[], None]) -> Callable[[], None]:
    """Run ``callback`` when the ``Llama``'s model is freed, *before* it is freed; returns the
    function that withdraws it, for its owner to call when it goes.

    llama-cpp-python 0.3.x frees the model through exit stacks, whose callbacks run last-in
    first-out: ``Llama.close()`` closes the Llama's ``_stack``, which ends with
    ``LlamaModel.close()``; that closes the model's own ``_exit_stack``, whose first callback
    frees the native model and sets ``LlamaModel.model`` to None (:func:`is_closed`). Registering
    on the model's stack hears both ``Llama.close()`` (``LlamaCPP._model.close()``) and a direct
    ``llama._model.close()``, and runs before the model is freed; releases without that stack
    get the callback on ``Llama._stack``, which hears ``Llama.close()`` only. The callback may
    block (to let a running decode finish): the model is freed after it returns. When neither
    stack exists closing is not observed, and withdrawing does nothing.

    However many callbacks are added, one is registered on the model's stack (it runs those not
    withdrawn): an app that builds an engine per request on one shared model and drops it leaves
    nothing behind, where each used to leave a callback until the model closed.

    The stack holds ``callback`` strongly until it is withdrawn or the model is freed, so it
    must not reach the
    ``Llama`` (that would keep it alive) and should not reach its caller through a weak
    reference: when both become garbage together (a script's globals at exit, a reference
    cycle), the garbage collector clears weak references before it frees the model.
    """
    stack = getattr(getattr(llama, "_model", None), "_exit_stack", None)
    if stack is None:
        stack = getattr(llama, "_stack", None)
    if stack is None:
        return lambda: None
    fresh: set[Callable[[], None]] = set()
    # Atomic, so two threads opening decoders on one model at once register it once.
    callbacks = _CLOSE_CALLBACKS.setdefault(stack, fresh)
    if callbacks is fresh:
        stack.callback(_run_callbacks, callbacks)
    callbacks.add(callback)
    return lambda: callbacks.discard(callback)


def _run_callbacks(callbacks: set[Callable[[], None]]) -> None:
    """Run the callbacks :func:`on_close` holds for a model about to be freed."""
    # A copy: an owner may withdraw its callback from another thread meanwhile.
    for callback in list(callbacks):
        callback()


def context_params(llama: llama_cpp.Llama) -> Any:
    """The ``llama_context_params`` the ``Llama`` created its context with."""
    return llama.context_params


def model_params(llama: llama_cpp.Llama) -> Any:
    """The ``llama_model_params`` the ``Llama`` loaded its model with."""
    return llama.model_params


def token_text(llama: llama_cpp.Llama, token: int) -> str:
    """The vocabulary text of ``token`` (control tokens included, e.g. ``<|im_start|>``)."""
    return str(_internal_model(llama).token_get_text(int(token)))


def is_control_token(llama: llama_cpp.Llama, token: int) -> bool:
    """Whether the GGUF types ``token`` CONTROL (detokenized to "" unless special)."""
    return bool(_internal_model(llama).token_get_attr(int(token)) & TOKEN_ATTR_CONTROL)


def adds_bos(llama: llama_cpp.Llama) -> bool:
    """Whether prompts for this model start with BOS (the GGUF's ``add_bos_token``)."""
    return bool(_internal_model(llama).add_bos_token()) and int(llama.token_bos()) >= 0
