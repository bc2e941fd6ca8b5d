"""The shared half of every critic: blocking methods over the async ones, prompts, closing."""

from __future__ import annotations

from abc import ABC, abstractmethod
from collections.abc import Sequence

from llama_index.core.prompts.mixin import PromptDictType, PromptMixin, PromptMixinType

from llama_index.packs.self_rag_rse.common.bridge import run_sync
from llama_index.packs.self_rag_rse.self_rag.contract import ParagraphJudgement, RetrievalDecision


class BaseCritic(PromptMixin, ABC):
    """Base class for :class:`~.contract.Critic` implementations.

    Subclasses implement the three async methods; the blocking ones run them through the
    package's one sync/async bridge (``common.bridge.run_sync``), so both paths share one
    implementation. A critic is a ``PromptMixin``: ``get_prompts()`` lists
    its templates (none by default) and the engine shows them under ``critic:``.
    """

    name: str = "critic"

    @abstractmethod
    async def adecide_retrieval(
        self, query: str, threshold: float | None, answer_if_skipped: bool = True
    ) -> RetrievalDecision:
        """Decide whether ``query`` needs evidence (``threshold=None``: greedy decides)."""

    @abstractmethod
    async def ajudge(self, query: str, paragraphs: Sequence[str]) -> list[ParagraphJudgement]:
        """Answer ``query`` from each paragraph and score each answer, in input order."""

    @abstractmethod
    async def agenerate(self, query: str) -> str:
        """Answer ``query`` with no evidence."""

    def decide_retrieval(
        self, query: str, threshold: float | None, answer_if_skipped: bool = True
    ) -> RetrievalDecision:
        """Blocking :meth:`adecide_retrieval`."""
        return run_sync(self.adecide_retrieval(query, threshold, answer_if_skipped))

    def judge(self, query: str, paragraphs: Sequence[str]) -> list[ParagraphJudgement]:
        """Blocking :meth:`ajudge`."""
        return run_sync(self.ajudge(query, paragraphs))

    def generate(self, query: str) -> str:
        """Blocking :meth:`agenerate`."""
        return run_sync(self.agenerate(query))

    def close(self) -> None:
        """Free what the critic holds; the models it was given stay open."""

    def __enter__(self) -> BaseCritic:
        return self

    def __exit__(self, *exc_info: object) -> None:
        self.close()

    # --- PromptMixin ---------------------------------------------------------------------------

    def _get_prompts(self) -> PromptDictType:
        """No prompts unless the subclass has some."""
        return {}

    def _get_prompt_modules(self) -> PromptMixinType:
        """No sub-modules."""
        return {}

    def _update_prompts(self, prompts_dict: PromptDictType) -> None:
        """Nothing to update unless the subclass has prompts."""
