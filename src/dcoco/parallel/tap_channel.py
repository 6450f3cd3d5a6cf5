"""TapChannel: deliver tapped target features between pipeline stages outside the schedule.

Why: a drafter (EAGLE-3 style) reads hidden states of several target layers,
which under pipeline parallelism live on different, often non-adjacent,
stages.  Threading them through the schedule's stage-to-stage sends would
change every stage's payload; instead each tap gets its own one-directional
channel that the schedule never sees.

Protocol (one producer rank ``src`` -> one consumer rank ``dst``):

* **Mailbox.**  The consumer preallocates ``num_slots`` buffers of
  ``slot_shape``.  A slot is *granted* (producer may write it), *full* (holds an
  unconsumed message), or *held* (handed out without a copy, awaiting
  :meth:`release`).
* **Credits / back-pressure.**  The consumer grants a slot by sending a credit
  ``[GRANT, slot]``; the producer may only send with a credit in hand, so a
  full mailbox blocks :meth:`send` (and ends in :class:`TapTimeoutError`, never
  in an overwrite).  Consuming a slot grants it again.
* **Stamps.**  Every message carries a header ``[DATA, stamp, slot, rows]``.
  :meth:`recv` returns the message with the requested stamp, whatever the
  arrival order, so microbatches of different taps may interleave freely.
  Asking for a stamp while every slot holds other stamps raises
  :class:`TapSlotsExhaustedError` at once (it could never arrive).
* **Dedicated groups.**  Credits and headers travel on a gloo group of the two
  ranks, p2p payloads on another group of the same two ranks (the default
  backend: NCCL on GPUs); both are created with ``dist.new_group``, so their
  messages can never be matched by the schedule's own sends/receives.  Having
  separate groups also keeps NCCL from serialising a credit behind a payload
  on one stream.
* **Transports.**  ``"p2p"``: payloads via ``isend``/``irecv`` into the slot;
  ``"shm"`` (same host, CPU): the slots are a ``multiprocessing.shared_memory``
  segment mapped as a torch tensor in both processes, the producer copies into
  it and the header (sent after the copy) publishes it; ``"cuda_ipc"`` (same
  host, CUDA): the slots are a CUDA tensor shared through its IPC handle.
* **Close.**  Both ends call :meth:`close`.  The consumer sends ``[FIN]``; the
  producer answers every still-granted credit with a ``CLOSE`` header (and a
  dummy payload for p2p), so no receive is left posted.

Every wait polls with a deadline and raises :class:`TapTimeoutError` naming
the channel and the stamp.  A timeout leaves the channel usable (no message is
lost; the posted receive stays posted).

Construction is collective over the default group: every rank must create
every channel, in the same order (``dist.new_group`` requires it); ranks other
than ``src``/``dst`` get an inert endpoint.
"""

from __future__ import annotations

import collections
import math
import pickle
import queue
import socket
import threading
import time
import uuid
from typing import Sequence

import torch
import torch.distributed as dist

from .errors import (
    TapChannelError,
    TapClosedError,
    TapShapeError,
    TapSlotsExhaustedError,
    TapTimeoutError,
)

__all__ = ["TapChannel"]

_GRANT, _FIN = 0, 1
_DATA, _CLOSE = 0, 1
_TAG_CREDIT, _TAG_HEADER, _TAG_DATA, _TAG_SETUP = 21, 22, 23, 24
_TRANSPORTS = ("p2p", "shm", "cuda_ipc", "auto")


class _Done:
    """Completion flag of one ``Work``, set by a :class:`_FifoWaiter` thread."""

    __slots__ = ("work", "event", "error", "keep")

    def __init__(self, work, keep):
        self.work, self.keep, self.error = work, keep, None
        self.event = threading.Event()

    def done(self) -> bool:
        if not self.event.is_set():
            return False
        if self.error is not None:
            raise TapChannelError(f"point-to-point operation failed: {self.error}") from self.error
        return True


class _FifoWaiter:
    """Background thread that waits on ``Work`` objects in posting order.

    Why: gloo's point-to-point ``Work.is_completed()`` only turns true inside
    ``wait()``, and ``wait(timeout)`` closes the connection when it expires, so
    non-blocking progress needs a thread that blocks in ``wait()``.  Messages of
    one tag between two ranks complete in order, so one thread per stream of
    messages suffices.  ``keep`` holds tensors alive until their op finished.
    """

    def __init__(self, name: str):
        self._q: queue.Queue = queue.Queue()
        self._thread = threading.Thread(target=self._run, name=name, daemon=True)
        self._thread.start()

    def add(self, work, keep=None) -> _Done:
        d = _Done(work, keep)
        self._q.put(d)
        return d

    def _run(self) -> None:
        while True:
            d = self._q.get()
            if d is None:
                return
            try:
                d.work.wait()
            except Exception as exc:  # noqa: BLE001 - surfaced to the caller by _Done.done()
                d.error = exc
            d.keep = None
            d.event.set()

    def stop(self, timeout: float = 1.0) -> None:
        self._q.put(None)
        self._thread.join(timeout)


def _wait(pred, deadline: float, on_timeout):
    """Poll ``pred`` with exponential back-off until it is true or ``deadline`` passes."""
    delay = 5e-5
    while True:
        if pred():
            return
        if time.monotonic() >= deadline:
            on_timeout()
            return
        time.sleep(delay)
        delay = min(delay * 2, 2e-3)


class TapChannel:
    """One-directional, stamped, back-pressured mailbox from rank ``src`` to rank ``dst``.

    Args:
        src, dst: global ranks of the producer and the consumer.
        slot_shape: shape of one slot; a message may have fewer rows (dim 0).
        dtype: payload dtype.
        num_slots: mailbox size on the consumer.
        transport: ``"p2p"``, ``"shm"``, ``"cuda_ipc"`` or ``"auto"`` (shm on CPU
            when both ranks share a host, p2p otherwise).
        device: device of the slots (and of the tensors passed to :meth:`send`).
        timeout: default timeout in seconds of every blocking call.
        name: label used in error messages.
    """

    def __init__(
        self,
        src: int,
        dst: int,
        slot_shape: Sequence[int],
        dtype: torch.dtype = torch.float32,
        *,
        num_slots: int = 2,
        transport: str = "p2p",
        device: torch.device | str = "cpu",
        timeout: float = 120.0,
        name: str | None = None,
    ):
        if not dist.is_initialized():
            raise TapChannelError("TapChannel needs an initialised torch.distributed default group")
        world = dist.get_world_size()
        if src == dst or not (0 <= src < world and 0 <= dst < world):
            raise TapChannelError(f"invalid endpoints src={src}, dst={dst} for world size {world}")
        if num_slots < 1:
            raise TapChannelError(f"num_slots must be >= 1, got {num_slots}")
        if transport not in _TRANSPORTS:
            raise TapChannelError(f"unknown transport {transport!r}; choose one of {_TRANSPORTS}")
        self.src, self.dst = int(src), int(dst)
        self.slot_shape = tuple(int(s) for s in slot_shape)
        if not self.slot_shape or any(s <= 0 for s in self.slot_shape):
            raise TapShapeError(f"slot_shape must be non-empty and positive, got {self.slot_shape}")
        self.dtype = dtype
        self.num_slots = int(num_slots)
        self.device = torch.device(device)
        self.timeout = float(timeout)
        self.name = name or f"tap[{src}->{dst}]"
        # collective: every rank creates both groups, in the same order
        self._ctrl = dist.new_group([self.src, self.dst], backend="gloo")
        self._data = dist.new_group([self.src, self.dst])
        rank = dist.get_rank()
        self.role = "producer" if rank == self.src else "consumer" if rank == self.dst else None
        self.closed = self.role is None
        self.stats = {"sent": 0, "received": 0, "slot_uses": [0] * self.num_slots, "backpressure_waits": 0}
        if self.role is None:
            return
        self.peer = self.dst if self.role == "producer" else self.src
        self.transport = self._resolve_transport(transport)
        self._slot_bytes = math.prod(self.slot_shape) * torch.empty((), dtype=dtype).element_size()
        self._shm = None
        if self.transport == "p2p":
            self._connect_data_group()
        if self.role == "consumer":
            self._init_consumer()
        else:
            self._init_producer()

    # ------------------------------------------------------------- helpers
    def __repr__(self) -> str:
        return f"TapChannel({self.name}, role={self.role}, slots={self.num_slots}, shape={self.slot_shape})"

    def _secs(self, timeout: float | None) -> float:
        return self.timeout if timeout is None else float(timeout)

    def _deadline(self, timeout: float | None) -> float:
        return time.monotonic() + self._secs(timeout)

    def _require(self, role: str) -> None:
        if self.role != role:
            raise TapChannelError(f"{self.name}: this rank is the {self.role or 'no'} endpoint, not the {role}")
        if self.closed:
            raise TapClosedError(f"{self.name} is closed")

    def _exchange_bytes(self, payload: bytes | None) -> bytes:
        """Consumer sends ``payload`` to the producer (length-prefixed); producer returns it."""
        if self.role == "consumer":
            data = torch.frombuffer(bytearray(payload), dtype=torch.uint8)
            dist.send(torch.tensor([data.numel()]), self.peer, group=self._ctrl, tag=_TAG_SETUP)
            dist.send(data, self.peer, group=self._ctrl, tag=_TAG_SETUP)
            return payload
        n = torch.zeros(1, dtype=torch.long)
        dist.recv(n, self.peer, group=self._ctrl, tag=_TAG_SETUP)
        data = torch.empty(int(n), dtype=torch.uint8)
        dist.recv(data, self.peer, group=self._ctrl, tag=_TAG_SETUP)
        return bytes(data.tolist())

    def _resolve_transport(self, transport: str) -> str:
        if transport != "auto":
            return transport
        # both endpoints decide from the same exchanged facts
        mine = torch.frombuffer(bytearray(socket.gethostname().encode()[:64].ljust(64)), dtype=torch.uint8)
        theirs = torch.empty(64, dtype=torch.uint8)
        ops = [
            dist.P2POp(dist.isend, mine, self.peer, self._ctrl, _TAG_SETUP),
            dist.P2POp(dist.irecv, theirs, self.peer, self._ctrl, _TAG_SETUP),
        ]
        for w in dist.batch_isend_irecv(ops):
            w.wait()
        same_host = bool(torch.equal(mine, theirs))
        return "shm" if same_host and self.device.type == "cpu" else "p2p"

    def _connect_data_group(self) -> None:
        """One symmetric exchange on the payload group.

        NCCL creates a pair's communicator at its first point-to-point call and
        blocks until both ranks make one; without this, the consumer's first
        pre-posted payload receive would wait for a producer that is itself
        waiting for the credit sent after that receive.
        """
        mine = torch.ones(1, device=self.device)
        theirs = torch.zeros(1, device=self.device)
        ops = [
            dist.P2POp(dist.isend, mine, self.peer, self._data, _TAG_SETUP),
            dist.P2POp(dist.irecv, theirs, self.peer, self._data, _TAG_SETUP),
        ]
        for w in dist.batch_isend_irecv(ops):
            w.wait()

    # ------------------------------------------------------------ consumer
    def _init_consumer(self) -> None:
        n = self.num_slots
        if self.transport == "shm":
            if self.device.type != "cpu":
                raise TapChannelError("the shm transport needs device='cpu'; use cuda_ipc or p2p on GPUs")
            from multiprocessing import shared_memory

            self._shm = shared_memory.SharedMemory(
                create=True, size=n * self._slot_bytes, name=f"dcoco_tap_{uuid.uuid4().hex[:16]}"
            )
            self._slots = _shm_tensor(self._shm, n, self.slot_shape, self.dtype)
            self._exchange_bytes(self._shm.name.encode())
        else:
            self._slots = torch.zeros((n,) + self.slot_shape, dtype=self.dtype, device=self.device)
            if self.transport == "cuda_ipc":
                if self.device.type != "cuda":
                    raise TapChannelError("the cuda_ipc transport needs a CUDA device")
                from torch.multiprocessing.reductions import reduce_tensor

                self._exchange_bytes(pickle.dumps(reduce_tensor(self._slots)))
        self._pending = collections.deque()  # (slot, header_buf, header_done, data_work) in grant order
        self._full: dict[int, tuple[int, int]] = {}  # stamp -> (slot, rows)
        self._held: dict[int, int] = {}  # stamp -> slot handed out without copy
        self._hdr_waiter = _FifoWaiter(f"{self.name}-headers")
        self._send_waiter = _FifoWaiter(f"{self.name}-credits")
        self._credit_sends: list[_Done] = []
        self._fin_sent = False
        for s in range(n):
            self._grant(s)

    def _grant(self, slot: int) -> None:
        data_work = None
        if self.transport == "p2p":
            data_work = dist.irecv(self._slots[slot], self.peer, group=self._data, tag=_TAG_DATA)
        hdr = torch.zeros(4, dtype=torch.long)
        hdr_done = self._hdr_waiter.add(dist.irecv(hdr, self.peer, group=self._ctrl, tag=_TAG_HEADER))
        self._pending.append((slot, hdr, hdr_done, data_work))
        self._send_credit(_GRANT, slot)

    def _send_credit(self, kind: int, slot: int) -> None:
        buf = torch.tensor([kind, slot], dtype=torch.long)
        self._credit_sends = [d for d in self._credit_sends if not d.done()]
        work = dist.isend(buf, self.peer, group=self._ctrl, tag=_TAG_CREDIT)
        self._credit_sends.append(self._send_waiter.add(work, buf))

    def _poll_headers(self) -> bool:
        """Move arrived messages from granted to full; True if anything arrived."""
        progressed = False
        while self._pending and self._pending[0][2].done():
            slot, hdr, _, data_work = self._pending.popleft()
            kind, stamp, hslot, rows = (int(x) for x in hdr)
            if hslot != slot:
                raise TapChannelError(f"{self.name}: protocol error, header for slot {hslot} but slot {slot} was next")
            if data_work is not None:
                data_work.wait()
            progressed = True
            if kind == _CLOSE:
                continue
            if stamp in self._full or stamp in self._held:
                raise TapChannelError(f"{self.name}: stamp {stamp} received twice")
            self._full[stamp] = (slot, rows)
            self.stats["received"] += 1
            self.stats["slot_uses"][slot] += 1
        return progressed

    def recv(self, stamp: int, *, timeout: float | None = None, copy: bool = True) -> torch.Tensor:
        """The payload sent with ``stamp`` (``[rows, *slot_shape[1:]]``).

        With ``copy=False`` the returned tensor is a view of the slot, which
        stays reserved until :meth:`release` is called with the same stamp.
        """
        self._require("consumer")
        stamp = int(stamp)
        deadline = self._deadline(timeout)

        def arrived():
            self._poll_headers()
            if stamp in self._full:
                return True
            if not self._pending:
                raise TapSlotsExhaustedError(
                    f"{self.name}: waiting for stamp {stamp} but all {self.num_slots} slots hold other stamps "
                    f"{sorted(self._full) + sorted(self._held)}; consume them or raise num_slots"
                )
            return False

        def expire():
            raise TapTimeoutError(
                f"{self.name}: stamp {stamp} did not arrive within "
                f"{self._secs(timeout):.3g}s (stamps waiting: {sorted(self._full)})"
            )

        _wait(arrived, deadline, expire)
        slot, rows = self._full.pop(stamp)
        view = self._slots[slot, :rows]
        if not copy:
            self._held[stamp] = slot
            return view
        out = view.clone()
        self._regrant(slot)
        return out

    def release(self, stamp: int) -> None:
        """Give back the slot of a payload received with ``copy=False``."""
        self._require("consumer")
        slot = self._held.pop(int(stamp), None)
        if slot is None:
            raise TapChannelError(f"{self.name}: stamp {stamp} is not held")
        self._regrant(slot)

    def _regrant(self, slot: int) -> None:
        if not self._fin_sent:
            self._grant(slot)

    def stamps_ready(self) -> list[int]:
        """Stamps that arrived and were not consumed yet."""
        self._require("consumer")
        self._poll_headers()
        return sorted(self._full)

    # ------------------------------------------------------------ producer
    def _init_producer(self) -> None:
        self._remote = None
        if self.transport == "shm":
            from multiprocessing import shared_memory

            name = self._exchange_bytes(None).decode()
            self._shm = shared_memory.SharedMemory(name=name)
            _untrack(self._shm)
            self._remote = _shm_tensor(self._shm, self.num_slots, self.slot_shape, self.dtype)
        elif self.transport == "cuda_ipc":
            fn, args = pickle.loads(self._exchange_bytes(None))
            self._remote = fn(*args)
        self._credits = collections.deque()
        self._fin = False
        self._credit_waiter = _FifoWaiter(f"{self.name}-credits")
        self._send_waiter = _FifoWaiter(f"{self.name}-sends")
        self._sends: list[_Done] = []
        self._dummy = None
        self._post_credit_recv()

    def _post_credit_recv(self) -> None:
        self._credit_buf = torch.zeros(2, dtype=torch.long)
        work = dist.irecv(self._credit_buf, self.peer, group=self._ctrl, tag=_TAG_CREDIT)
        self._credit_done = self._credit_waiter.add(work)

    def _isend(self, tensor: torch.Tensor, group, tag: int) -> None:
        self._sends = [d for d in self._sends if not d.done()]
        self._sends.append(self._send_waiter.add(dist.isend(tensor, self.peer, group=group, tag=tag), tensor))

    def _poll_credits(self) -> None:
        while not self._fin and self._credit_done.done():
            kind, slot = (int(x) for x in self._credit_buf)
            if kind == _FIN:
                self._fin = True
                return
            self._credits.append(slot)
            self._post_credit_recv()

    def _take_credit(self, deadline: float, what: str, timeout) -> int:
        def ready():
            self._poll_credits()
            if not self._credits and self._fin:
                raise TapClosedError(f"{self.name}: the consumer closed the channel")
            return bool(self._credits)

        if not self._credits:
            self._poll_credits()
            if not self._credits:
                self.stats["backpressure_waits"] += 1

        def expire():
            raise TapTimeoutError(
                f"{self.name}: back-pressure, no free slot on the consumer within "
                f"{self._secs(timeout):.3g}s while sending {what}"
            )

        _wait(ready, deadline, expire)
        return self._credits.popleft()

    def send(self, x: torch.Tensor, stamp: int, *, timeout: float | None = None) -> None:
        """Queue ``x`` (``[rows <= slot_shape[0], *slot_shape[1:]]``) under ``stamp``.

        Blocks only while the consumer has no free slot.  For p2p the send is
        asynchronous: do not modify ``x`` in place before :meth:`flush`.
        """
        self._require("producer")
        if x.dtype != self.dtype or x.device.type != self.device.type:
            raise TapShapeError(f"{self.name}: expected {self.dtype} on {self.device}, got {x.dtype} on {x.device}")
        fits = x.dim() == len(self.slot_shape) and tuple(x.shape[1:]) == self.slot_shape[1:]
        if not fits or x.shape[0] > self.slot_shape[0]:
            raise TapShapeError(f"{self.name}: payload {tuple(x.shape)} does not fit slot {self.slot_shape}")
        stamp = int(stamp)
        slot = self._take_credit(self._deadline(timeout), f"stamp {stamp}", timeout)
        rows = int(x.shape[0])
        if self.transport == "p2p":
            payload = x.contiguous()
            if rows != self.slot_shape[0]:
                full = torch.zeros(self.slot_shape, dtype=self.dtype, device=x.device)
                full[:rows] = payload
                payload = full
            self._isend(payload, self._data, _TAG_DATA)
        else:
            self._remote[slot, :rows].copy_(x)
            if self._remote.is_cuda:
                torch.cuda.current_stream(self._remote.device).synchronize()
        self._isend(torch.tensor([_DATA, stamp, slot, rows], dtype=torch.long), self._ctrl, _TAG_HEADER)
        self.stats["sent"] += 1

    def flush(self, *, timeout: float | None = None) -> None:
        """Wait until every queued send has left this rank."""
        self._require("producer")
        self._flush(self._deadline(timeout), timeout)

    def _flush(self, deadline: float, timeout) -> None:
        def done():
            self._sends = [d for d in self._sends if not d.done()]
            return not self._sends

        def expire():
            raise TapTimeoutError(f"{self.name}: sends not delivered within {self._secs(timeout):.3g}s")

        _wait(done, deadline, expire)

    # --------------------------------------------------------------- close
    def close(self, *, timeout: float | None = None) -> None:
        """Shut the channel down; both endpoints must call it.  Idempotent."""
        if self.closed:
            return
        deadline = self._deadline(timeout)
        try:
            if self.role == "consumer":
                self._close_consumer(deadline, timeout)
            else:
                self._close_producer(deadline, timeout)
        finally:
            self.closed = True
            self._release_memory()

    def _close_consumer(self, deadline: float, timeout) -> None:
        self._fin_sent = True
        self._send_credit(_FIN, -1)

        def drained():
            self._poll_headers()
            return not self._pending and all(d.done() for d in self._credit_sends)

        def expire():
            raise TapTimeoutError(f"{self.name}: producer did not close within {self._secs(timeout):.3g}s")

        _wait(drained, deadline, expire)

    def _close_producer(self, deadline: float, timeout) -> None:
        def fin():
            self._poll_credits()
            while self._credits:  # answer every outstanding grant so no receive stays posted
                slot = self._credits.popleft()
                if self.transport == "p2p":
                    if self._dummy is None:
                        self._dummy = torch.zeros(self.slot_shape, dtype=self.dtype, device=self.device)
                    self._isend(self._dummy, self._data, _TAG_DATA)
                self._isend(torch.tensor([_CLOSE, -1, slot, 0], dtype=torch.long), self._ctrl, _TAG_HEADER)
            return self._fin

        def expire():
            raise TapTimeoutError(f"{self.name}: consumer did not close within {self._secs(timeout):.3g}s")

        _wait(fin, deadline, expire)
        self._flush(deadline, timeout)

    def _release_memory(self) -> None:
        for attr in ("_hdr_waiter", "_send_waiter", "_credit_waiter"):
            waiter = getattr(self, attr, None)
            if waiter is not None:
                waiter.stop()
        self._slots = None
        self._remote = None
        if self._shm is not None:
            if self.role == "consumer":
                try:
                    self._shm.unlink()
                except FileNotFoundError:
                    pass
            try:
                self._shm.close()
            except BufferError:  # a caller still holds a view of a slot; the mapping goes with it
                pass
            self._shm = None

    def __enter__(self) -> "TapChannel":
        return self

    def __exit__(self, *exc) -> None:
        self.close()


def _shm_tensor(shm, n: int, slot_shape: tuple, dtype: torch.dtype) -> torch.Tensor:
    nbytes = n * math.prod(slot_shape) * torch.empty((), dtype=dtype).element_size()
    raw = torch.frombuffer(shm.buf, dtype=torch.uint8, count=nbytes)
    return raw.view(dtype).view((n,) + slot_shape)


def _untrack(shm) -> None:
    """Stop Python's resource tracker from unlinking a segment this process only attached to."""
    try:
        from multiprocessing import resource_tracker

        resource_tracker.unregister(shm._name, "shared_memory")  # noqa: SLF001
    except Exception:  # noqa: BLE001 - best effort; only affects a warning at exit
        pass
