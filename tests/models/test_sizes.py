"""The torch-free parameter count agrees with the model built on 'meta' for every preset and every switch."""

from __future__ import annotations

import itertools

import pytest

from models.config import CHOICES, PRESETS, family_config
from models.sizes import parameter_counts
from models.transformer import count_parameters


@pytest.mark.parametrize("name", list(PRESETS))
def test_every_preset(name):
    config = PRESETS.get(name).config
    assert parameter_counts(config) == count_parameters(config)


def _variants():
    """Each family's default with one switch changed at a time, with and without biases and tied embeddings: the
    count is a sum over layers, so this meets every term and its bias/tying interaction (the full product of the
    switches is 54 times as many meta builds)."""
    for family, bias, tie in itertools.product(CHOICES["family"], (True, False), (True, False)):
        base = dict(
            n_layer=2, n_head=2, d_model=8, d_ff=12, context=6, vocab_size=10, bias=bias, tie_embeddings=tie
        )
        yield family_config(family, **base)
        yield family_config(family, **base, emb_proj=True)  # a boolean switch, not in CHOICES
        if family == "llama":  # grouped-query attention: k and v narrower than q
            yield family_config(family, **dict(base, n_head=4), n_kv_head=2)
        for switch, values in CHOICES.items():  # a switch added to the config is covered at once
            for value in values:
                if switch != "family":
                    yield family_config(family, **base, **{switch: value})


def test_every_switch():
    for config in _variants():
        assert parameter_counts(config) == count_parameters(config), config
