"""Schemes: registry contents, JSON round trip, labels, validation, did-you-mean."""

import dataclasses
import json

import pytest

from models.errors import UserError
from qbench.quant.granularity import PerAxis, PerTensor, PerToken
from qbench.quant.schemes import PAPER_SCHEMES, SCHEMES, QuantScheme, get_scheme

EXPECTED = {
    "absmax-fine",
    "absmax-fine-perchannel",
    "absmax-moderate",
    "absmax-coarse",
    "zeropoint-int4",
    "llm-int8",
    "bnb-nf4",
    "smoothquant",
    "hadamard-absmax-coarse",
    "hadamard-zeropoint-int4",
    # grouped weight-only
    "zeropoint-int4-g128",
    "zeropoint-int4-g64",
    "zeropoint-int4-g32",
    "zeropoint-int3-g128",
    "zeropoint-int2-g64",
    # W4A8, integer
    "absmax-w4a8",
    "absmax-w4a8-g32",
    "zeropoint-w4a8",
    "zeropoint-w4a8-g32",
    # floating-point formats, fake mode
    *("fp8-e4m3", "fp8-e4m3-rowwise", "fp8-e5m2", "fp8-e5m2-rowwise", "mxfp8", "mxfp6", "mxfp4", "nvfp4"),
    "nvfp4-torchao",
    # llama.cpp's file types, run by llama.cpp
    *(f"gguf:{t}" for t in ("f32", "f16", "bf16", "q8_0", "q6_k", "q5_k_m", "q5_k_s", "q5_1", "q5_0")),
    *(f"gguf:{t}" for t in ("q4_k_m", "q4_k_s", "q4_1", "q4_0", "iq4_nl", "iq4_xs", "q3_k_l", "q3_k_m")),
    *(f"gguf:{t}" for t in ("q3_k_s", "iq3_m", "iq3_s", "q2_k")),
}


def test_registry_holds_the_paper_schemes_and_baselines():
    assert set(SCHEMES.names()) == EXPECTED
    assert set(PAPER_SCHEMES) <= EXPECTED
    assert all(SCHEMES.describe(name) for name in SCHEMES)


@pytest.mark.parametrize("name", sorted(EXPECTED))
def test_json_round_trip(name):
    scheme = get_scheme(name)
    text = json.dumps(scheme.to_dict())
    assert QuantScheme.from_dict(json.loads(text)) == scheme
    assert get_scheme(json.loads(text)) == scheme
    assert hash(QuantScheme.from_dict(json.loads(text))) == hash(scheme)


def test_paper_table():
    fine, moderate, coarse, int4 = (get_scheme(n) for n in PAPER_SCHEMES)
    assert (fine.weight_granularity, fine.act_granularity, fine.act_bits) == (PerAxis(0), PerToken(), 8)
    assert get_scheme("absmax-fine-perchannel").act_granularity == PerAxis(-1)
    assert (moderate.weight_granularity, moderate.act_granularity, moderate.out_bits) == (
        PerTensor(),
        PerTensor(),
        None,
    )
    assert (coarse.out_bits, coarse.out_granularity) == (8, PerTensor())
    assert (int4.weight_bits, int4.weight_symmetric, int4.act_bits) == (4, False, None)
    ours = [n for n in SCHEMES if get_scheme(n).method != "gguf"]
    assert not any(get_scheme(n).quantize_lm_head for n in ours)  # documented default: the head stays float
    # llama.cpp's quantised file types quantise the head too (the record's artifact names its tensor type)
    assert get_scheme("gguf:q4_k_m").quantize_lm_head and not get_scheme("gguf:f32").quantize_lm_head


def test_labels():
    assert get_scheme("absmax-coarse").label == "W8A8-tensor+out"
    assert get_scheme("absmax-fine").label == "W8A8-channel/token"
    assert get_scheme("zeropoint-int4").label == "W4-channel-zp"
    assert len({get_scheme(n).label for n in SCHEMES}) == len(SCHEMES)  # labels tell schemes apart


def test_method_params_defaults_and_overrides():
    assert get_scheme("smoothquant").param("alpha") == 0.5
    assert get_scheme("llm-int8").param("threshold") == 6.0
    custom = dataclasses.replace(get_scheme("smoothquant"), params={"alpha": 0.8})
    assert custom.param("alpha") == 0.8 and custom != get_scheme("smoothquant")
    with pytest.raises(UserError, match="alpah"):
        QuantScheme("x", method="smoothquant", params={"alpah": 0.5})


def test_did_you_mean_and_bad_values():
    with pytest.raises(UserError, match="did you mean 'absmax-coarse'"):
        get_scheme("absmax-corse")
    assert get_scheme("coarse") is get_scheme("absmax-coarse")  # alias
    with pytest.raises(UserError, match="bits"):
        QuantScheme("x", weight_bits=12)
    with pytest.raises(UserError, match="method"):
        QuantScheme("x", method="gptq")
    with pytest.raises(UserError, match="field"):
        QuantScheme.from_dict({"name": "x", "wbits": 8})
    with pytest.raises(UserError):
        get_scheme(8)
