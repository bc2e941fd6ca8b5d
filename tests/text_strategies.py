"""What the RSE property tests share: random texts made of awkward words and separators, and the
comparison of stitched text with its source.
"""

from __future__ import annotations

WORDS = ["alpha", "beta", "end.", "x", "while", "Über", "日本語", "\t", "  "]
SEPARATORS = [" ", " ", "\n", "\n\n", "  ", ". "]


def same_but_whitespace(a: str, b: str) -> bool:
    """Equal, except where both hold whitespace (a splitter strips it; stitching refills it)."""
    return len(a) == len(b) and all(
        x == y or (x.isspace() and y.isspace()) for x, y in zip(a, b, strict=True)
    )
