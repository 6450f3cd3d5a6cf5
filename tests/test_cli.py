"""The CLI and the API on bad input: one-line errors, exit status 2, typed exceptions."""

from __future__ import annotations

import json
import subprocess
import sys

import pytest
from conftest import tiny_model

from dcoco import (
    LLM,
    ConfigError,
    InvalidPromptError,
    ModelNotFoundError,
    PromptTooLongError,
    SamplingParams,
    UnknownMethodError,
)
from dcoco.cli import main
from dcoco.target import Target


@pytest.fixture(scope="module")
def tiny_dir(tmp_path_factory):
    """A tiny Llama saved as an HF directory, so the CLI path runs without the embedded model."""
    d = tmp_path_factory.mktemp("tiny")
    tiny_model("llama", seed=1, max_position_embeddings=64).save_pretrained(d)
    return str(d)


def run_cli(capsys, *args):
    code = main(list(args))
    out, err = capsys.readouterr()
    return code, out, err


def test_model_without_tokenizer_needs_token_ids(capsys, tmp_path, tiny_dir):
    f = tmp_path / "p.jsonl"
    f.write_text(json.dumps({"prompt": "ignored because tiny has no tokenizer"}) + "\n")
    code, out, err = run_cli(capsys, "generate", "--model", tiny_dir, "--prompt-file", str(f), "--json")
    assert code == 2 and "no tokenizer" in err and "Traceback" not in err


@pytest.mark.parametrize(
    "args,needle",
    [
        (["--prompt", "   "], "empty"),
        (["--prompt", "hi", "--method", "medusa"], "unknown method"),
        (["--prompt", "hi", "--temperature", "-1"], "temperature"),
        (["--prompt", "hi", "--top-p", "0"], "top_p"),
        (["--prompt", "hi", "--max-new-tokens", "0"], "max_tokens"),
        (["--prompt", "hi", "--num-speculative-tokens", "-3", "--method", "ngram"], "num_speculative_tokens"),
        (["--prompt", "hi", "--method", "dflash", "--lookup-tokens", "8"], "set lookup_first too"),
        (["--prompt", "hi", "--method", "dflash", "--lookup-first", "2", "--lookup-tokens", "0"], "lookup_num_tokens"),
        (["--prompt", "hi", "--model", "/nonexistent/model"], "not found"),
        (["--prompt-file", "/nonexistent/prompts.txt"], "not found"),
        ([], "no prompt"),
    ],
)
def test_bad_input_gives_one_line_error(capsys, args, needle):
    code, out, err = run_cli(capsys, "generate", *args)
    assert code == 2, err
    lines = [l for l in err.strip().splitlines() if l]
    assert len(lines) == 1 and lines[0].startswith("dcoco: error:") and needle in lines[0], err


def test_cli_process_exit_code_and_no_traceback(tiny_dir):
    r = subprocess.run(
        [sys.executable, "-m", "dcoco.cli", "generate", "--prompt", "hi", "--method", "nope"],
        capture_output=True,
        text=True,
        timeout=120,
    )
    assert r.returncode == 2 and "Traceback" not in r.stderr and "unknown method" in r.stderr


def test_api_typed_errors(tiny_dir):
    llm = LLM(model=tiny_dir, dtype="float32")
    with pytest.raises(InvalidPromptError):
        llm.generate([[]])
    with pytest.raises(InvalidPromptError):
        llm.generate("needs a tokenizer")
    with pytest.raises(PromptTooLongError):
        llm.generate([list(range(64))])
    with pytest.raises(UnknownMethodError):
        llm.generate([[1, 2, 3]], speculative_config={"method": "medusa"})
    with pytest.raises(ConfigError):
        llm.generate([[1, 2, 3]], speculative_config={"method": "ngram", "bogus": 1})
    with pytest.raises(ModelNotFoundError):
        LLM(model="/nonexistent/dir")
    out = llm.generate([[1, 2, 3]], SamplingParams(max_tokens=5), speculative_config={"method": "ngram"})
    assert len(out[0].token_ids) == 5 and llm.last_stats.verify_passes >= 1


@pytest.mark.parametrize("spec", ["2/2", "x", "1/0", "3"])
def test_regenerate_bad_shard_is_one_line_error(capsys, tmp_path, spec):
    code, out, err = run_cli(
        capsys, "data", "regenerate", "--out", str(tmp_path / "d"), "--num-samples", "1", "--shard", spec
    )
    lines = [l for l in err.strip().splitlines() if l]
    assert code == 2 and len(lines) == 1 and "--shard" in lines[0], err
    assert not (tmp_path / "d").exists()


@pytest.mark.parametrize(
    "args,needle",
    [
        (["/nonexistent/ckpt", "--data", "/nonexistent/data"], "not found"),
        (["src/dcoco/checkpoints/smollm2-135m-instruct/dflash", "--data", "/nonexistent/data"], "manifest"),
        (
            ["src/dcoco/checkpoints/smollm2-135m-instruct/dflash", "--data", "x", "--temperatures", "0,a"],
            "temperatures",
        ),
        (["src/dcoco/checkpoints/smollm2-135m-instruct/dflash", "--data", "x", "--temperatures", "0.5"], "T=0 and T=1"),
        (["src/dcoco/checkpoints/smollm2-135m-instruct/dflash", "--data", "x", "--draft-lengths", "4,x"], "lengths"),
        (["src/dcoco/checkpoints/smollm2-135m-instruct/dflash", "--data", "x", "--draft-lengths", "0"], "lengths"),
    ],
)
def test_eval_bad_input_gives_one_line_error(capsys, args, needle):
    code, out, err = run_cli(capsys, "eval", *args, "--model", "/nonexistent/model")
    assert code == 2 and needle in err and len(err.strip().splitlines()) == 1, err


def test_eval_help_lists_its_options(capsys):
    with pytest.raises(SystemExit) as e:
        main(["eval", "--help"])
    out = capsys.readouterr().out
    assert e.value.code == 0
    for opt in ("--data", "--split", "--eval-permille", "--temperatures", "--num-samples", "--out", "--dtype"):
        assert opt in out


def _bad_inputs(tmp_path, tiny_dir) -> dict[str, tuple[list[str], str]]:
    """Command lines a user gets wrong, each with a word its one-line error must contain."""
    cfg = "configs/dflash_smollm2.yaml"
    binary = tmp_path / "curve.png"
    binary.write_bytes(bytes(range(256)) * 4)
    numbered = tmp_path / "numbered.yaml"
    numbered.write_text("1: x\n")
    shipped = "src/dcoco/checkpoints/smollm2-135m-instruct/dflash"
    torn = tmp_path / "torn-ckpt"
    torn.mkdir()
    (torn / "config.json").write_text(open(f"{shipped}/config.json").read())
    (torn / "model.safetensors").write_bytes(b"\x00" * 64)
    listed = tmp_path / "list-ckpt"
    listed.mkdir()
    (listed / "config.json").write_text("[]")
    (listed / "model.safetensors").write_bytes(b"")
    regenerated = tmp_path / "regenerated"
    regenerated.mkdir()
    (regenerated / "manifest.json").write_text("{}")
    broken = tmp_path / "broken-data"
    broken.mkdir()
    (broken / "manifest.json").write_text("{not json")
    packed = "corpus/smollm2-135m-instruct/sharegpt-all-t1"
    return {
        "override YAML": (["train", "--config", cfg, "data.path=[a"], "invalid YAML value"),
        "binary config": (["train", "--config", str(binary)], "invalid YAML"),
        "numbered sections": (["train", "--config", str(numbered)], "section names"),
        "eval_every 0": (["train", "--config", cfg, "run.eval_every=0"], "run.eval_every"),
        "batch_size 0": (["train", "--config", cfg, "optim.batch_size=0"], "optim.batch_size"),
        "threads -1": (["generate", "--prompt", "hi", "--model", tiny_dir, "--threads", "-1"], "--threads"),
        "unknown device": (["generate", "--prompt", "hi", "--model", tiny_dir, "--device", "nosuch"], "device"),
        "torn weights": (["eval", str(torn), "--data", packed], "safetensors"),
        "config a list": (["eval", str(listed), "--data", packed], "not a model config"),
        "pack into regenerated": (["data", "pack", str(regenerated), "--out", str(regenerated)], "not packed"),
        "prompts from packed": (["data", "prompts", str(tmp_path / "p.jsonl"), "--from", packed], "token ids"),
        "corrupt manifest": (["eval", shipped, "--data", str(broken)], "invalid JSON"),
    }


@pytest.mark.parametrize(
    "case",
    [
        "override YAML",
        "binary config",
        "numbered sections",
        "eval_every 0",
        "batch_size 0",
        "threads -1",
        "unknown device",
        "torn weights",
        "config a list",
        "pack into regenerated",
        "prompts from packed",
        "corrupt manifest",
    ],
)
def test_bad_files_and_values_give_one_line_errors(capsys, tmp_path, tiny_dir, case):
    args, needle = _bad_inputs(tmp_path, tiny_dir)[case]
    code, out, err = run_cli(capsys, *args)
    lines = [l for l in err.strip().splitlines() if l]
    assert code == 2 and len(lines) == 1 and lines[0].startswith("dcoco: error:") and needle in lines[0], err


def test_an_unwritable_output_path_is_a_one_line_error(capsys, tmp_path):
    """A path the user names that cannot be written (its folder is a file) fails in one line."""
    blocker = tmp_path / "file"
    blocker.write_text("")
    code, out, err = run_cli(capsys, "data", "prompts", str(blocker / "p.jsonl"), "--limit", "1")
    lines = [l for l in err.strip().splitlines() if l]
    assert code == 2 and len(lines) == 1 and lines[0].startswith("dcoco: error:"), err


def test_auto_dtype_is_bf16_only_where_bf16_is_fast(monkeypatch, tiny_dir, capsys):
    """`--dtype auto` (the default) is bfloat16 on a GPU, on a CPU with bf16 matrix units and under
    quantization, float32 on other CPUs; commands and bench configs record the dtype they ran."""
    import torch

    import dcoco.target as target_module
    from dcoco.bench.config import make_config

    cases = [(False, "cpu", "none", "float32"), (True, "cpu", "none", "bfloat16")]
    cases += [(False, "cuda", "none", "bfloat16"), (False, "cpu", "int4", "bfloat16")]
    for units, device, quantization, want in cases:
        monkeypatch.setattr(target_module, "cpu_bf16_matrix_units", lambda units=units: units)
        assert target_module.auto_dtype(device, quantization) == want
        assert make_config({"device": device, "quantization": quantization}).dtype == want
        assert make_config({"dtype": "float16", "device": device}).dtype == "float16"  # given: kept
    monkeypatch.setattr(target_module, "cpu_bf16_matrix_units", lambda: False)
    assert Target.from_pretrained(tiny_dir).dtype == torch.float32
    assert LLM(model=tiny_dir).target.dtype == torch.float32
    main(["demo", "--model", tiny_dir, "--max-new-tokens", "2", "--method", "ngram"])  # no tokenizer: stops after
    assert f"target {tiny_dir}, float32, cpu" in capsys.readouterr().err  # saying what it runs
