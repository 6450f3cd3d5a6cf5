"""Typed training configuration: a YAML file plus `section.key=value` overrides. Unknown keys and
wrong types are errors (`ConfigError`), so a typo never silently trains the wrong thing."""

from __future__ import annotations

from pathlib import Path
from typing import Annotated, Literal, Optional, TypeVar, Union

import yaml
from pydantic import AfterValidator, BaseModel, ConfigDict, Field, ValidationError, create_model, model_validator

from ..errors import ConfigError
from ..families import DEFAULT_TRAINED, FAMILIES, trained_families


class _Section(BaseModel):
    model_config = ConfigDict(extra="forbid")


class TargetSection(_Section):
    model: Optional[str] = None  # HF directory; None = embedded SmolLM2-135M-Instruct
    dtype: Literal["bfloat16", "float32"] = "bfloat16"
    device: str = "cpu"  # where the target and the drafter run while training: cpu, cuda, cuda:1, ...


class DataSection(_Section):
    path: Union[str, list[str]] = "data/smollm2-sharegpt"  # one directory, or several read as one set
    max_length: int = 1024  # tokens per sequence (prompt + response), longer ones are cut
    eval_permille: int = 20  # share of regenerated samples held out (by a fixed hash of the sample id)
    eval_samples: int = 48  # at most this many of them are evaluated
    # evaluate the hold-out of these directories instead of data.path's: a stage trained on new
    # answers alone stays measured on the samples its curve was measured on (never trained on either
    # way: a held-out id is held out of every directory)
    eval_path: Union[str, list[str], None] = None
    # train on this many of the training samples, drawn by optim.seed (None: all). A stage on a fresh
    # machine with data.features=cached computes a subset's features once, then re-reads them for
    # its later epochs at about half the cost; the next stage's seed draws another subset
    train_samples: Optional[int] = Field(None, ge=1)
    # (optim.seed, data.train_samples) of the subsets earlier stages drew from the same data.path and
    # data.max_length, in the order they ran (each drew from what the ones before it left): left out
    # before this run draws its own (or, without data.train_samples, trains on all the rest), so a
    # stage trains on answers no stage has seen. A third number, the `drawn_from` of that stage's
    # provenance, names the draw among that many first answers: answers appended since (a directory
    # regenerated further) leave it unchanged
    exclude_subsets: list[tuple[int, int] | tuple[int, int, int]] = []
    # draw (or, without data.train_samples, train on) among the first this many of the answers left
    # (None: all of them): an earlier stage's own draw, its provenance's drawn_from, again after the
    # directory has grown, as a corrector stage on that stage's answers needs
    drawn_from: Optional[int] = Field(None, ge=1)
    # stored: read the target features saved by `data regenerate`; online: recompute them with a
    # target forward per sequence (SpecForge's online mode: token-only data, cheap on a GPU, most of a
    # step on a CPU); cached: online the first time a sequence comes, then read from `feature_cache`
    features: Literal["stored", "online", "cached"] = "stored"
    # data.features=cached: the cache directory (grows by the features of every sequence seen, bf16:
    # about 6.9 KB per token for 5 taps of SmolLM2 and its last layer); reused by later runs and stages on the same data
    feature_cache: str = "feature-cache"


class CommonDrafterSection(_Section):
    """The drafter's shape and start, shared by the families; each family adds its own subsection
    (`drafter.dcoco`, `drafter.dspark`, `drafter.eagle3`: the registry's `Family.settings`)."""

    num_layers: int = 2
    # slots per drafted block, the anchor's included (None: the warm start's, else 16). It shapes no
    # weight, so a warm start may change it: a smaller block spends a step's work on the slots drafted
    block_size: Optional[int] = Field(None, ge=2, le=64)
    num_features: int = 5  # tapped target layers (evenly spaced, published default)
    intermediate_size: Optional[int] = None  # default: the target's
    init_from: Optional[str] = None  # warm start from a drafter checkpoint directory
    init_from_target: bool = True  # else: random layers (see dflash.init_from_target)
    # draft vocabulary: the most frequent response tokens of the training data. EAGLE-3 trains its LM
    # head on them (d2t / t2d); the DFlash family keeps the full head for its loss and scores only
    # these rows at inference (`draft_ids`). >= the vocabulary size: no draft vocabulary
    draft_vocab_size: int = 8192
    # DFlash: train the cross-entropy over the draft vocabulary only (what inference drafts from; a
    # sixth of the LM head's and the loss's work on SmolLM2); the other families score the full one
    draft_vocab_loss: bool = False
    # DFlash: add this weight x the cross-entropy against the target's own T=1 distribution at each
    # drafted slot (from the last layer's features): what T > 0 verification accepts (0: labels only)
    distill_weight: float = Field(0.0, ge=0)
    # default draft tokens per pass stored in the checkpoint (None: EAGLE-3's ttt_steps / block_size - 1)
    num_speculative_tokens: Optional[int] = None


def _drafter_section() -> type[CommonDrafterSection]:

    fields = {n: (f.settings, f.settings()) for n, f in FAMILIES.items() if f.settings is not None}
    return create_model("DrafterSection", __base__=CommonDrafterSection, **fields)


#: the `drafter` section: the common fields plus one subsection per family that has settings
DrafterSection = _drafter_section()


class OptimSection(_Section):
    steps: int = 4000
    # train for about this many seconds instead: after `time_budget_probe` steps, `steps` is set from
    # the measured pace (the schedule then anneals on time); the resulting steps are logged and kept
    time_budget_s: Optional[float] = None
    time_budget_probe: int = 20
    batch_size: int = Field(8, ge=1)  # sequences per step
    anchors_per_seq: int = 16  # blocks sampled per sequence
    lr: float = 6e-4
    min_lr_ratio: float = 0.1
    warmup_steps: int = 100
    # cosine: warm up, then decay over the whole run. wsd (warm-up, stable, decay): hold `lr`, then
    # decay linearly over the last `decay_fraction` of the steps; the drafter as it was before the
    # decay is exported to `run.out/stable`, and the next stage continues from it
    # (`drafter.init_from=.../stable`) at the stable rate instead of climbing back from a decayed one
    schedule: Literal["cosine", "wsd"] = "cosine"
    decay_fraction: float = Field(0.2, gt=0, le=1)
    weight_decay: float = 0.01
    grad_clip: float = 1.0
    loss_decay_gamma: float = 7.0  # w_k = exp(-(k-1)/gamma)
    seed: int = 0
    autocast_bf16: bool = True
    threads: Optional[int] = Field(None, ge=0)  # torch CPU threads (None or 0: torch's choice)


class RunSection(_Section):
    out: str = "runs/dflash-smollm2"
    checkpoint_every: int = Field(100, ge=1)
    eval_every: int = Field(250, ge=1)
    flops_every: int = 10  # count the matmul FLOPs of every N-th step (logs gflop, tflops); 0: never
    # `dcoco train` saves and starts itself again every N steps (0: never): within one process the
    # pace falls 10-20% over a few hundred steps, a fresh one regains it (docs/training.md#memory);
    # a context-parallel job does not restart
    restart_every: int = Field(0, ge=0)


class ParallelSection(_Section):
    # context parallelism of the drafter loss: each step's sequences, packed, are split zigzag over
    # this many processes (started with torch's launcher, gloo); a process holds the target
    # features of its shard and trains the blocks anchored in it, whose queries see the rest of
    # their context through ring branch attention (docs/scale_out.md). Every trained family
    context: int = Field(1, ge=1)
    attention: Literal["ring", "allgather"] = "ring"  # allgather: every rank gathers all the features


def check_context_parallel(parallel: ParallelSection, device: str) -> None:
    """A one-line `ConfigError` where `parallel.context` cannot run (before any process starts)."""
    if parallel.context > 1 and not device.startswith("cpu"):
        raise ConfigError(f"parallel.context runs on CPU processes (gloo) only, not on {device}")


def check_trained_method(v: str) -> str:
    """A trained family's name (the registry's), for `method` fields."""
    if v not in trained_families():
        raise ValueError(f"unknown method {v!r}; choose one of {', '.join(trained_families())}")
    return v


class TrainConfig(_Section):
    method: Annotated[str, AfterValidator(check_trained_method)] = DEFAULT_TRAINED.name
    target: TargetSection = TargetSection()
    data: DataSection = DataSection()
    drafter: DrafterSection = DrafterSection()
    optim: OptimSection = OptimSection()
    run: RunSection = RunSection()
    parallel: ParallelSection = ParallelSection()

    @model_validator(mode="after")
    def _distill(self) -> "TrainConfig":
        readers = [n for n, f in FAMILIES.items() if "distill_weight" in f.loss_options]
        if self.drafter.distill_weight and self.method not in readers:
            raise ValueError(
                f"drafter.distill_weight: method {self.method}'s loss does not read it ({', '.join(readers)}'s does)"
            )
        return self


def _set(tree: dict, dotted: str, value) -> None:
    keys = dotted.split(".")
    node = tree
    for k in keys[:-1]:
        node = node.setdefault(k, {})
        if not isinstance(node, dict):
            raise ConfigError(f"override {dotted}: {k} is not a section")
    node[keys[-1]] = value


C = TypeVar("C", bound=BaseModel)


def load_config(path: Optional[str], overrides: tuple[str, ...] | list[str] = ()) -> TrainConfig:
    return parse_config(TrainConfig, path, overrides)


def parse_config(cls: type[C], path: Optional[str], overrides: tuple[str, ...] | list[str] = ()) -> C:
    """A typed config from an optional YAML file plus `section.key=value` overrides (values are YAML);
    any error (missing file, bad YAML, unknown key, wrong type) is one `ConfigError` line."""
    tree: dict = {}
    if path is not None:
        p = Path(path)
        if not p.is_file():
            raise ConfigError(f"config file not found: {p}")
        try:
            tree = yaml.safe_load(p.read_text()) or {}
        except (yaml.YAMLError, UnicodeDecodeError) as e:
            raise ConfigError(f"{p}: invalid YAML ({str(e).splitlines()[0]})") from None
        if not isinstance(tree, dict) or not all(isinstance(k, str) for k in tree):
            raise ConfigError(f"{p}: the top level must be a mapping of section names")
    for o in overrides:
        if "=" not in o:
            raise ConfigError(f"override {o!r} must look like section.key=value")
        k, v = o.split("=", 1)
        try:
            value = yaml.safe_load(v)
        except yaml.YAMLError as e:
            raise ConfigError(f"override {o!r}: invalid YAML value ({str(e).splitlines()[0]})") from None
        _set(tree, k.strip(), value)
    try:
        return cls(**tree)
    except ValidationError as e:
        err = e.errors()[0]
        loc = ".".join(str(x) for x in err["loc"])
        msg = "unknown key" if err["type"] == "extra_forbidden" else err["msg"].removeprefix("Value error, ")
        raise ConfigError(f"config {loc}: {msg}" if loc else f"config: {msg}") from None
