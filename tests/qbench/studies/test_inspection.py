import json

import numpy as np
import pytest
import torch

from models.hf import to_hf_model
from models.observe import observe
from qbench.eval.load import LoadedModel
from qbench.eval.metrics import Protocol, make_windows
from qbench.studies.inspection import delimiter_ids, inspect_model, observe_window
from qbench.studies.plots import max_pool
from tests.qbench.conftest import micro_config, trained_like

PNG_MAGIC = b"\x89PNG\r\n\x1a\n"


def planted_model():
    """softmax-1 micro model with a massive activation (2000) on channel 9 of the first token."""
    model = trained_like(micro_config(attn="softmax1"))
    with torch.no_grad():
        model.transformer.wte.weight[:, 9] = 0.0
        model.transformer.wpe.weight[0, 9] = 2000.0
    return model


@pytest.fixture(scope="module")
def inspected(tokenizer, tmp_path_factory):
    out = tmp_path_factory.mktemp("inspect")
    lm = LoadedModel(planted_model(), tokenizer, "planted", "memory", {"kind": "qbench"})
    return out, inspect_model(lm, Protocol(tokens=32 * 3, window=32), out, n_windows=3)


def test_inspect_writes_metrics_and_figures(inspected):
    out, result = inspected
    written = json.loads((out / "metrics.json").read_text())
    assert written["outliers"] == result["outliers"] and written["plots"]["attention"] == "attention.png"
    assert written["protocol"]["windows"] == 3 and written["env"]["software"]["torch"]
    assert written["outliers"]["max_abs_first"] == pytest.approx(2000, rel=0.01)
    assert len(written["outliers_per_layer"]["kurtosis_first"]) == 2
    massive = written["massive_activations"]
    assert massive["total"] == 3 * 2  # first token of 3 windows, in both layers (the residual carries it)
    assert massive["layers"][0]["channels"] == [9] and massive["layers"][0]["positions"]["first"] == 3
    for name in ("attention.png", "activations.png", "layers.png"):
        data = (out / name).read_bytes()
        assert data.startswith(PNG_MAGIC) and len(data) > 10_000, name


def test_attention_map_is_the_mean_over_layers_and_heads(tokenizer):
    model = planted_model()
    ids = make_windows(tokenizer, Protocol(tokens=31, window=32), context=32).ids[0]
    mean, hidden = observe_window(model, ids)
    with observe(model, attention=True) as obs:
        model(ids[None])
    expected = torch.stack([a[0] for a in obs.attention]).mean((0, 1)).numpy()
    np.testing.assert_allclose(mean, expected, rtol=1e-5, atol=1e-7)
    assert (mean.sum(-1) < 1).all()  # softmax-1 rows are reported as computed, not renormalised
    assert len(hidden) == 2 and hidden[0].shape == (32, 32)
    theirs, _ = observe_window(to_hf_model(model, tokenizer), ids)  # transformers path: same map
    np.testing.assert_allclose(theirs, mean, rtol=1e-4, atol=1e-6)


def test_max_pool_keeps_every_spike():
    x = np.zeros((1000, 700))
    x[3, 511] = 5.0
    pooled = max_pool(x, 256, 256)
    assert pooled.shape[0] <= 256 and pooled.shape[1] <= 256 and pooled.max() == 5.0


def test_delimiters_include_the_separator_and_full_stop(tokenizer):
    ids = delimiter_ids(tokenizer)
    assert tokenizer.convert_tokens_to_ids("<|endoftext|>") in ids
    assert tokenizer.encode(".", add_special_tokens=False)[0] in ids
