"""Scheme overrides ``NAME:key=value,…``: parsing, canonical names, validation, JSON round trip."""

import json

import pytest

from models.errors import UserError
from qbench.quant.granularity import PerAxis, PerGroup, PerTensor
from qbench.quant.overrides import KEYS, SYNTAX
from qbench.quant.schemes import SCHEMES, QuantScheme, get_scheme


def test_bits_overrides_and_canonical_name():
    s = get_scheme("absmax-coarse:w=4,a=4,o=4")
    assert (s.weight_bits, s.act_bits, s.out_bits) == (4, 4, 4)
    assert s.name == "absmax-coarse:a=4,o=4,w=4"  # base + sorted overrides
    assert s.label == "W4A4-tensor+out"  # short table name
    base = get_scheme("absmax-coarse")
    assert (s.weight_granularity, s.act_granularity, s.out_granularity) == (
        base.weight_granularity,
        base.act_granularity,
        base.out_granularity,
    )
    # order, aliases, spacing and case do not matter; the same variant is the same scheme
    assert get_scheme("coarse: O=4, a=4,w=4") == s
    assert get_scheme(s.name) == s


def test_overrides_that_change_nothing_vanish():
    assert get_scheme("absmax-coarse:w=8,static=false") is get_scheme("absmax-coarse")
    assert get_scheme("absmax-coarse:w=8,a=6").name == "absmax-coarse:a=6"
    assert get_scheme("absmax-coarse:w=8,a=6").label == "W8A6-tensor+out8"


def test_group_sym_and_float_overrides():
    g = get_scheme("zeropoint-int4:group=128")

    def config(scheme):
        return {k: v for k, v in scheme.to_dict().items() if k not in ("name", "description")}

    assert g.weight_granularity == PerGroup(128) and config(g) == config(get_scheme("zeropoint-int4-g128"))
    assert g.label == get_scheme("zeropoint-int4-g128").label == "W4-g128-zp"
    assert get_scheme("zeropoint-int4-g128:group=none").weight_granularity == PerAxis(0)
    assert get_scheme("absmax-fine:group=tensor").weight_granularity == PerTensor()
    sym = get_scheme("zeropoint-int4-g128:sym=true,w=3")
    assert (sym.weight_bits, sym.weight_symmetric, sym.label) == (3, True, "W3-g128")
    fa = get_scheme("absmax-coarse:w=none")
    assert fa.weight_bits is None and fa.label == "A8-tensor+out"
    assert get_scheme("absmax-fine:agran=channel").act_granularity == PerAxis(-1)
    assert get_scheme("absmax-coarse:head=true").quantize_lm_head
    assert get_scheme("smoothquant:alpha=0.8").param("alpha") == 0.8
    assert get_scheme("hadamard-absmax-coarse:seed=3").param("seed") == 3


def test_static_on_a_per_token_scheme_becomes_per_tensor():
    s = get_scheme("absmax-fine:static=true")
    assert s.static and s.act_granularity == PerTensor() and s.name == "absmax-fine:static=true"
    assert s.label == "W8A8-channel/tensor-static"
    assert get_scheme("absmax-fine:static=true,agran=channel").act_granularity == PerAxis(-1)
    assert get_scheme("absmax-coarse:static=true,calib=4,calib_seed=1").calib_windows == 4


@pytest.mark.parametrize(
    "name, match",
    [
        (
            "absmax-coarse:grp=4",
            r"unknown override key 'grp' \(did you mean 'group'\?\).*valid keys: w \(2-8\|none\)",
        ),
        ("absmax-coarse:w=9", r"w='9' is not valid; w takes an integer 2–8 or none"),
        ("absmax-coarse:w=1", "2–8"),
        ("absmax-coarse:a=four", "2–8"),
        ("absmax-coarse:group=0", "positive integer"),
        ("absmax-coarse:sym=maybe", "true or false"),
        ("absmax-coarse:agran=row", "token, tensor or channel"),
        ("absmax-coarse:w", "not key=value"),
        ("absmax-coarse:", "nothing after ':'"),
        ("absmax-coarse:w=4,w=5", "given twice"),
        ("absmax-corse:w=4", "did you mean 'absmax-coarse'"),
        ("bnb-nf4:w=3", "unknown override key 'w'.*valid keys: head"),
        ("zeropoint-int4:static=true", "static=true needs quantised activations"),
        ("absmax-fine:static=true,agran=token", "static activation scales are per tensor or per channel"),
        ("llm-int8:alpha=0.5", "unknown override key 'alpha'"),
        ("smoothquant:alpha=x", "alpha='x' is not valid"),
        ("zeropoint-int4:rotate=quarot,kv_rotate=true", "kv_rotate is a KV-cache option.*--kv-rotate"),
    ],
)
def test_bad_overrides_are_one_line_user_errors(name, match):
    with pytest.raises(UserError, match=match) as e:
        get_scheme(name)
    assert "\n" not in str(e.value)


@pytest.mark.parametrize(
    "name",
    [
        "absmax-coarse:w=4,a=4,o=4",
        "absmax-fine:static=true,calib=3,calib_seed=7",
        "zeropoint-int4:group=64,sym=true,w=3",
        "smoothquant:alpha=0.75,static=true",
        "hadamard-absmax-coarse:seed=2,head=true",
        "absmax-moderate:w=none,a=6",
    ],
)
def test_json_round_trip_and_name_rebuilds(name):
    scheme = get_scheme(name)
    text = json.dumps(scheme.to_dict())
    back = QuantScheme.from_dict(json.loads(text))
    assert back == scheme and hash(back) == hash(scheme)
    assert get_scheme(scheme.name) == scheme  # the canonical name alone rebuilds it too


def test_every_registered_scheme_accepts_head_and_the_syntax_is_documented():
    for name in SCHEMES:
        if SCHEMES.get(name).method == "gguf":  # llama.cpp chooses its tensors' types: no overrides
            with pytest.raises(UserError, match="take no overrides"):
                get_scheme(f"{name}:head=true")
            continue
        assert get_scheme(f"{name}:head=true").quantize_lm_head
    assert all(key in SYNTAX for key in KEYS)
