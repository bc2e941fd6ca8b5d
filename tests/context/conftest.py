"""Fixtures for the context tests: a scripted LLM double and small structured documents."""

from __future__ import annotations

import json
import re
from collections.abc import Callable

import pytest
from scripted import ScriptedLLM


def window_of(prompt: str) -> tuple[int, int]:
    """The (first, last) line numbers a sectioning prompt asks about."""
    match = re.search(r"Divide lines (\d+) to (\d+)", prompt)
    assert match, prompt[:200]
    return int(match.group(1)), int(match.group(2))


def shown_lines(prompt: str) -> list[tuple[int, str]]:
    """The numbered lines shown in a sectioning prompt."""
    return [(int(n), t) for n, t in re.findall(r"^\[(\d+)\] (.*)$", prompt, re.MULTILINE)]


@pytest.fixture
def lines_asked() -> Callable[[str], tuple[int, int]]:
    """:func:`window_of` as a fixture."""
    return window_of


@pytest.fixture
def heading_partition() -> Callable[[str], str]:
    """A model script: a section at the window's first line and at every Markdown heading."""

    def script(prompt: str) -> str:
        first, last = window_of(prompt)
        starts = dict([(first, "Opening")])
        starts.update({n: t.lstrip("# ") for n, t in shown_lines(prompt) if t.startswith("#")})
        ordered = sorted(starts.items())
        sections = [
            {
                "title": title,
                "start_line": n,
                "end_line": ordered[i + 1][0] - 1 if i + 1 < len(ordered) else last,
            }
            for i, (n, title) in enumerate(ordered)
        ]
        return json.dumps({"sections": sections})

    return script


@pytest.fixture
def scripted() -> Callable[..., ScriptedLLM]:
    """``scripted(script, name="scripted", delay=0.0)``: a :class:`ScriptedLLM`."""
    return lambda script, name="scripted", **kwargs: ScriptedLLM(script, model=name, **kwargs)


#: A Markdown document with nested headings, a fenced block and a numbered list.
MARKDOWN = """# Field guide to herons

Herons are wading birds. This guide covers where they live and what they eat.

## Habitat

They live near water: marshes, lake shores and slow rivers.
Most species nest in colonies high in trees.

## Diet

### Fish

The grey heron waits motionless and strikes fast. It swallows the catch whole.

```python
# not a heading: inside a fenced block
print("heron")
```

### Other prey

1. Frogs

2. Small mammals

It also takes insects when fish are scarce.
"""


@pytest.fixture
def markdown() -> str:
    """:data:`MARKDOWN`."""
    return MARKDOWN
