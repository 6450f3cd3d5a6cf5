"""TapChannel with real gloo processes: 2 producers -> 1 consumer, for p2p and shared memory."""

from __future__ import annotations

import time

import pytest
import torch
import torch.distributed as dist
from parallel_harness import guarded, merge_ranks, metrics_of, run_job

CONSUMER = 2
TRANSPORTS = ["p2p", "shm"]


def payload(src, stamp, rows, cols=3):
    return torch.full((rows, cols), 1000.0 * src + stamp, dtype=torch.float64)


def check_interleaved(rank, transport):
    """Two taps + the schedule's own traffic on the world group, consumed out of order."""
    from dcoco.parallel import TapChannel

    chans = [
        TapChannel(src, CONSUMER, (4, 3), torch.float64, num_slots=2, transport=transport, timeout=30) for src in (0, 1)
    ]
    n = 6
    ok = True
    if rank in (0, 1):
        ch = chans[rank]
        for m in range(n):
            ch.send(payload(rank, m, 1 + m % 4), stamp=m)
            if rank == 0:  # the pipeline schedule's own send to the same peer, default group, tag 0
                dist.send(torch.tensor([m], dtype=torch.long), CONSUMER)
        ch.flush()
    elif rank == CONSUMER:
        order = [1, 0, 3, 2, 5, 4]
        for i in range(0, n, 2):
            for m in (i, i + 1):
                sched = torch.zeros(1, dtype=torch.long)
                dist.recv(sched, 0)
                ok &= int(sched) == m
            for m in order[i : i + 2]:
                for src in (1, 0):
                    got = chans[src].recv(m)
                    ok &= torch.equal(got, payload(src, m, 1 + m % 4))
        ok &= max(chans[0].stats["slot_uses"]) <= n and sum(chans[0].stats["slot_uses"]) == n
    for c in chans:
        c.close()
    return {"ok": bool(ok)}


def check_backpressure_and_slots(rank, transport):
    from dcoco.parallel import (
        TapChannel,
        TapChannelError,
        TapClosedError,
        TapShapeError,
        TapSlotsExhaustedError,
        TapTimeoutError,
    )

    ch = TapChannel(0, CONSUMER, (2, 2), torch.float64, num_slots=2, transport=transport, timeout=30)
    res = {}
    if rank == 0:
        ch.send(payload(0, 0, 2, 2), 0)
        ch.send(payload(0, 1, 2, 2), 1)
        t0 = time.monotonic()
        try:
            ch.send(payload(0, 2, 2, 2), 2, timeout=0.3)
            res["backpressure_timeout"] = False
        except TapTimeoutError:
            res["backpressure_timeout"] = True
        res["backpressure_elapsed"] = time.monotonic() - t0
        for bad in (torch.zeros(3, 2, dtype=torch.float64), torch.zeros(2, 2, dtype=torch.float32)):
            try:
                ch.send(bad, 99)
                res["shape_error"] = False
            except TapShapeError:
                res.setdefault("shape_error", True)
        dist.barrier()
        for m in (2, 3, 4, 5):  # each waits for a slot the consumer frees
            ch.send(payload(0, m, 2, 2), m)
        dist.barrier()
        ch.close()
        try:
            ch.send(payload(0, 6, 2, 2), 6)
            res["closed_error"] = False
        except TapClosedError:
            res["closed_error"] = True
    elif rank == CONSUMER:
        dist.barrier()
        res["stamp0"] = torch.equal(ch.recv(0), payload(0, 0, 2, 2))
        held = ch.recv(1, copy=False)  # keeps its slot
        res["stamp2"] = torch.equal(ch.recv(2), payload(0, 2, 2, 2))
        res["stamp3"] = torch.equal(ch.recv(3), payload(0, 3, 2, 2))
        # slot of stamp 1 is held, the other one fills with stamp 4: nothing else can arrive
        t0 = time.monotonic()
        while 4 not in ch.stamps_ready() and time.monotonic() - t0 < 20:
            time.sleep(0.01)
        try:
            ch.recv(5, timeout=10)
            res["exhausted"] = False
        except TapSlotsExhaustedError:
            res["exhausted"] = time.monotonic() - t0 < 9
        res["held_intact"] = torch.equal(held, payload(0, 1, 2, 2))
        ch.release(1)
        res["stamp4"] = torch.equal(ch.recv(4), payload(0, 4, 2, 2))
        res["stamp5"] = torch.equal(ch.recv(5), payload(0, 5, 2, 2))
        uses = ch.stats["slot_uses"]  # 6 messages through 2 slots: every slot reused
        res["slot_reuse"] = len(uses) == 2 and sum(uses) == 6 and min(uses) >= 2
        res["received"] = ch.stats["received"] == 6
        t0 = time.monotonic()
        try:
            ch.recv(777, timeout=0.4)
            res["timeout"] = False
        except TapTimeoutError as e:
            res["timeout"] = "777" in str(e) and isinstance(e, TimeoutError)
        res["timeout_elapsed"] = time.monotonic() - t0
        try:
            ch.release(1)
            res["release_error"] = False
        except TapChannelError:
            res["release_error"] = True
        dist.barrier()
        ch.close()
    else:
        dist.barrier()
        try:
            ch.send(payload(1, 0, 2, 2), 0)
            res["inert_error"] = False
        except TapChannelError:
            res["inert_error"] = True
        dist.barrier()
        ch.close()
    return res


def worker(rank, world_size):
    results: dict = {}
    for t in TRANSPORTS:
        guarded(results, f"interleaved/{t}", check_interleaved, rank, t)
        guarded(results, f"slots/{t}", check_backpressure_and_slots, rank, t)
    dist.barrier()
    return results


@pytest.fixture(scope="module")
def results():
    return merge_ranks(run_job(worker, 3))


@pytest.mark.parametrize("transport", TRANSPORTS)
def test_ordering_under_interleaved_microbatches(results, transport):
    assert metrics_of(results, f"interleaved/{transport}")["ok"]


@pytest.mark.parametrize("transport", TRANSPORTS)
def test_backpressure_blocks_then_times_out(results, transport):
    m = metrics_of(results, f"slots/{transport}")
    assert m["backpressure_timeout"]
    assert 0.25 <= m["backpressure_elapsed"] < 5


@pytest.mark.parametrize("transport", TRANSPORTS)
def test_slot_reuse_and_held_slots(results, transport):
    m = metrics_of(results, f"slots/{transport}")
    assert all(m[f"stamp{i}"] for i in (0, 2, 3, 4, 5))
    assert m["held_intact"] and m["slot_reuse"] and m["received"]
    assert m["exhausted"]
    assert m["release_error"]


@pytest.mark.parametrize("transport", TRANSPORTS)
def test_missing_stamp_times_out(results, transport):
    m = metrics_of(results, f"slots/{transport}")
    assert m["timeout"]
    assert 0.35 <= m["timeout_elapsed"] < 5


@pytest.mark.parametrize("transport", TRANSPORTS)
def test_typed_errors(results, transport):
    m = metrics_of(results, f"slots/{transport}")
    assert m["shape_error"] and m["closed_error"] and m["inert_error"]
