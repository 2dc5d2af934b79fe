"""Fuzzing every config dataclass: any value either builds a config or raises one ConfigError
that names the field; never a deep traceback from another exception type."""

from __future__ import annotations

import dataclasses

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from core.config import ConfigError, KFACConfig
from core.eva import EvaConfig
from core.hybrid import HybridConfig
from core.mkor import MKORConfig

CONFIGS = (KFACConfig, MKORConfig, EvaConfig, HybridConfig)

ANY_VALUE = st.one_of(
    st.none(), st.booleans(), st.integers(-10**6, 10**6),
    st.floats(allow_nan=True, allow_infinity=True), st.text(max_size=12),
    st.lists(st.one_of(st.text(max_size=6), st.integers()), max_size=3),
    st.sampled_from(["eigen", "inverse", "cholesky", "pi", "full", "kfc", "kaisa", "dpkfac",
                     "comm-opt", "hybrid-opt", "osawa", "dp-kfac", "exact", "paper",
                     "official", "float16", "float32", "float64", "greedy"]),
)


def field_names(config_type: type) -> list[str]:
    return [f.name for f in dataclasses.fields(config_type)]


@pytest.mark.parametrize("config_type", CONFIGS, ids=lambda c: c.__name__)
@settings(max_examples=150, deadline=None)
@given(data=st.data())
def test_any_single_field_value_builds_or_names_the_field(config_type: type,
                                                          data: st.DataObject) -> None:
    name = data.draw(st.sampled_from(field_names(config_type)))
    value = data.draw(ANY_VALUE)
    try:
        config_type(**{name: value})
    except ConfigError as err:
        # a cross-field check may name the partner field; it must still be a field
        assert err.field_name in field_names(config_type), err
        assert "expected" in str(err)


@pytest.mark.parametrize("config_type", CONFIGS, ids=lambda c: c.__name__)
def test_defaults_are_valid(config_type: type) -> None:
    config_type()
