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


def test_one_vocabulary_for_what_a_scale_covers():
    """Labels, layer descriptions and messages all take their words from ``unit`` (one vocabulary)."""
    from qbench.quant.fake import describe
    from qbench.quant.granularity import PerAxis, PerGroup, PerTensor, PerToken, unit

    assert unit(PerAxis(0), "weight") == "channel" and unit(PerAxis(-1), "act") == "channel"
    assert unit(PerAxis(-1), "weight") == "axis-1"  # an input-channel scale on a weight is not "channel"
    assert unit(PerToken(), "act") == "token" and unit(PerGroup(32), "weight") == "g32"
    assert unit(PerTensor(), "weight") == "tensor" and unit(PerTensor(), "out") == "sequence"
    assert describe(4, PerGroup(32), False, "W") == "W4 zp per-g32"
    assert describe(8, PerTensor(), True, "A") == "A8 per-sequence"
    with pytest.raises(ValueError, match="role"):
        unit(PerTensor(), "W")
