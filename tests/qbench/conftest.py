"""Tiny models for the harness tests: a qbench checkpoint and transformers GPT-2 / Llama folders, built here."""

from __future__ import annotations

import pytest
import torch

from models import build, family_config
from models.checkpoint import save_checkpoint
from models.hf import to_hf_model
from models.tokenizer import load_tokenizer


def micro_config(family: str = "gpt2", **switches):
    return family_config(
        family, n_layer=2, n_head=4, d_model=32, d_ff=64, context=32, vocab_size=8192, **switches
    )


def trained_like(config, seed: int = 0):
    """A micro model with an outlier planted in one residual channel, so statistics have something to find."""
    model = build(config, seed=seed)
    with torch.no_grad():
        model.transformer.wte.weight[:, 5] += 3.0
    return model.eval()


def planted_model():
    """A micro Llama whose block-1 down_proj input has one channel 1000× the others, and whose output matters.

    Hidden unit 7's up_proj row is scaled up by 1000 and its down_proj column down by as much, so the float
    function is unchanged while down_proj's input carries an outlier channel; down_proj and the LM head are
    amplified (×20) so that the perplexity depends on that layer at all (a random micro model's barely does).
    """
    model = trained_like(micro_config("llama"))
    mlp = model.transformer.h[1].mlp
    with torch.no_grad():
        mlp.up_proj.weight[7] *= 1000.0
        mlp.down_proj.weight[:, 7] /= 1000.0
        mlp.down_proj.weight *= 20.0
        model.lm_head.weight *= 20.0
    return model


@pytest.fixture(scope="session")
def tokenizer():
    return load_tokenizer("bpe8192")


@pytest.fixture(scope="session")
def ckpt_dir(tmp_path_factory, tokenizer):
    path = tmp_path_factory.mktemp("ckpts") / "micro_softmax1"
    save_checkpoint(
        path, trained_like(micro_config(attn="softmax1")), tokenizer, provenance={"training": None}
    )
    return path


def _transformers_folder(tmp_path_factory, tokenizer, family: str):
    """A transformers folder of a micro model of ``family``, written by transformers itself."""
    path = tmp_path_factory.mktemp("hf") / f"{family}-micro"
    to_hf_model(trained_like(micro_config(family)), tokenizer).save_pretrained(path)
    tokenizer.save_pretrained(path)
    return path


@pytest.fixture(scope="session")
def hf_gpt2_dir(tmp_path_factory, tokenizer):
    """GPT-2 layout: Conv1D layers."""
    return _transformers_folder(tmp_path_factory, tokenizer, "gpt2")


@pytest.fixture(scope="session")
def hf_llama_dir(tmp_path_factory, tokenizer):
    return _transformers_folder(tmp_path_factory, tokenizer, "llama")
