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


def test_only_the_unknown_options_are_named():
    assert reject_unknown("Thing", {"threshold": 1, "w_rel": 2}, ["threshold", "w_rel"]) is None
    with pytest.raises(TypeError) as info:
        reject_unknown("Thing", {"threshold": 1, "w_rell": 2}, ["threshold", "w_rel"])
    assert "unknown option 'w_rell' (did you mean 'w_rel'?);" in str(info.value)
    assert "'threshold'" not in str(info.value).split(";")[0]


@pytest.mark.parametrize("value", [math.nan, math.inf, -math.inf, "0.5", True])
def test_non_finite_or_non_numbers_are_rejected(value):
    with pytest.raises(ValueError, match="Thing: w must be a"):
        require_finite("Thing", w=value)


def test_finite_numbers_and_none_pass_and_the_first_bad_one_is_named():
    assert require_finite("Thing", a=0, b=1.5, c=None, d=-(2**60)) is None
    with pytest.raises(ValueError, match=r"Thing: c must be a finite number, got nan"):
        require_finite("Thing", a=0, b=1.5, c=math.nan)


def test_optional_import_names_the_extra():
    with pytest.raises(
        ImportError,
        match=r'plotting needs no_such_module: pip install "llama-index-packs-self-rag-rse\[plot',
    ):
        optional_import("no_such_module", "plotting", "plot")
