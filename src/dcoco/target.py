"""The target model: a Hugging Face causal LM behind prefill / verify / rollback, plus feature taps.

Layer index convention (used everywhere in dcoco): a *tap* index `i` names Hugging Face's
`hidden_states[i]` of a forward with `output_hidden_states=True`, i.e. `0` is the embedding output
and `i >= 1` is the output of decoder layer `i - 1` (before the final norm). Drafter checkpoints
that use a published convention convert to this one when they load.
"""

from __future__ import annotations

import os
from contextlib import contextmanager, nullcontext
from dataclasses import dataclass
from typing import Optional, Sequence

import torch
from transformers import AutoModelForCausalLM, AutoTokenizer, PreTrainedModel

from .errors import ConfigError, InvalidPromptError, ModelNotFoundError, PromptTooLongError
from .kv import KVBatch, pad_rows
from .nn.attention import EXACT_NAME as EXACT_GQA
from .nn.attention import NAME as PACKED_GQA
from .nn.attention import register as register_packed_gqa
from .nn.lean import LeanDecoder, lean_supported
from .nn.prepack import prepack_linears
from .nn.quantize import QUANTIZED_CPU_PASS_TOKENS, Int4Linear, Int8Linear, dequantized_products

BOOL_MASK_ATTENTION = ("sdpa", "flash_attention_2", PACKED_GQA, EXACT_GQA)  # read our boolean 4-D masks as they are
CAUSAL_SKIP = ("sdpa", PACKED_GQA, EXACT_GQA)  # without a mask, causal from position 0
DTYPES = {"float32": torch.float32, "bfloat16": torch.bfloat16, "float16": torch.float16}


def cpu_bf16_matrix_units() -> bool:
    """Whether this CPU multiplies bf16 matrices in hardware (AVX-512 BF16 or AMX). Without them bf16
    matmuls are converted on the fly: 0.07 TFLOPS on 2 Ice Lake cores against 0.16-0.30 in float32
    (docs/training.md#cpus-without-bf16-matrix-units)."""
    return torch.cpu._is_avx512_bf16_supported() or torch.cpu._is_amx_tile_supported()


def auto_dtype(device: str = "cpu", quantization: str = "none") -> str:
    """What `dtype="auto"` (the default) stands for: bfloat16 on a GPU, on a CPU with bf16 matrix
    units, or under weight-only quantization (its kernels are bf16's); float32 on other CPUs, where
    bf16 products run 2-7x slower and a verification pass of 5 tokens costs 2 decode steps in bf16
    against 1.2 in float32 (docs/experiments/2026-12-08-float32-prepacked-weights.md)."""
    if not str(device).startswith("cpu") or quantization != "none" or cpu_bf16_matrix_units():
        return "bfloat16"
    return "float32"


def resolve_dtype(dtype: str | torch.dtype) -> torch.dtype:
    if isinstance(dtype, torch.dtype):
        return dtype
    try:
        return DTYPES[dtype]
    except KeyError:
        raise ValueError(f"unknown dtype {dtype!r}; choose one of {', '.join(DTYPES)}") from None


@dataclass
class ForwardOutput:
    logits: torch.Tensor  # (B, q, V) float32
    features: Optional[torch.Tensor]  # (B, q, len(taps) * H) or None when nothing is tapped


class Target:
    """A causal LM that scores token blocks on a per-request KV cache.

    Works with any `AutoModelForCausalLM` whose decoder layers live in `model.model.layers` and that
    accepts a 4-D attention mask and explicit position ids (Llama, Qwen2/3, Mistral, ...). On CPU its
    bf16 and float32 `nn.Linear` modules become `PrepackedLinear` in place (`dcoco.nn.prepack`; same outputs).
    """

    def __init__(self, model: PreTrainedModel, tokenizer=None, exact: bool = False):
        """`exact`: each token's attention over exactly the keys it sees, on its own
        (`dcoco.nn.attention`), and a lone token's pass run as two rows (see `forward`), so that its
        logits do not depend on the tokens sharing its pass: speculative greedy output then equals
        vanilla's in bf16 too."""
        self.model = model.eval()
        self.exact = exact
        self.tokenizer = tokenizer
        cfg = model.config.get_text_config()
        self.config = cfg
        self.vocab_size = int(model.get_output_embeddings().weight.shape[0])
        self.hidden_size = int(cfg.hidden_size)
        self.num_layers = int(cfg.num_hidden_layers)
        self.max_context = int(getattr(cfg, "max_position_embeddings", 4096))
        self.sliding_window = getattr(cfg, "sliding_window", None) if getattr(cfg, "use_sliding_window", True) else None
        self.device = next(model.parameters()).device
        self.dtype = next(model.parameters()).dtype
        quantized = any(isinstance(m, (Int4Linear, Int8Linear)) for m in model.modules())
        self.cheap_pass_tokens: Optional[int] = (
            QUANTIZED_CPU_PASS_TOKENS if quantized and self.device.type == "cpu" else None
        )
        self._taps: tuple[int, ...] = ()
        self._captured: dict[int, torch.Tensor] = {}
        self._hooks: list = []
        self.eos_token_ids = self._eos_ids()
        if self.device.type == "cpu":
            # grouped-query attention as plain SDPA over the K/V heads (`dcoco.nn.attention`): 5x
            # faster per attention call when decoding a batch; same math; DCOCO_PACKED_GQA=0 opts out
            os.environ.setdefault("TRANSFORMERS_SDPA_FORCE_GQA", "1")  # the plain SDPA path: no K/V repeat
            if not exact and os.environ.get("DCOCO_PACKED_GQA", "1") != "0" and cfg._attn_implementation == "sdpa":
                model.set_attn_implementation(register_packed_gqa())
            prepack_linears(model)  # weights packed once for oneDNN; DCOCO_PREPACK=0 opts out
        if exact:
            model.set_attn_implementation(register_packed_gqa(exact=True))
        # Llama-family decoders run as fewer, fused ops (`dcoco.nn.lean`); DCOCO_LEAN=0 opts out
        lean = os.environ.get("DCOCO_LEAN", "1") != "0" and lean_supported(model)
        self._lean = LeanDecoder(model) if lean else None

    # -- loading -----------------------------------------------------------------------------
    @classmethod
    def from_pretrained(
        cls,
        path: Optional[str] = None,
        dtype: str | torch.dtype = "auto",
        device: str = "cpu",
        quantization: str = "none",
        exact: bool = False,
    ) -> "Target":
        """Load a HF model directory (default: the embedded SmolLM2-135M-Instruct) in `dtype` ("auto":
        `auto_dtype`), its linear layers weight-only quantized with `quantization` ("int8", "int4":
        `dcoco.nn.quantize`); `exact`: see `__init__`."""
        from .models import default_model_dir
        from .nn.quantize import quantize_linears

        path = str(path) if path is not None else str(default_model_dir())
        if dtype == "auto":
            dtype = auto_dtype(device, quantization)
        if not os.path.isdir(path) or not os.path.exists(os.path.join(path, "config.json")):
            raise ModelNotFoundError(f"model directory not found or has no config.json: {path}")
        try:
            model = AutoModelForCausalLM.from_pretrained(path, dtype=resolve_dtype(dtype))
        except (OSError, ValueError) as e:
            raise ModelNotFoundError(f"cannot load model from {path}: {str(e).splitlines()[0]}") from None
        try:
            model.to(device)
        except (RuntimeError, AssertionError) as e:  # an unknown device, or CUDA missing from this torch
            raise ConfigError(f"device {device!r} is not available: {str(e).splitlines()[0]}") from None
        quantize_linears(model, quantization)
        tokenizer = AutoTokenizer.from_pretrained(path) if _has_tokenizer(path) else None
        return cls(model, tokenizer, exact=exact)

    def _eos_ids(self) -> set[int]:
        ids: set[int] = set()
        for src in (getattr(self.model, "generation_config", None), self.config):
            e = getattr(src, "eos_token_id", None) if src is not None else None
            if isinstance(e, int):
                ids.add(e)
            elif isinstance(e, (list, tuple)):
                ids.update(int(x) for x in e)
        if self.tokenizer is not None and self.tokenizer.eos_token_id is not None:
            ids.add(int(self.tokenizer.eos_token_id))
        return ids

    # -- text --------------------------------------------------------------------------------
    def encode(self, prompt: str | Sequence[int] | list[dict], chat: bool = True) -> list[int]:
        """Token ids for a prompt: a string (wrapped in the chat template when `chat` and the
        tokenizer has one), a list of chat messages, or token ids as they are."""
        if isinstance(prompt, (list, tuple)) and prompt and all(isinstance(t, int) for t in prompt):
            ids = [int(t) for t in prompt]
            if any(t < 0 or t >= self.vocab_size for t in ids):
                raise InvalidPromptError(f"token ids must be in [0, {self.vocab_size})")
            return ids
        if self.tokenizer is None:
            raise InvalidPromptError("this model has no tokenizer: pass token ids")
        if isinstance(prompt, str):
            if not prompt.strip():
                raise InvalidPromptError("the prompt is empty")
            messages = [{"role": "user", "content": prompt}]
        elif isinstance(prompt, (list, tuple)) and prompt and all(isinstance(m, dict) for m in prompt):
            messages, chat = list(prompt), True
        else:
            raise InvalidPromptError("a prompt must be a non-empty string, chat messages or token ids")
        if chat and self.tokenizer.chat_template:
            text = self.tokenizer.apply_chat_template(messages, tokenize=False, add_generation_prompt=True)
            return list(self.tokenizer(text, add_special_tokens=False)["input_ids"])
        return list(self.tokenizer(messages[-1]["content"])["input_ids"])

    def decode(self, ids: Sequence[int]) -> str:
        if self.tokenizer is None:
            return " ".join(str(i) for i in ids)
        return self.tokenizer.decode(list(ids), skip_special_tokens=True)

    def check_fits(self, prompt_len: int, room: int = 1) -> None:
        if prompt_len + room > self.max_context:
            raise PromptTooLongError(
                f"prompt has {prompt_len} tokens; with {room} more it exceeds the model context of {self.max_context}"
            )

    # -- feature taps -------------------------------------------------------------------------
    def set_taps(self, taps: Sequence[int]) -> None:
        """Capture `hidden_states[i]` for each i in `taps` on every forward (see module docstring)."""
        taps = tuple(int(i) for i in taps)
        if taps == self._taps:
            return
        for h in self._hooks:
            h.remove()
        self._hooks, self._captured = [], {}
        for i in taps:
            if not 0 <= i <= self.num_layers:
                raise ValueError(f"tap index {i} outside [0, {self.num_layers}]")
        layers = self.model.model.layers
        for i in taps:
            module = self.model.model.embed_tokens if i == 0 else layers[i - 1]
            self._hooks.append(module.register_forward_hook(self._make_hook(i)))
        self._taps = taps

    def _make_hook(self, i: int):
        def hook(_module, _inputs, output):
            self._captured[i] = output[0] if isinstance(output, tuple) else output

        return hook

    @property
    def taps(self) -> tuple[int, ...]:
        return self._taps

    @contextmanager
    def tapping(self, taps: Sequence[int]):
        """Tap `taps` for the forwards run inside the block, e.g. a training forward of the model
        itself (RL: the policy's features feed the draft loss), then restore the engine's taps.
        Read the features with `captured`; they are not detached."""
        old = self._taps
        self.set_taps(sorted(set(int(i) for i in taps)))
        try:
            yield self
        finally:
            self.set_taps(old)
            self._captured = {}

    def captured(self, taps: Optional[Sequence[int]] = None) -> torch.Tensor:
        """Features of the last forward at `taps` (default: the current taps), concatenated in that order."""
        return torch.cat([self._captured[int(i)] for i in (self._taps if taps is None else taps)], dim=-1)

    # -- forward -----------------------------------------------------------------------------
    def new_batch(self) -> KVBatch:
        return KVBatch(self.num_layers, self.device)

    @torch.inference_mode()
    def forward(
        self, kv: KVBatch, tokens: torch.Tensor, num_tokens: torch.Tensor, logits_at: Optional[torch.Tensor] = None
    ) -> ForwardOutput:
        """Run `tokens` (B, q) on top of `kv`; row b's first `num_tokens[b]` tokens are real.

        The q new slots are pending until `kv.commit(keep)`. Logits are computed only at the
        positions `logits_at` (1-D shared by all rows, or (B, n) per row; default all): prefill needs
        just the last real token of each row, and the LM head is a large share of a small model's cost.
        """
        tokens = tokens.to(self.device)
        # exact mode: a one-row product can take a matrix-vector kernel (oneDNN's on AVX-512 BF16 CPUs
        # does), which sums in another order than the matrix kernel of every larger pass; a padding
        # slot (dropped at commit) keeps a lone token on the matrix kernel, bitwise as in verification
        lone = self.exact and tokens.numel() == 1
        if lone:
            tokens, logits_at = tokens.expand(1, 2), None
        fresh = kv.num_slots == 0
        position_ids, mask = kv.begin(num_tokens, tokens.shape[1], self.sliding_window)
        if fresh and self.sliding_window is None and self.config._attn_implementation in CAUSAL_SKIP:
            # prefill into an empty cache: rows are right-padded, so plain causal attention is exact
            # for every real token, and SDPA then skips the masked half instead of reading a mask
            mask = None
        if mask is not None and self.config._attn_implementation not in BOOL_MASK_ATTENTION:
            mask = torch.zeros(mask.shape, dtype=self.dtype, device=self.device).masked_fill_(
                ~mask, torch.finfo(self.dtype).min
            )
        self._captured = {}
        keep = logits_at.to(self.device) if logits_at is not None else 0
        # bf16 passes of many rows (prefills, large batches) multiply a quantized target's layers by
        # their dequantized weights (`dequantized_products`); not in exact mode, where a token's
        # logits must not depend on how many rows share its pass
        dequantize = self.dtype == torch.bfloat16 and not self.exact
        with dequantized_products() if dequantize else nullcontext():
            if self._lean is not None:
                logits = self._lean.forward(tokens, position_ids, mask, kv.cache, keep, self._taps, self._captured)
            else:
                logits = self.model(
                    input_ids=tokens,
                    attention_mask=mask,
                    position_ids=position_ids,
                    past_key_values=kv.cache,
                    use_cache=True,
                    logits_to_keep=keep,
                ).logits
        feats = self.captured() if self._taps else None
        if lone:
            logits, feats = logits[:, :1], None if feats is None else feats[:, :1]
        return ForwardOutput(logits=logits.float(), features=feats)

    def prefill(self, prompts: Sequence[Sequence[int]]) -> tuple[KVBatch, ForwardOutput]:
        """A new batch holding `prompts` (right-padded); returns last-token logits (B, V) and the
        features of every prompt token (B, Lmax, F) (rows past their length are padding)."""
        tokens, lens = pad_rows(prompts, max(len(p) for p in prompts), self.device)
        kv = self.new_batch()
        out = self.forward(kv, tokens, lens, logits_at=(lens - 1).unsqueeze(1))
        kv.commit(lens)
        last = out.logits[:, 0]
        return kv, ForwardOutput(logits=last, features=out.features)


def _has_tokenizer(path: str) -> bool:
    names = ("tokenizer.json", "tokenizer_config.json", "tokenizer.model", "vocab.json")
    return any(os.path.exists(os.path.join(path, n)) for n in names)
