"""An append-only JSON-lines cache, so a rerun after a crash resumes where the last one stopped.

One line per finished item: an engine's answer to a question (key: settings, question, engine)
or one judgement (key: settings, question, engine, judge, metric). Lines are flushed as they are
written; a line cut short by a crash is skipped on reading (with one warning), and the item is
simply done again. Failed items are never written, so a rerun retries exactly those.
"""

from __future__ import annotations

import json
import logging
import threading
from pathlib import Path
from typing import Any

logger = logging.getLogger(__name__)

Key = tuple[str, ...]


class ResultCache:
    """Finished answers and judgements, kept in memory and (with ``path``) in a ``.jsonl`` file."""

    def __init__(self, path: str | Path | None = None) -> None:
        self.path = Path(path) if path is not None else None
        self._items: dict[tuple[str, Key], dict[str, Any]] = {}
        self._lock = threading.Lock()
        if self.path is not None and self.path.exists():
            self._load(self.path)

    def _load(self, path: Path) -> None:
        bad = 0
        for line in path.read_text(encoding="utf-8").splitlines():
            if not line.strip():
                continue
            try:
                item = json.loads(line)
                self._items[(item["kind"], tuple(item["key"]))] = item["value"]
            except (json.JSONDecodeError, KeyError, TypeError):
                bad += 1
        if bad:
            logger.warning(
                "%s: skipped %d unreadable line(s) (a run cut short?); those items are redone",
                path,
                bad,
            )

    def __len__(self) -> int:
        return len(self._items)

    def get(self, kind: str, key: Key) -> dict[str, Any] | None:
        """The value stored for ``(kind, key)``, or ``None``."""
        with self._lock:
            return self._items.get((kind, tuple(key)))

    def put(self, kind: str, key: Key, value: dict[str, Any]) -> None:
        """Store ``value`` and append it to the file at once."""
        line = json.dumps({"kind": kind, "key": list(key), "value": value}, ensure_ascii=False)
        with self._lock:
            self._items[(kind, tuple(key))] = value
            if self.path is not None:
                self.path.parent.mkdir(parents=True, exist_ok=True)
                with self.path.open("a", encoding="utf-8") as out:
                    out.write(line + "\n")
                    out.flush()
