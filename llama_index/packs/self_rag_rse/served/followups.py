"""Make a served completion complete enough to score, and check that it was decoded greedily.

Servers report the top N log-probs per position only, and some leave a position unreported
(llama.cpp: a token that ends inside a UTF-8 character). A score reads, at a few positions, every
token of one reflection group. :func:`complete_positions` fills unreported positions, checks the
greedy decoding (:func:`~.greedy.check_greedy`), and for each group with a member outside the
top N either asks the server (``refetch``: exact ratios, named in ``details["refetched"]``) or
takes the N-th best log-prob as an upper bound for the missing members (named in
``details["bounded"]``). The details it returns are the judgement's.
"""

from __future__ import annotations

import asyncio
import logging
from collections.abc import Sequence
from typing import Any

from llama_index.packs.self_rag_rse.critic.reflection import (
    GROUNDING_TOKENS,
    NO_RETRIEVAL,
    RELEVANCE_TOKENS,
    RETRIEVAL,
    UTILITY_TOKENS,
)
from llama_index.packs.self_rag_rse.served.apis import CompletionAPI, ServerInfo
from llama_index.packs.self_rag_rse.served.greedy import check_greedy
from llama_index.packs.self_rag_rse.served.wire import Completion

logger = logging.getLogger(__name__)

#: The token groups whose members must all be known where a score reads them.
GROUPS: dict[str, tuple[str, ...]] = {
    "retrieval": (RETRIEVAL, NO_RETRIEVAL),
    "relevance": RELEVANCE_TOKENS,
    "support": GROUNDING_TOKENS,
    "utility": UTILITY_TOKENS,
}


class Followups:
    """Follow-up requests for one critic.

    Args:
        top_n: the log-probs per position the completions asked for.
        refetch: whether to ask the server for a group outside the top N (else bound it).
    """

    def __init__(self, top_n: int, refetch: bool) -> None:
        self.top_n = top_n
        self.refetch = refetch
        self._warned = False

    async def complete_positions(
        self,
        backend: CompletionAPI,
        info: ServerInfo,
        prompt: Any,
        completion: Completion,
        needs: Sequence[tuple[int, str]],
    ) -> dict[str, Any]:
        """Fill unreported positions, check greedy decoding (raises
        :class:`~.greedy.ServerNotGreedy`), and make every group in ``needs`` (position, group
        name) fully known. Returns the judgement's ``details``.
        """
        keys = completion.keys
        details: dict[str, Any] = {"api": info.api, "server": info.server}
        # Positions the server left out first: their distribution (top N), their own log-prob
        # for the sequence score, their bytes.
        gaps = [i for i, p in enumerate(completion.positions) if not p.reported]
        fetched = await asyncio.gather(
            *(backend.refetch(info, prompt, keys[:i], self.top_n) for i in gaps)
        )
        for i, got in zip(gaps, fetched, strict=True):
            slot = completion.positions[i]
            slot.top = got.top
            slot.pieces = got.pieces
            slot.logprob = (got.top or {}).get(slot.key, slot.logprob)
        check_greedy(
            completion,
            server=info.server,
            url=backend.client.url(backend.endpoint),
            sent=info.sampling,
        )
        requests = len(gaps)
        missing: list[tuple[int, str, list[str]]] = []
        for position, group in needs:
            top = completion.positions[position].top
            members = [info.keys[t] for t in GROUPS[group]]
            if top is None or not all(m in top for m in members):
                missing.append((position, group, members))
        bounded: list[str] = []
        reasons: list[str] = []
        if missing and self.refetch and backend.can_refetch:
            found = await asyncio.gather(
                *(backend.refetch_group(info, prompt, completion, i, m) for i, _, m in missing)
            )
            refetched = []
            for (i, group, members), answer in zip(missing, found, strict=True):
                requests += answer.requests
                if answer.values is None:
                    self._bound(completion, i, members)
                    bounded.append(group)
                    reasons.append(f"{group}: {answer.why}")
                    continue
                slot = completion.positions[i]
                # All of a group's values from one source: ratios are what the scores read.
                slot.top = {**(slot.top or {}), **answer.values}
                refetched.append(group)
            if refetched:
                details["refetched"] = refetched
        else:
            for i, group, members in missing:
                self._bound(completion, i, members)
                bounded.append(group)
        if requests:
            details["followup_requests"] = requests
        if gaps:
            details["unreported_positions"] = len(gaps)
        if bounded:
            details["bounded"] = bounded
            if not self._warned:
                self._warned = True
                why = f" ({'; '.join(reasons)})" if reasons else ""
                logger.warning(
                    "served critic: %s read with a bound (a reflection token outside the top %d "
                    "log-probs%s; flagged in each judgement's details['bounded'], logged once): "
                    "raise top_logprobs (vLLM: --max-logprobs) or serve the model with "
                    "llama-server for exact scores",
                    ", ".join(bounded),
                    self.top_n,
                    why,
                )
        return details

    @staticmethod
    def _bound(completion: Completion, i: int, members: Sequence[str]) -> None:
        """The missing members' log-probs bounded by the least likely token shown."""
        top = completion.positions[i].top
        if top:
            floor = min(top.values())
            for member in members:
                top.setdefault(member, floor)
