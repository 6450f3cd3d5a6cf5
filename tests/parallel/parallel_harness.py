"""Helpers shared by the multi-process tests of :mod:`dcoco.parallel`.

Workers are real gloo processes on loopback.  Spawning is the slow part, so
each test module starts one job whose worker runs many checks and returns a
dict of measured errors; the tests then assert on that dict.

Workers stay light because ``dcoco/__init__.py`` imports lazily: only the
``dcoco.parallel`` submodules a worker uses are loaded.
"""

from __future__ import annotations

import traceback


def run_job(fn, world_size: int, *args, timeout_s: float = 150.0):
    """Spawn ``world_size`` gloo workers running ``fn(rank, world_size, *args)``; return their results."""
    from dcoco.parallel.launch import spawn_local  # the test process imports dcoco normally

    return spawn_local(fn, world_size, *args, timeout_s=timeout_s)


def guarded(results: dict, name: str, fn, *args, **kwargs) -> None:
    """Run one check; store its metrics dict, or its traceback so the others still run."""
    try:
        results[name] = fn(*args, **kwargs)
    except Exception:  # noqa: BLE001 - reported to the test process verbatim
        results[name] = {"error": traceback.format_exc()}


def merge_ranks(per_rank: list[dict]) -> dict:
    """Combine the per-rank metric dicts: max of numbers, AND of booleans, first error wins."""
    merged: dict = {}
    for res in per_rank:
        for name, metrics in res.items():
            dst = merged.setdefault(name, {})
            for key, val in metrics.items():
                if key == "error":
                    dst.setdefault("error", val)
                elif isinstance(val, bool):
                    dst[key] = dst.get(key, True) and val
                elif isinstance(val, (int, float)):
                    dst[key] = max(dst.get(key, val), val)
                else:
                    dst.setdefault(key, val)
    return merged


def metrics_of(merged: dict, name: str) -> dict:
    m = merged.get(name)
    assert m is not None, f"check {name!r} did not run; ran: {sorted(merged)}"
    assert "error" not in m, f"check {name!r} failed in a worker:\n{m['error']}"
    return m
