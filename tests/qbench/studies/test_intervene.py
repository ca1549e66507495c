import pytest
import torch

from models.errors import UserError
from models.hf import to_hf_model
from qbench.eval.load import LoadedModel
from qbench.eval.metrics import Protocol
from qbench.studies.intervene import intervene
from tests.qbench.conftest import micro_config, trained_like

PROTOCOL = Protocol(tokens=32 * 6, window=32, batch_size=3)


def dependent_model():
    """A micro GPT-2 with a massive activation (5000) on channel 9 of the first token that the model depends on.

    The final norm's gain is raised to 30 so the logits are sharp: then perplexity reacts to the change in the
    first token's keys and values that removing the massive activation causes (through ln_1 it dominates the
    first token's normalised state). A constant replacement near 5000 changes nothing: LayerNorm sees the same
    direction — Sun et al.'s "massive activations act as fixed biases".
    """
    model = trained_like(micro_config())
    with torch.no_grad():
        model.transformer.wte.weight[:, 9] = 0.0
        model.transformer.wpe.weight[0, 9] = 5000.0
        model.transformer.ln_f.weight.fill_(30.0)
    return model


@pytest.fixture(scope="module")
def lm(tokenizer):
    return LoadedModel(dependent_model(), tokenizer, "dependent", "memory", {"kind": "qbench"})


def test_zeroing_hurts_and_mean_filling_does_not(lm):
    zero = intervene(lm, PROTOCOL, mode="zero", n_windows=4)
    mean = intervene(lm, PROTOCOL, mode="mean", n_windows=4)
    assert zero["perplexity"] == mean["perplexity"]  # same float baseline
    assert zero["ppl_ratio"] > 1.05  # measurable damage
    assert abs(mean["ppl_ratio"] - 1) < 0.1 * abs(zero["ppl_ratio"] - 1)
    assert [(s["layer"], s["channel"]) for s in zero["sites"]] == [(0, 9), (1, 9)]
    assert zero["sites"][0]["mean"] == pytest.approx(5000, rel=1e-3) and zero["sites"][0]["count"] == 4
    # zeroed in block 0, the value is gone from the residual stream: block 1 has nothing left to edit
    assert zero["edited_activations"] == 6  # the first token of each of the 6 evaluated windows
    assert mean["edited_activations"] == 12  # mean-filled in block 0, still massive (and refilled) in block 1
    assert zero["ppl_change_pct"] == pytest.approx((zero["ppl_ratio"] - 1) * 100)


def test_transformers_model_gets_the_same_intervention(lm, tokenizer):
    ours = intervene(lm, PROTOCOL, mode="zero", n_windows=4)
    hf = LoadedModel(to_hf_model(lm.model, tokenizer), tokenizer, "hf", "memory", {"kind": "transformers"})
    theirs = intervene(hf, PROTOCOL, mode="zero", n_windows=4)
    assert theirs["ppl_ratio"] == pytest.approx(ours["ppl_ratio"], rel=1e-4)
    assert theirs["edited_activations"] == ours["edited_activations"]


def test_no_massive_activations_is_said_plainly(tokenizer):
    plain = LoadedModel(trained_like(micro_config()), tokenizer, "plain", "memory", {})
    result = intervene(plain, PROTOCOL, mode="zero", n_windows=2)
    assert result["sites"] == [] and result["edited_activations"] == 0
    assert result["intervened_perplexity"] == result["perplexity"] and result["ppl_ratio"] == 1.0
    assert "no massive activations" in result["note"]


def test_bad_mode_is_a_did_you_mean_error(lm):
    with pytest.raises(UserError, match="did you mean 'zero'"):
        intervene(lm, PROTOCOL, mode="zeros")
