"""Unknown options are errors that name the closest valid option; numbers must be finite."""

from __future__ import annotations

import math

import pytest

from llama_index.packs.self_rag_rse.common.optional import optional_import
from llama_index.packs.self_rag_rse.common.options import reject_unknown, require_finite


def test_unknown_options_name_the_closest_and_list_the_valid_ones():
    with pytest.raises(TypeError) as info:
        reject_unknown("Thing", {"treshold": 1, "zzz": 2}, ["threshold", "w_rel"])
    message = str(info.value)
    assert "Thing got unknown options 'treshold' (did you mean 'threshold'?), 'zzz';" in message
    assert message.endswith("valid options: threshold, w_rel")


def test_known_options_pass():
    reject_unknown("Thing", {"threshold": 1}, ["threshold"])


@pytest.mark.parametrize("value", [math.nan, math.inf, -math.inf, "0.5", True])
def test_non_finite_or_non_numbers_are_rejected(value):
    with pytest.raises(ValueError, match="Thing: w must be a"):
        require_finite("Thing", w=value)


def test_finite_numbers_and_none_pass():
    require_finite("Thing", a=0, b=1.5, c=None)


def test_optional_import_names_the_extra():
    with pytest.raises(
        ImportError,
        match=r'plotting needs no_such_module: pip install "llama-index-packs-self-rag-rse\[plot',
    ):
        optional_import("no_such_module", "plotting", "plot")
