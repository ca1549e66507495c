"""Granularity values: block forms, JSON round trip, the per-sequence rule for activations."""

import pytest

from models.errors import UserError
from qbench.quant.granularity import (
    PerAxis,
    PerBlock,
    PerGroup,
    PerTensor,
    PerToken,
    granularity_from_dict,
    per_sequence,
)

ALL = [PerTensor(), PerAxis(0), PerAxis(-1), PerToken(), PerGroup(4), PerBlock((1, -1, 2))]


@pytest.mark.parametrize("g", ALL, ids=str)
def test_json_round_trip(g):
    assert granularity_from_dict(g.to_dict()) == g


def test_block_forms():
    assert PerTensor().block(3) == (-1, -1, -1)
    assert PerAxis(0).block(2) == (1, -1)
    assert PerAxis(-1).block(3) == (-1, -1, 1)
    assert PerToken().block(3) == (1, 1, -1)
    assert PerGroup(32).block(2) == (1, 32)


def test_bad_values_are_user_errors():
    with pytest.raises(UserError, match="out of range"):
        PerAxis(2).block(2)
    with pytest.raises(UserError, match="group_size"):
        PerGroup(0)
    with pytest.raises(UserError, match="does not fit"):
        PerBlock((1, -1)).block(3)
    with pytest.raises(UserError, match="per_tensr"):
        granularity_from_dict({"kind": "per_tensr"})


def test_per_sequence_never_shares_a_scale_across_the_batch():
    assert per_sequence(PerTensor(), 3) == PerBlock((1, -1, -1))  # one scale per sequence over (T, C)
    assert per_sequence(PerAxis(-1), 3) == PerBlock((1, -1, 1))  # one per (sequence, channel)
    assert per_sequence(PerToken(), 3) == PerToken()
    assert per_sequence(PerGroup(8), 3) == PerGroup(8)
    assert per_sequence(PerTensor(), 2) == PerTensor()  # a (T, C) input is one sequence
