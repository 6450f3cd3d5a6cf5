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
