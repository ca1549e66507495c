import pytest
import torch

from models import UserError
from qbench.eval.load import load_model, resolve


def test_loads_our_checkpoint(ckpt_dir):
    lm = load_model(str(ckpt_dir))
    assert lm.description["kind"] == "qbench" and lm.name == "micro_softmax1"
    assert lm.description["config"]["attn"] == "softmax1"


@pytest.mark.parametrize("fixture", ["hf_gpt2_dir", "hf_llama_dir"])
def test_loads_transformers_folders_offline(fixture, request):
    lm = load_model(str(request.getfixturevalue(fixture)))
    assert lm.description["kind"] == "transformers"
    assert lm.tokenizer("Hello")["input_ids"]
    assert not lm.model.training


def test_bare_name_resolves_under_ckpts(ckpt_dir, tmp_path, monkeypatch):
    (tmp_path / "ckpts").mkdir()
    (tmp_path / "ckpts" / "ortho").symlink_to(ckpt_dir)
    monkeypatch.chdir(tmp_path)
    assert resolve("ortho").name == "ortho"


def test_bad_paths_are_clear_errors(tmp_path):
    with pytest.raises(UserError, match="does not exist"):
        load_model(str(tmp_path / "missing"))
    (tmp_path / "junk").mkdir()
    with pytest.raises(UserError, match="neither a qbench checkpoint"):
        load_model(str(tmp_path / "junk"))
    with pytest.raises(UserError, match="unknown dtype"):
        load_model(str(tmp_path / "junk"), dtype="float8")


def test_pickle_weights_are_refused_unless_allowed(hf_gpt2_dir, tmp_path):
    import shutil

    folder = tmp_path / "unsafe"
    shutil.copytree(hf_gpt2_dir, folder)
    from safetensors.torch import load_file

    state = load_file(str(folder / "model.safetensors"))
    (folder / "model.safetensors").unlink()
    torch.save(state, folder / "pytorch_model.bin")
    with pytest.raises(UserError, match="allow-unsafe-weights"):
        load_model(str(folder))
    assert load_model(str(folder), allow_unsafe_weights=True).description["kind"] == "transformers"


def test_hub_name_offline_is_a_clear_error(monkeypatch):
    monkeypatch.setenv("HF_HUB_OFFLINE", "1")
    with pytest.raises(UserError, match="cannot load hub model"):
        load_model("nobody-here/no-such-model")
