"""Model specifications of the command line, and the bundled GGUF's prompt format."""

from __future__ import annotations

import pytest

from llama_index.packs.self_rag_rse.evaluation.models import ModelSpec, load_llm, parse_spec


def test_parse_spec(tmp_path):
    gguf = tmp_path / "m.gguf"
    gguf.write_bytes(b"GGUF")
    assert parse_spec("bundled") == ModelSpec("bundled")
    assert parse_spec("bundled").bundled
    assert parse_spec(str(gguf)) == ModelSpec("gguf", str(gguf))
    assert parse_spec("openai-like:qwen", "http://h/v1") == ModelSpec(
        "openai-like", "qwen", "http://h/v1"
    )
    assert parse_spec("openai-like-chat", "http://h/v1") == ModelSpec(
        "openai-like-chat", None, "http://h/v1"
    )
    with pytest.raises(ValueError, match="pass --judge-url URL"):
        parse_spec("openai-like-chat:x", url_flag="--judge-url")
    with pytest.raises(ValueError, match="does not exist"):
        parse_spec(str(tmp_path / "absent.gguf"))


def test_served_model_is_an_openai_like():
    pytest.importorskip("llama_index.llms.openai_like")
    loaded = load_llm("openai-like-chat:judge-7b", "http://127.0.0.1:9/v1", max_new_tokens=99)
    assert type(loaded.llm).__name__ == "OpenAILike"
    assert loaded.llm.model == "judge-7b" and loaded.llm.is_chat_model
    assert loaded.llm.max_tokens == 99 and loaded.llm.api_base == "http://127.0.0.1:9/v1"
    assert not load_llm("openai-like:m", "http://127.0.0.1:9/v1").llm.is_chat_model
    assert loaded.label == "judge-7b at http://127.0.0.1:9/v1"
    loaded.close()  # holds nothing


def test_bundled_model_uses_its_own_chat_template():
    loaded = load_llm("bundled", max_new_tokens=4, context_window=512)
    try:
        assert loaded.bundled and loaded.label.startswith("SmolLM2-135M")
        prompt = loaded.llm.completion_to_prompt("Hi?")
        assert prompt.endswith("<|im_start|>user\nHi?<|im_end|>\n<|im_start|>assistant\n")
    finally:
        loaded.close()
