"""lm-eval offline: a local YAML task over a few documents of the embedded corpus's validation split."""

import json
import math
import sys

import pytest

from models import build
from models.errors import UserError
from qbench.eval.load import LoadedModel, load_model
from qbench.quant import FakeQuantLinear
from qbench.studies.lm_eval_adapter import quantised_transformers, run_lm_eval
from tests.qbench.conftest import micro_config
from trainers.data import load_documents

pytest.importorskip("lm_eval")

TASK = "qbench_tiny_ppl"


@pytest.fixture(scope="module")
def task_dir(tmp_path_factory):
    folder = tmp_path_factory.mktemp("lm_eval_tasks")
    docs = [doc[:300] for _, doc in zip(range(3), load_documents("embedded", "validation"), strict=False)]
    (folder / "docs.jsonl").write_text("".join(json.dumps({"text": d}) + "\n" for d in docs))
    (folder / f"{TASK}.yaml").write_text(
        f"task: {TASK}\n"
        "dataset_path: json\n"
        f"dataset_kwargs:\n  data_files:\n    test: {folder / 'docs.jsonl'}\n"
        "test_split: test\n"
        "output_type: loglikelihood_rolling\n"
        'doc_to_text: ""\n'
        'doc_to_target: "{{text}}"\n'
        "metric_list:\n  - metric: word_perplexity\n  - metric: byte_perplexity\n"
        "metadata:\n  version: 1.0\n"
    )
    return folder


@pytest.fixture(autouse=True)
def offline(monkeypatch):
    monkeypatch.setenv("HF_HUB_OFFLINE", "1")
    monkeypatch.setenv("HF_DATASETS_OFFLINE", "1")


def word_ppl(result):
    return result["results"][TASK]["word_perplexity,none"]


def test_transformers_folder_float_and_quantised(hf_gpt2_dir, task_dir):
    lm = load_model(str(hf_gpt2_dir))
    fp = run_lm_eval(lm, "fp", [TASK], include_path=task_dir, limit=2)
    q = run_lm_eval(lm, "absmax-coarse", [TASK], include_path=task_dir, limit=2)
    assert math.isfinite(word_ppl(fp)) and math.isfinite(word_ppl(q)) and word_ppl(fp) > 1
    assert fp["n-samples"][TASK]["effective"] == 2
    assert q["qbench"]["scheme"]["name"] == "absmax-coarse" and q["qbench"]["mode"] == "fake"
    assert q["qbench"]["model"]["kind"] == "transformers" and q["qbench"]["env"]["software"]["lm_eval"]
    assert word_ppl(q) != word_ppl(fp)  # the quantised copy is what was evaluated
    json.dumps(q)  # provenance and results are plain JSON


def test_our_checkpoint_is_converted_then_quantised(ckpt_dir, task_dir):
    lm = load_model(str(ckpt_dir))
    model, scheme = quantised_transformers(lm, "zeropoint-int4")
    assert type(model).__name__ == "GPT2LMHeadModel" and scheme["name"] == "zeropoint-int4"
    assert any(isinstance(m, FakeQuantLinear) for m in model.modules())
    result = run_lm_eval(lm, "zeropoint-int4", TASK, include_path=task_dir, limit=2)
    assert math.isfinite(word_ppl(result)) and result["qbench"]["model"]["converted_to_transformers"]


def test_bad_input_is_a_user_error(tokenizer, task_dir, monkeypatch):
    sink = LoadedModel(build(micro_config(attn="sink")), tokenizer, "sink", "memory", {"kind": "qbench"})
    with pytest.raises(UserError, match=r"lm-eval needs a transformers model.*attn='sink'"):
        run_lm_eval(sink, "fp", [TASK], include_path=task_dir)
    lm = LoadedModel(build(micro_config()), tokenizer, "m", "memory", {"kind": "qbench"})
    with pytest.raises(UserError, match="did you mean 'absmax-coarse'"):
        run_lm_eval(lm, "absmax-corse", [TASK], include_path=task_dir)
    with pytest.raises(UserError, match="unknown mode"):
        run_lm_eval(lm, "absmax-coarse", [TASK], include_path=task_dir, mode="fast")
    gated = LoadedModel(
        build(micro_config(family="llama", gate="headwise")), tokenizer, "gated", "memory", {"kind": "qbench"}
    )
    with pytest.raises(UserError, match=r"gated.*inside q_proj.*float model"):  # float is fine (models.hf)
        quantised_transformers(gated, "absmax-coarse")
    assert type(quantised_transformers(gated, "fp")[0]).__name__ == "LlamaForCausalLM"
    monkeypatch.setitem(sys.modules, "lm_eval", None)  # as if not installed
    with pytest.raises(UserError, match=r"pip install 'lm-eval\[hf\]'"):
        run_lm_eval(lm, "fp", [TASK], include_path=task_dir)


def test_unknown_task_is_a_did_you_mean_error(tokenizer, task_dir, monkeypatch):
    """A name the include path lacks is looked for among lm-eval's built-in tasks too (the second index asks for
    them), then refused with the nearest name. The built-in index itself (~14,000 YAMLs: 15-40 s on 2 busy cores)
    is left out here: the nearest name is the local task's either way."""
    import lm_eval.tasks

    asked = []

    class WithoutBuiltins(lm_eval.tasks.TaskManager):
        def __init__(self, *args, include_defaults=True, **kwargs):
            asked.append(include_defaults)
            super().__init__(*args, include_defaults=False, **kwargs)

    monkeypatch.setattr(lm_eval.tasks, "TaskManager", WithoutBuiltins)
    lm = LoadedModel(build(micro_config()), tokenizer, "m", "memory", {"kind": "qbench"})
    with pytest.raises(UserError, match=f"did you mean '{TASK}'"):
        run_lm_eval(lm, "fp", [TASK[:-1]], include_path=task_dir)
    assert asked == [False, True]  # the include path alone, then with the built-in tasks


def test_command_writes_results_with_provenance(hf_gpt2_dir, task_dir, tmp_path, capsys):
    import argparse

    from qbench.cli.lm_eval import add_arguments, run

    parser = argparse.ArgumentParser()
    add_arguments(parser)
    out = tmp_path / "r.json"
    argv = ["--ckpt", str(hf_gpt2_dir), "--scheme", "fine", "--tasks", TASK, "--include-path", str(task_dir)]
    run(parser.parse_args([*argv, "--limit", "1", "--json", str(out)]))
    written = json.loads(out.read_text())
    assert written["qbench"]["scheme"]["name"] == "absmax-fine"
    assert written["n-samples"][TASK]["effective"] == 1
    assert "word_perplexity" in capsys.readouterr().out
