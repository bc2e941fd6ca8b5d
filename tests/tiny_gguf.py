"""Write GGUF models whose vocabulary holds the Self-RAG reflection tokens (tests and benchmarks).

The Self-RAG 7B GGUF cannot be downloaded here, so the tests write their own model at run time:

* :func:`write_tiny_gguf` — a 2-layer llama with a ~1,100-token SentencePiece vocabulary and
  seeded random weights (~1 MB, written in well under a second). The output matrix is built so
  that the model behaves like a noisy bigram model following Self-RAG's grammar:
  ``\\n`` → ``[Retrieval]`` or ``[No Retrieval]``, ``</paragraph>`` → ``[Relevant]`` or
  ``[Irrelevant]``, then text, then a grounding token, a utility token and ``</s>``. Close
  alternatives are left for the attention layers to settle, so answers and scores differ from
  paragraph to paragraph and are never all zero. The reflection tokens can be typed CONTROL
  or USER_DEFINED, or left out.
* :func:`add_self_rag_tokens` — copy a real GGUF (e.g. SmolLM2-135M) and append the 15 Self-RAG
  strings to its vocabulary, with embedding rows, re-quantised with ``gguf.quants``. The
  benchmark uses it to measure the critic at a realistic size.

This module is a helper, not a test file; it needs ``numpy`` and ``gguf``.
"""

from __future__ import annotations

import string
from collections.abc import Sequence
from pathlib import Path
from typing import Any

import numpy as np

from llama_index.packs.self_rag_rse.critic.reflection import (
    FULLY_SUPPORTED,
    GROUNDING_TOKENS,
    IRRELEVANT,
    NO_RETRIEVAL,
    NO_SUPPORT,
    PARAGRAPH_CLOSE,
    PARAGRAPH_OPEN,
    PARTIALLY_SUPPORTED,
    RELEVANT,
    RETRIEVAL,
    SELF_RAG_SPECIAL_TOKENS,
    UTILITY_TOKENS,
)

#: How the reflection tokens are typed in the GGUF vocabulary ("none": left out).
TYPINGS = ("control", "user_defined", "none")

# gguf TokenType values (kept numeric so the mapping is visible here).
_NORMAL, _UNKNOWN, _CONTROL, _USER_DEFINED, _BYTE = 1, 2, 3, 4, 6


def _gguf() -> Any:
    import gguf  # the dev extra installs it

    return gguf


# --- the tiny random model ------------------------------------------------------------------------


def _tiny_vocab(typing: str) -> tuple[list[str], list[float], list[int]]:
    """SentencePiece-style vocabulary: specials, 256 byte tokens, characters and bigrams."""
    tokens = ["<unk>", "<s>", "</s>"]
    types = [_UNKNOWN, _CONTROL, _CONTROL]
    tokens += [f"<0x{b:02X}>" for b in range(256)]
    types += [_BYTE] * 256
    chars = [c for c in string.printable if c not in string.whitespace] + ["▁"]
    lower = string.ascii_lowercase
    pieces = (
        chars
        + [f"▁{c}" for c in lower + string.ascii_uppercase]
        + [a + b for a in lower for b in lower]
    )
    tokens += pieces
    types += [_NORMAL] * len(pieces)
    if typing == "partial":  # a broken Self-RAG vocabulary: the retrieval tokens only
        tokens += list(SELF_RAG_SPECIAL_TOKENS[:3])
        types += [_USER_DEFINED] * 3
    elif typing != "none":
        tokens += list(SELF_RAG_SPECIAL_TOKENS)
        types += [_CONTROL if typing == "control" else _USER_DEFINED] * len(SELF_RAG_SPECIAL_TOKENS)
    # SentencePiece merges the highest-scoring pair first: prefer the two-character pieces.
    scores = [
        0.0 if t == _NORMAL and len(tok) > 1 else -1.0 for tok, t in zip(tokens, types, strict=True)
    ]
    return tokens, scores, types


def write_tiny_gguf(
    path: str | Path,
    *,
    typing: str = "user_defined",
    seed: int = 0,
    n_embd: int = 64,
    n_layer: int = 2,
    n_head: int = 4,
    n_head_kv: int = 2,
    n_ff: int = 128,
    context_length: int = 2048,
    layer_scale: float = 0.35,
    weight_dtype: str = "f32",
    long_form: bool = False,
) -> Path:
    """Write a tiny llama GGUF at ``path`` and return the path.

    ``typing`` chooses how the 15 Self-RAG strings are typed: ``"control"``,
    ``"user_defined"`` or ``"none"`` (a model without them); ``"partial"`` holds only the three
    retrieval tokens (a broken Self-RAG vocabulary). ``layer_scale`` is the standard
    deviation of the attention/FFN weights: the larger, the more the context (and not just the
    last token) decides between close alternatives. ``weight_dtype="f16"`` halves the file for
    large shapes (norms stay F32). ``long_form=True`` lets answers go on after their utility
    token: some utility tokens lead to ``[Retrieval]`` (a new segment), others to ``[No
    Retrieval]`` or ``</s>``, each closely followed by the others (the context decides).
    """
    if typing not in (*TYPINGS, "partial"):
        raise ValueError(f"typing must be one of {TYPINGS}, got {typing!r}")
    gguf = _gguf()
    rng = np.random.default_rng(seed)
    tokens, scores, types = _tiny_vocab(typing)
    ids = {tok: i for i, tok in enumerate(tokens)}
    n_vocab = len(tokens)
    head_dim = n_embd // n_head

    embd = rng.standard_normal((n_vocab, n_embd)).astype(np.float32)
    reflection = typing not in ("none", "partial")
    out = _bigram_output(rng, tokens, types, ids, embd, reflection, long_form and reflection)

    writer = gguf.GGUFWriter(str(path), "llama")
    writer.add_name(f"tiny-self-rag-{typing}")
    writer.add_context_length(context_length)
    writer.add_embedding_length(n_embd)
    writer.add_block_count(n_layer)
    writer.add_feed_forward_length(n_ff)
    writer.add_head_count(n_head)
    writer.add_head_count_kv(n_head_kv)
    writer.add_rope_dimension_count(head_dim)
    writer.add_layer_norm_rms_eps(1e-5)
    writer.add_vocab_size(n_vocab)
    matrix_dtype = {"f32": np.float32, "f16": np.float16}[weight_dtype]
    writer.add_file_type(0 if weight_dtype == "f32" else 1)
    writer.add_tokenizer_model("llama")
    writer.add_token_list(tokens)
    writer.add_token_scores(scores)
    writer.add_token_types(types)
    writer.add_unk_token_id(0)
    writer.add_bos_token_id(1)
    writer.add_eos_token_id(2)
    writer.add_add_bos_token(True)
    writer.add_add_eos_token(False)
    writer.add_add_space_prefix(True)

    def weight(rows: int, cols: int, gain: float = 1.0) -> np.ndarray:
        std = gain * layer_scale / np.sqrt(cols)
        return (rng.standard_normal((rows, cols)) * std).astype(matrix_dtype)

    writer.add_tensor("token_embd.weight", embd.astype(matrix_dtype))
    for layer in range(n_layer):
        prefix = f"blk.{layer}"
        writer.add_tensor(f"{prefix}.attn_norm.weight", np.ones(n_embd, dtype=np.float32))
        # Larger q/k give sharper, more position- and content-dependent attention.
        writer.add_tensor(f"{prefix}.attn_q.weight", weight(n_head * head_dim, n_embd, 4))
        writer.add_tensor(f"{prefix}.attn_k.weight", weight(n_head_kv * head_dim, n_embd, 4))
        writer.add_tensor(f"{prefix}.attn_v.weight", weight(n_head_kv * head_dim, n_embd, 8))
        writer.add_tensor(f"{prefix}.attn_output.weight", weight(n_embd, n_head * head_dim))
        writer.add_tensor(f"{prefix}.ffn_norm.weight", np.ones(n_embd, dtype=np.float32))
        writer.add_tensor(f"{prefix}.ffn_gate.weight", weight(n_ff, n_embd, 4))
        writer.add_tensor(f"{prefix}.ffn_up.weight", weight(n_ff, n_embd, 4))
        writer.add_tensor(f"{prefix}.ffn_down.weight", weight(n_embd, n_ff))
    writer.add_tensor("output_norm.weight", np.ones(n_embd, dtype=np.float32))
    writer.add_tensor("output.weight", out.astype(matrix_dtype))

    writer.write_header_to_file()
    writer.write_kv_data_to_file()
    writer.write_tensors_to_file()
    writer.close()
    return Path(path)


def _bigram_output(
    rng: np.random.Generator,
    tokens: Sequence[str],
    types: Sequence[int],
    ids: dict[str, int],
    embd: np.ndarray,
    with_reflection: bool,
    long_form: bool = False,
) -> np.ndarray:
    """Output rows that make ``next(a)`` likely after token ``a``.

    The final hidden state stays close to the current token's embedding (the residual stream
    dominates), so ``out[b] = Σ_a w(a→b)·embd[a]`` scores ``b`` highly after each ``a`` with
    ``w(a→b) > 0``. Alternatives with weights 1.0 vs 0.9 differ by ~0.7 nats, which the
    attention layers can overturn: the choice then depends on the whole context.
    """
    n_vocab, n_embd = embd.shape
    # Unit-norm rows scaled so the intended successor wins by ~7 nats over a random token.
    unit = embd / np.linalg.norm(embd, axis=1, keepdims=True)
    scale = 7.0 / np.sqrt(n_embd)
    words = [i for i, t in enumerate(types) if t == _NORMAL]
    transitions: dict[int, list[tuple[int, float]]] = {}

    def link(a: str | int, b: str | int, w: float) -> None:
        ia = ids[a] if isinstance(a, str) else a
        ib = ids[b] if isinstance(b, str) else b
        transitions.setdefault(ia, []).append((ib, w))

    newline = ids["<0x0A>"]
    exits = rng.random(len(words)) < 0.15
    for k, w in enumerate(words):
        follow = words[int(rng.integers(len(words)))]
        second = words[int(rng.integers(len(words)))]
        if with_reflection and exits[k]:
            link(w, ids[GROUNDING_TOKENS[int(rng.integers(3))]], 1.0)
            link(w, follow, 0.9)
        elif not with_reflection and exits[k]:
            link(w, "</s>", 1.0)
            link(w, follow, 0.9)
        else:
            link(w, follow, 1.0)
            link(w, second, 0.92)
    if with_reflection:
        link(newline, RETRIEVAL, 1.0)
        link(newline, NO_RETRIEVAL, 0.97)
        link(RETRIEVAL, PARAGRAPH_OPEN, 1.0)
        link(PARAGRAPH_CLOSE, RELEVANT, 1.0)
        link(PARAGRAPH_CLOSE, IRRELEVANT, 0.95)
        for start in (NO_RETRIEVAL, RELEVANT, IRRELEVANT):
            link(start, words[int(rng.integers(len(words)))], 1.0)
            link(start, words[int(rng.integers(len(words)))], 0.95)
        for grounding in (FULLY_SUPPORTED, PARTIALLY_SUPPORTED, NO_SUPPORT):
            order = rng.permutation(len(UTILITY_TOKENS))
            for rank, u in enumerate(order):
                link(grounding, UTILITY_TOKENS[int(u)], 1.0 - 0.03 * rank)
        for k, utility in enumerate(UTILITY_TOKENS):
            if not long_form:
                link(utility, "</s>", 1.0)
                continue
            # No random draw here: the other models stay as they were.
            ends = (RETRIEVAL, NO_RETRIEVAL, "</s>")
            for rank, end in enumerate(ends[k % 3 :] + ends[: k % 3]):
                link(utility, end, 1.0 - 0.02 * rank)
    else:
        link(newline, words[0], 1.0)
    out = rng.standard_normal((n_vocab, n_embd)).astype(np.float32) * 0.02
    for a, successors in transitions.items():
        for b, weight in successors:
            out[b] += (scale * weight) * unit[a]
    return out


# --- a real model with the Self-RAG tokens appended ---------------------------------------------


def add_self_rag_tokens(
    src: str | Path,
    dst: str | Path,
    *,
    typing: str = "control",
    seed: int = 0,
    boundary_after: str | None = None,
) -> Path:
    """Copy the GGUF ``src`` to ``dst`` with the 15 Self-RAG strings appended to its vocabulary.

    The new embedding rows are the mean embedding plus small noise, so the model treats them as
    plausible but rare tokens. ``token_embd`` is de-quantised, extended and re-quantised to its
    original type when ``gguf.quants`` can (else stored as F16); a separate ``output`` matrix, if
    any, is extended the same way. All other tensors are copied byte for byte.

    ``boundary_after`` (a token of ``src``, e.g. ``"."``) gives ``[Retrieval]`` that token's rows
    scaled by 1.05, so greedy decoding writes ``[Retrieval]`` where the model would write that
    token: long-form answers then have a segment per sentence, as a Self-RAG model's do.
    """
    if typing not in ("control", "user_defined"):
        raise ValueError("typing must be 'control' or 'user_defined'")
    gguf = _gguf()
    reader = gguf.GGUFReader(str(src))
    rng = np.random.default_rng(seed)
    arch = str(reader.fields["general.architecture"].contents())
    writer = gguf.GGUFWriter(str(dst), arch)
    n_new = len(SELF_RAG_SPECIAL_TOKENS)
    new_type = _CONTROL if typing == "control" else _USER_DEFINED

    for key, field in reader.fields.items():
        if key.startswith("GGUF.") or key == "general.architecture":
            continue
        value = field.contents()
        main = field.types[0]
        sub = field.types[-1] if main == gguf.GGUFValueType.ARRAY else None
        if key == "tokenizer.ggml.tokens":
            value = list(value) + list(SELF_RAG_SPECIAL_TOKENS)
        elif key == "tokenizer.ggml.token_type":
            value = list(value) + [new_type] * n_new
        elif key == "tokenizer.ggml.scores":
            value = list(value) + [0.0] * n_new
        elif key == f"{arch}.vocab_size":
            value = int(value) + n_new
        writer.add_key_value(key, value, main, sub_type=sub)

    boundary = None
    if boundary_after is not None:
        names = [str(t) for t in reader.fields["tokenizer.ggml.tokens"].contents()]
        boundary = names.index(boundary_after)
    for tensor in reader.tensors:
        if tensor.name in ("token_embd.weight", "output.weight"):
            qtype = tensor.tensor_type
            rows = gguf.quants.dequantize(tensor.data, qtype).reshape(-1, int(tensor.shape[0]))
            mean = rows.mean(axis=0)
            extra = mean + rng.standard_normal((n_new, rows.shape[1])) * rows.std() * 0.1
            if boundary is not None:
                extra[SELF_RAG_SPECIAL_TOKENS.index(RETRIEVAL)] = rows[boundary] * 1.05
            full = np.concatenate([rows, extra.astype(np.float32)]).astype(np.float32)
            try:
                data = gguf.quants.quantize(full, qtype)
                writer.add_tensor(tensor.name, data, raw_shape=data.shape, raw_dtype=qtype)
            except (NotImplementedError, gguf.quants.QuantError):
                writer.add_tensor(tensor.name, full.astype(np.float16))
        else:
            writer.add_tensor(
                tensor.name,
                tensor.data,
                raw_shape=tensor.data.shape,
                raw_dtype=tensor.tensor_type,
            )
    writer.write_header_to_file()
    writer.write_kv_data_to_file()
    writer.write_tensors_to_file()
    writer.close()
    return Path(dst)
