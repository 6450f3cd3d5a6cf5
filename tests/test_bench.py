"""`dcoco bench`: row schema, speedup arithmetic, resume, interruption, bad input, and a tiny end-to-end
run on real prompts (MT-Bench, HumanEval, a JSONL file) with a tiny model that has a real tokenizer."""

from __future__ import annotations

import importlib.util
import json
from pathlib import Path

import pytest
import torch
from conftest import tiny_model

from dcoco.bench import KEY_FIELDS, ROW_KEYS, derive
from dcoco.bench import runner as bench_runner
from dcoco.bench.report import PLOTS
from dcoco.bench.runner import Outputs, RowSpec, greedy_match_rate, plan
from dcoco.cli import main
from dcoco.nn.prepack import prepack_enabled

CHATML = (
    "{% for m in messages %}<|im_start|>{{ m['role'] }}\n{{ m['content'] }}<|im_end|>\n{% endfor %}"
    "{% if add_generation_prompt %}<|im_start|>assistant\n{% endif %}"
)


@pytest.fixture(autouse=True, scope="module")
def one_thread():
    """Tiny models gain nothing from intra-op threads, and on a busy machine idle threads spin: one
    thread keeps these tests fast and steady."""
    import torch

    n = torch.get_num_threads()
    torch.set_num_threads(1)
    yield
    torch.set_num_threads(n)


@pytest.fixture(scope="module")
def tiny_chat_dir(tmp_path_factory):
    """A tiny random Llama with a real (small, byte-level BPE) tokenizer and a ChatML chat template,
    saved as an HF directory, so the bench runs the same chat-formatting path as on SmolLM2."""
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers, trainers
    from transformers import PreTrainedTokenizerFast

    tok = Tokenizer(models.BPE())
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tok.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(
        vocab_size=300,
        special_tokens=["<|im_start|>", "<|im_end|>"],
        initial_alphabet=pre_tokenizers.ByteLevel.alphabet(),
        show_progress=False,
    )
    corpus = [
        "def function(numbers: List[float]) -> bool:\n    return True\n",
        "Write a travel blog post about a trip to Hawaii.",
        "Complete the following Python function.",
    ] * 20
    tok.train_from_iterator(corpus, trainer)
    fast = PreTrainedTokenizerFast(tokenizer_object=tok, eos_token="<|im_end|>", pad_token="<|im_end|>")
    fast.chat_template = CHATML
    d = tmp_path_factory.mktemp("tinychat")
    fast.save_pretrained(d)
    eos = fast.convert_tokens_to_ids("<|im_end|>")
    tiny_model("llama", seed=3, vocab_size=len(fast), max_position_embeddings=2048, eos_token_id=eos).save_pretrained(d)
    return str(d)


@pytest.fixture(scope="module")
def user_jsonl(tmp_path_factory):
    f = tmp_path_factory.mktemp("data") / "mine.jsonl"
    f.write_text(
        json.dumps({"prompt": "Write a function that returns True. def function(numbers)"})
        + "\n"
        + json.dumps({"conversations": [{"from": "human", "value": "Hawaii trip, blog post please"}]})
        + "\n"
    )
    return str(f)


def bench_args(model, out, datasets, methods="vanilla,ngram,hf_generate,hf_prompt_lookup,hf_assisted,llamacpp", **over):
    opts = {
        "methods": methods,
        "datasets": datasets,
        "num-prompts": "2",
        "max-new-tokens": "10",
        "temperatures": "0,1",
        "seeds": "7",
        "concurrency": "1,2",
        "dtype": "float32",
        "out": str(out),
    }
    opts.update({k.replace("_", "-"): v for k, v in over.items()})
    args = ["bench", "--model", model, "--no-progress"]
    for k, v in opts.items():
        args += [f"--{k}", str(v)]
    return args


# -- pure parts --------------------------------------------------------------------------------------
def _row(method, tps, dataset="d", t=0.0, seed=None, c=1):
    return {
        "method": method,
        "dataset": dataset,
        "temperature": t,
        "seed": seed,
        "concurrency": c,
        "tokens_per_second": tps,
        "speedup_vs_vanilla": None,
        "greedy_match_rate": None,
    }


def test_speedup_arithmetic():
    rows = [
        _row("vanilla", 40.0),
        _row("ngram", 50.0),
        _row("hf_generate", 30.0),
        _row("vanilla", 100.0, c=4),
        _row("ngram", 150.0, c=4),
        _row("vanilla", 20.0, t=1.0, seed=1),
        _row("ngram", 30.0, t=1.0, seed=1),
        _row("ngram", 35.0, t=1.0, seed=2),
        _row("ngram", 10.0, dataset="other"),
    ]
    derive(rows)
    sp = [r["speedup_vs_vanilla"] for r in rows]
    assert sp[:5] == [1.0, 1.25, 0.75, 1.0, 1.5]
    assert sp[5:7] == [1.0, 1.5]
    assert sp[7] is None and sp[8] is None  # no vanilla for that seed / dataset
    assert rows[0]["greedy_match_rate"] == 1.0 and rows[5]["greedy_match_rate"] is None


def test_greedy_match_rate_and_outputs(tmp_path):
    assert greedy_match_rate([[1, 2], [3], [4]], [[1, 2], [3, 9], [4]]) == pytest.approx(2 / 3, abs=1e-4)
    assert greedy_match_rate([], []) is None
    from dcoco.datasets import Prompt

    out = Outputs(tmp_path)
    ps = [Prompt("a", "d", [{"role": "user", "content": "x"}]), Prompt("b", "d", [{"role": "user", "content": "y"}])]
    out.save(RowSpec("vanilla", "d", 0.0, None, 1), ps, [[1, 2], [3]], ["", ""])
    out.save(RowSpec("ngram", "d", 0.0, None, 1), ps, [[1, 2], [3, 4]], ["", ""])
    rows = derive([_row("vanilla", 10.0), _row("ngram", 20.0)], Outputs(tmp_path))  # fresh cache: read from disk
    assert rows[1]["greedy_match_rate"] == 0.5 and rows[1]["speedup_vs_vanilla"] == 2.0


def test_plan_runs_peers_at_concurrency_one_and_greedy_once():
    from dcoco.bench import make_config

    cfg = make_config(
        {
            "methods": "vanilla,hf_generate",
            "datasets": "humaneval",
            "temperatures": "0,1",
            "seeds": "1,2",
            "concurrency": "4,1",
        }
    )
    keys = [s.key for s in plan(cfg, ["humaneval"])]
    assert ("hf_generate", "humaneval", 0.0, None, 1) in keys
    assert not any(k[0] == "hf_generate" and k[4] != 1 for k in keys)
    assert sum(1 for k in keys if k[2] == 0.0) == 3  # T=0: one seed-less group: vanilla x 2 C + peer
    assert sum(1 for k in keys if k[2] == 1.0) == 6
    assert cfg.concurrency == [1, 4]


@pytest.mark.parametrize(
    "extra,needle",
    [
        (["--methods", "medusa"], "unknown method 'medusa'"),
        (["--methods", "vanilla,,ngram"], "--methods"),
        (["--datasets", "mmlu"], "unknown dataset 'mmlu'"),
        (["--datasets", "/nonexistent/prompts.jsonl"], "not found"),
        (["--temperatures", "0,hot"], "--temperatures"),
        (["--temperatures", "-1"], "--temperatures"),
        (["--seeds", "1.5"], "--seeds"),
        (["--concurrency", "0"], "--concurrency"),
        (["--num-prompts", "0"], "--num-prompts"),
        (["--max-new-tokens", "ten"], "--max-new-tokens"),
        (["--dtype", "int8"], "--dtype"),
        (["--quantization", "int2"], "--quantization: choose one of none, int8, int4"),
        (["--preset", "paper"], "unknown preset"),
        (["--drafters", "dflash"], "METHOD=DIR"),
        (["--drafters", "ngram=/tmp"], "not a trained drafter method"),
        (["--drafters", "dflash=/nonexistent/ckpt"], "no drafter checkpoint"),
    ],
)
def test_bad_input_is_one_line_exit_2(capsys, tmp_path, extra, needle):
    code = main(["bench", "--out", str(tmp_path / "o"), "--no-progress", "--datasets", "humaneval", *extra])
    err = capsys.readouterr().err
    assert code == 2 and needle in err and err.startswith("dcoco: error:") and err.count("\n") == 1, err


def test_empty_and_malformed_jsonl_datasets(capsys, tmp_path):
    f = tmp_path / "p.jsonl"
    f.write_text("\n")
    assert main(["bench", "--datasets", str(f), "--out", str(tmp_path / "o"), "--no-progress"]) == 2
    assert "no prompts" in capsys.readouterr().err
    f.write_text('{"prompt": "fine"}\n{"prompt": \n')
    assert main(["bench", "--datasets", str(f), "--out", str(tmp_path / "o"), "--no-progress"]) == 2
    assert f"{f}:2: malformed JSON" in capsys.readouterr().err


def test_preset_values_and_overrides():
    from dcoco.bench import make_config

    cfg = make_config({"num_prompts": "3"}, preset_name="readme")
    assert cfg.num_prompts == 3 and cfg.seeds == [42] and cfg.concurrency == [1, 4, 16]
    assert cfg.methods[:2] == ["vanilla", "ngram"] and "hf_generate" in cfg.methods
    assert cfg.datasets == ["mtbench", "humaneval", "sharegpt"] and cfg.max_new_tokens == 256


# -- end to end --------------------------------------------------------------------------------------
def test_end_to_end_resume_and_settings_guard(capsys, tmp_path, tiny_chat_dir, user_jsonl, monkeypatch):
    out = tmp_path / "bench"
    args = bench_args(tiny_chat_dir, out, f"mtbench,humaneval,{user_jsonl}")
    assert main(args) == 0, capsys.readouterr().err
    rows = json.loads((out / "results.json").read_text())
    for r in rows:
        assert list(r) == list(ROW_KEYS)
    # 3 datasets x (T=0, T=1 seed 7) x (vanilla, ngram at C=1,2 + hf_generate, hf_prompt_lookup at C=1)
    assert len(rows) == 3 * 2 * 6
    assert {r["method"] for r in rows} == {"vanilla", "ngram", "hf_generate", "hf_prompt_lookup"}
    assert {r["dataset"] for r in rows} == {"mtbench", "humaneval", "mine"}
    mt = [r for r in rows if r["dataset"] == "mtbench"]
    assert all(r["num_prompts"] == 4 for r in mt)  # 2 questions, both turns
    for r in rows:
        assert r["dtype"] == "float32" and r["threads"] >= 1 and r["device"].startswith("cpu")
        assert r["output_tokens"] > 0 and r["wall_s"] > 0 and r["tokens_per_second"] > 0
        assert r["speedup_vs_vanilla"] == pytest.approx(
            r["tokens_per_second"]
            / next(
                v["tokens_per_second"]
                for v in rows
                if v["method"] == "vanilla" and [v[k] for k in KEY_FIELDS[1:]] == [r[k] for k in KEY_FIELDS[1:]]
            ),
            rel=1e-3,
        )
        if r["temperature"] == 0:
            # float32: every method reproduces vanilla greedy decoding token for token
            assert r["greedy_match_rate"] == 1.0, r
            assert r["seed"] is None
        else:
            assert r["greedy_match_rate"] is None and r["seed"] == 7
        if r["method"] == "ngram":
            assert r["acceptance_rate"] is not None and len(r["per_position_acceptance"]) == 5
        if r["method"] == "vanilla":
            assert r["acceptance_length"] == 1.0 and r["acceptance_rate"] is None
    md = (out / "results.md").read_text()
    assert "### T = 0, concurrency 1" in md and "### T = 1, concurrency 2" in md and "(1.00×)" in md
    assert "hf_assisted: skipped" in md and "llamacpp: skipped" in md
    assert "dcoco bench --methods vanilla,ngram" in md and "--model" in md and "Machine:" in md and "float32" in md
    packed = "yes" if prepack_enabled(torch.float32) else "no"
    assert f"weights prepacked for oneDNN: {packed}" in md  # a float32 run
    for p in PLOTS:
        assert (out / p).stat().st_size > 5000
    answers = json.loads((out / "mtbench_turn1_answers.json").read_text())["answers"]
    assert len(answers) == 2
    turn2 = json.loads((out / "outputs" / "vanilla__mtbench__T0__s-__c1.json").read_text())
    assert turn2["prompts"] == ["81/turn1", "82/turn1", "81/turn2", "82/turn2"]

    # resume: nothing is recomputed, the rows stay as they were
    def boom(*a, **k):
        raise AssertionError("a finished row was recomputed")

    monkeypatch.setattr(bench_runner.BenchRunner, "run_row", boom)
    before = (out / "results.json").read_text()
    assert main(args) == 0
    assert (out / "results.json").read_text() == before
    assert "36 of 36 rows already" in capsys.readouterr().err

    # other settings in the same directory are refused
    assert main(bench_args(tiny_chat_dir, out, "humaneval", max_new_tokens="11")) == 2
    assert "other settings" in capsys.readouterr().err


def test_partial_resume_and_interrupt(capsys, tmp_path, tiny_chat_dir, monkeypatch):
    out = tmp_path / "bench"
    base = dict(temperatures="0", concurrency="1")
    real = bench_runner.BenchRunner.run_row
    calls = []

    def interrupt_third(self, spec, *a, **k):
        calls.append(spec.key)
        if len(calls) == 3:
            raise KeyboardInterrupt
        return real(self, spec, *a, **k)

    monkeypatch.setattr(bench_runner.BenchRunner, "run_row", interrupt_third)
    assert main(bench_args(tiny_chat_dir, out, "humaneval", methods="vanilla,ngram,hf_generate", **base)) == 130
    rows = json.loads((out / "results.json").read_text())  # valid partial result
    assert [r["method"] for r in rows] == ["vanilla", "ngram"]
    assert (out / "results.md").exists() and all((out / p).exists() for p in PLOTS)

    calls.clear()
    assert main(bench_args(tiny_chat_dir, out, "humaneval", methods="vanilla,ngram,hf_generate", **base)) == 0
    assert [c[0] for c in calls] == ["hf_generate"]  # only the missing row ran
    rows2 = json.loads((out / "results.json").read_text())
    assert [r["method"] for r in rows2] == ["vanilla", "ngram", "hf_generate"]
    assert rows2[:2] == rows[:2]


def test_token_id_prompts_on_a_model_without_tokenizer(capsys, tmp_path):
    d = tmp_path / "notok"
    tiny_model("llama", seed=1, max_position_embeddings=128).save_pretrained(d)
    f = tmp_path / "ids.jsonl"
    f.write_text("\n".join(json.dumps({"prompt_token_ids": [5, 6, 7, 5, 6, 7, i]}) for i in range(3)) + "\n")
    out = tmp_path / "o"
    args = bench_args(
        str(d), out, str(f), methods="vanilla,ngram,hf_generate", temperatures="0", concurrency="1,3", threads="1"
    )
    assert main(args) == 0, capsys.readouterr().err
    rows = json.loads((out / "results.json").read_text())
    assert len(rows) == 5 and all(r["greedy_match_rate"] == 1.0 for r in rows)
    assert all(r["threads"] == 1 for r in rows)
    # a chat dataset needs a tokenizer: one-line error
    assert (
        main(bench_args(str(d), tmp_path / "o2", "humaneval", methods="vanilla", temperatures="0", concurrency="1"))
        == 2
    )
    assert "no tokenizer" in capsys.readouterr().err


def test_llamacpp_peer_plumbing_with_a_stub_module(monkeypatch, tmp_path):
    """llama-cpp-python is optional (it compiles llama.cpp); check the peer's use of its API on a stub."""
    import sys
    import types

    from conftest import tiny_target

    from dcoco.bench.peers import LlamaCppPeer, unavailable_reason

    seen: dict = {"gen": [], "seeds": []}

    class Llama:
        def __init__(self, model_path, n_ctx, n_threads, n_threads_batch, seed, verbose):
            seen["init"] = (model_path, n_ctx, n_threads, verbose)

        def token_eos(self):
            return 9

        def set_seed(self, seed):
            seen["seeds"].append(seed)

        def generate(self, tokens, **kw):
            seen["gen"].append((list(tokens), kw))
            yield from [20, 21, 22, 23, 9, 30, 31]

    stub = types.ModuleType("llama_cpp")
    stub.Llama = Llama
    monkeypatch.setitem(sys.modules, "llama_cpp", stub)
    assert unavailable_reason("llamacpp", embedded=True) is None
    assert unavailable_reason("llamacpp", embedded=False).startswith("llamacpp: skipped")
    assert unavailable_reason("hf_assisted", embedded=True).startswith("hf_assisted: skipped")

    peer = LlamaCppPeer(tiny_target().eos_token_ids, tmp_path / "m.gguf", n_ctx=64, n_threads=2)
    assert seen["init"] == (str(tmp_path / "m.gguf"), 64, 2, False)
    run = peer.generate([[1, 2, 3], [4]], 0.0, 0, 1.0, [None, 5], max_new_tokens=3)
    assert run.token_ids == [[20, 21, 22], [20, 21, 22]] and run.output_tokens == 6 and run.acceptance_length is None
    assert seen["seeds"] == [0, 5] and seen["gen"][0][0] == [1, 2, 3]
    run = peer.generate([[1]], 1.0, 40, 0.9, [7], max_new_tokens=50)
    assert run.token_ids == [[20, 21, 22, 23, 9]]  # stops at EOS, which it keeps, as the engine does
    kw = seen["gen"][-1][1]
    assert kw["temp"] == 1.0 and kw["top_k"] == 40 and kw["top_p"] == 0.9
    assert kw["min_p"] == 0.0 and kw["typical_p"] == 1.0 and kw["repeat_penalty"] == 1.0


class SegfaultingPeer:
    """A peer whose native code crashes while generating, as llama-cpp-python 0.3.36 did on an AMX CPU."""

    def __init__(self, at_prompt: int):
        self.at_prompt = at_prompt

    def generate(self, prompts, temperature, top_k, top_p, seeds, max_new_tokens):
        from dcoco.bench.peers import PeerRun

        if len(prompts) > self.at_prompt:
            import ctypes

            ctypes.string_at(0)  # a real segmentation fault
        return PeerRun([[7] * max_new_tokens for _ in prompts], 0.01)


def test_a_peer_crash_ends_its_own_process_only():
    from dcoco.bench.peers import IsolatedPeer, LlamaCppPeer, Unavailable

    peer = IsolatedPeer("crashy", SegfaultingPeer, 1)
    seen = []
    assert peer.generate([[1, 2]], 0.0, 0, 1.0, [None], 3, on_prompt=seen.append).token_ids == [[7, 7, 7]]
    assert seen == [3]
    with pytest.raises(Unavailable, match="crashy: skipped - it crashed in its own process \\(signal SIGSEGV\\)"):
        peer.generate([[1], [2]], 0.0, 0, 1.0, [None, None], 3)
    assert not peer.proc.is_alive()
    # a peer that cannot be built here says why, from its own process
    if importlib.util.find_spec("llama_cpp") is None:
        with pytest.raises(Unavailable, match="llama-cpp-python is not importable"):
            IsolatedPeer("llamacpp", LlamaCppPeer, {0}, Path("m.gguf"), 64, 1)


def test_drafter_checkpoints_count_as_available_and_are_fingerprinted(tmp_path, monkeypatch):
    import os

    from dcoco.bench import make_config
    from dcoco.bench.runner import drafter_fingerprint

    ck = tmp_path / "ck"
    ck.mkdir()
    (ck / "config.json").write_text("{}")
    (ck / "model.safetensors").write_bytes(b"0" * 10)
    cfg = make_config({"methods": "vanilla,dflash", "drafters": f"dflash={ck}"})
    assert cfg.methods == ["vanilla", "dflash"] and cfg.drafters == {"dflash": str(ck.resolve())}
    assert "dflash" in make_config({"methods": "@engine", "drafters": f"dflash={ck}"}).methods
    a = drafter_fingerprint("dflash", str(ck))
    assert a.startswith(str(ck)) and drafter_fingerprint("dflash", str(ck)) == a
    (ck / "model.safetensors").write_bytes(b"1" * 11)
    os.utime(ck / "model.safetensors", ns=(1, 1))
    assert drafter_fingerprint("dflash", str(ck)) != a
    assert drafter_fingerprint("ngram", None) is None and drafter_fingerprint("hf_generate", None) is None
    monkeypatch.chdir(tmp_path)  # inside the working directory: run.json and the reports name it relatively
    cfg = make_config({"methods": "dflash", "drafters": f"dflash={ck}", "model": str(ck)})
    assert (
        cfg.drafters == {"dflash": "ck"} and cfg.model == "ck" and drafter_fingerprint("dflash", "ck").startswith("ck@")
    )


def test_dcoco_variants_run_side_by_side(capsys, tmp_path, tiny_chat_dir):
    """Ablation rows: DCOCO, its backbone alone and another shortlist size, all lossless (float32),
    with the corrector's share of the wall time reported for the corrected rows."""
    from dcoco.drafters.dcoco import DCOCOConfig, DCOCOModel
    from dcoco.drafters.dflash import DFlashConfig
    from dcoco.families import get_family
    from dcoco.target import Target

    target = Target.from_pretrained(tiny_chat_dir, dtype="float32")
    torch.manual_seed(0)
    model = DCOCOModel(
        DFlashConfig.for_target(target, num_layers=1, block_size=4, num_features=2),
        DCOCOConfig(top_k=3, proj_dim=8, hidden=16),
    )
    torch.nn.init.normal_(model.corrector.out.weight, std=5.0)
    ck = tmp_path / "ck"
    get_family("dcoco").save(ck, model, dtype=torch.float32)
    out = tmp_path / "bench"
    args = bench_args(
        tiny_chat_dir,
        out,
        "humaneval",
        methods="vanilla,dflash,dcoco,dcoco/nocorrect,dcoco/k2,dcoco/lookup1,dflash/lookup1,dflash/draft2",
        drafters=f"dcoco={ck},dflash={ck},dflash/lookup1={ck},dflash/draft2={ck}",
        concurrency="1",
    )
    assert main(args) == 0, capsys.readouterr().err
    rows = json.loads((out / "results.json").read_text())
    assert {r["method"] for r in rows} == {
        "vanilla",
        "dflash",
        "dcoco",
        "dcoco/nocorrect",
        "dcoco/k2",
        "dcoco/lookup1",
        "dflash/lookup1",
        "dflash/draft2",
    }
    # a draft length beside the default one (the block of 4 drafts 3)
    slots = {r["method"]: len(r["per_position_acceptance"] or []) for r in rows if r["temperature"] == 0}
    assert slots["dflash"] == 3 and slots["dflash/draft2"] == 2
    # prompt lookup first: its share of the drafting steps, on its rows only
    assert all(("lookup_share" in r) == r["method"].endswith("/lookup1") for r in rows)
    assert all(0 <= r["lookup_share"] <= 1 for r in rows if "lookup_share" in r)
    assert "## Prompt lookup first: the drafting steps it drafted" in (out / "results.md").read_text()
    for r in rows:
        if r["temperature"] == 0:
            assert r["greedy_match_rate"] == 1.0, r
        if r["method"] == "vanilla":
            assert "select_share" not in r
        else:
            assert 0 < r["select_share"] < 1
    report = (out / "results.md").read_text()
    assert "## Token selection time (DCOCO's corrector overhead)" in report
    share = {r["method"]: r.get("select_share") for r in rows if r["temperature"] == 0}
    line = next(x for x in report.splitlines() if x.startswith("| dcoco | 0 | 1 |"))
    assert line.endswith(f"| {100 * (share['dcoco'] - share['dflash']):+.2f}% |")  # the corrector's own cost
    # a labelled variant against the same variant of DFlash where the run has it, else plain DFlash
    line = next(x for x in report.splitlines() if x.startswith("| dcoco/lookup1 | 0 | 1 |"))
    assert line.endswith(f"| {100 * (share['dcoco/lookup1'] - share['dflash/lookup1']):+.2f}% |")
    line = next(x for x in report.splitlines() if x.startswith("| dcoco/k2 | 0 | 1 |"))
    assert line.endswith(f"| {100 * (share['dcoco/k2'] - share['dflash']):+.2f}% |")


def test_quantized_bench_caps_draft_tokens_and_says_so(capsys, tmp_path, tiny_chat_dir):
    """On a quantized CPU target the drafters' default block is capped (torch's int kernels take rows
    in blocks of 4); the report states the cap the engine used, and greedy output stays the quantized
    target's own."""
    from dcoco.nn.quantize import QUANTIZED_CPU_PASS_TOKENS

    out = tmp_path / "bench"
    args = bench_args(
        tiny_chat_dir, out, "humaneval", methods="vanilla,ngram", temperatures="0", concurrency="1", quantization="int8"
    )
    assert main(args) == 0, capsys.readouterr().err
    rows = json.loads((out / "results.json").read_text())
    ngram = next(r for r in rows if r["method"] == "ngram")
    assert len(ngram["per_position_acceptance"]) == QUANTIZED_CPU_PASS_TOKENS - 1
    assert all(r["greedy_match_rate"] == 1.0 for r in rows)
    md = (out / "results.md").read_text()
    assert f"draft tokens per pass each drafter default, at most {QUANTIZED_CPU_PASS_TOKENS - 1};" in md
