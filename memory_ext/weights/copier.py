"""Asynchronous copies from a layer's master copy (host memory) into its mapped range.

``HostCopier`` (CPU): one worker thread runs the copies in submission order; torch's
``copy_`` releases the GIL, so a copy overlaps the forward that runs meanwhile.
``CudaCopier``: copies go on a dedicated copy stream (pinned master -> device, non-blocking);
a copy first waits for the compute event the caller passes (the slot's previous layer must
have finished reading it). Written, not run on a GPU.

Both return a ``Ticket``: ``wait()`` blocks until the bytes are in place (on CUDA: makes the
current stream wait on the copy's event, which is what "in place" means to later kernels),
``done()`` polls, ``seconds`` is the copy's measured duration once done (host wall time; CUDA
event time). Invariant: a ticket's ``wait()`` returns only after every byte of its copy landed
or raises the copy's error.
"""

from __future__ import annotations

import queue
import threading
import time
from collections.abc import Callable

import torch


class Ticket:
    """One submitted copy. See the module docstring."""

    def __init__(self, nbytes: int):
        self.nbytes = nbytes
        self.seconds: float | None = None
        self._event = threading.Event()
        self._error: BaseException | None = None

    def _finish(self, seconds: float, error: BaseException | None = None) -> None:
        self.seconds, self._error = seconds, error
        self._event.set()

    def done(self) -> bool:
        return self._event.is_set()

    def wait(self, timeout: float | None = None) -> float:
        """Block until the copy landed; return the seconds spent waiting here (the stall)."""
        t0 = time.perf_counter()
        if not self._event.wait(timeout):
            raise TimeoutError(f"weight copy of {self.nbytes} bytes did not finish within {timeout} s")
        if self._error is not None:
            raise RuntimeError(f"weight copy failed: {self._error}") from self._error
        return time.perf_counter() - t0


class HostCopier:
    """Copies on one worker thread, in submission order (see the module docstring)."""

    def __init__(self, name: str = "memx-weight-copier"):
        self._jobs: queue.SimpleQueue = queue.SimpleQueue()
        self._thread = threading.Thread(target=self._run, name=name, daemon=True)
        self._closed = False
        self._thread.start()

    def submit(self, pairs: list[tuple[torch.Tensor, torch.Tensor]], after: Callable[[], None] | None = None) -> Ticket:
        """Copy each ``(dst, src)`` pair; ``after`` (optional) runs on the worker once they are done."""
        if self._closed:
            raise RuntimeError("HostCopier is closed")
        ticket = Ticket(sum(d.numel() * d.element_size() for d, _ in pairs))
        self._jobs.put((pairs, after, ticket))
        return ticket

    def _run(self) -> None:
        while True:
            job = self._jobs.get()
            if job is None:
                return
            pairs, after, ticket = job
            t0 = time.perf_counter()
            try:
                for dst, src in pairs:
                    dst.copy_(src)
                if after is not None:
                    after()
            except BaseException as exc:  # the waiter re-raises it
                ticket._finish(time.perf_counter() - t0, exc)
                continue
            ticket._finish(time.perf_counter() - t0)

    def fence(self, event=None) -> None:
        """Nothing to order on the host: a forward's reads are done when its hook returns."""

    def wait_fence(self) -> None:
        """Nothing to wait for on the host (see ``fence``)."""

    def close(self) -> None:
        if not self._closed:
            self._closed = True
            self._jobs.put(None)
            self._thread.join(timeout=10)


class CudaCopier:
    """Copies on a dedicated CUDA stream (see the module docstring). Written, not run on a GPU."""

    def __init__(self, device: torch.device):
        self.device = torch.device(device)
        self._stream = torch.cuda.Stream(device=self.device)
        self._fence = None

    def fence(self, event=None) -> None:
        """Record (or take) the compute event later copies must wait for: the slot they overwrite
        was read by kernels queued before this point."""
        if event is None:
            event = torch.cuda.Event()
            event.record(torch.cuda.current_stream(self.device))
        self._fence = event

    def wait_fence(self) -> None:
        """Block the host until the kernels before the last fence finished: a slot is unmapped
        only once nothing queued can still read it."""
        if self._fence is not None:
            self._fence.synchronize()

    def submit(self, pairs: list[tuple[torch.Tensor, torch.Tensor]], after: Callable[[], None] | None = None) -> Ticket:
        ticket = _CudaTicket(sum(d.numel() * d.element_size() for d, _ in pairs), self.device)
        with torch.cuda.stream(self._stream):
            if self._fence is not None:
                self._stream.wait_event(self._fence)
            ticket.start.record(self._stream)
            for dst, src in pairs:
                dst.copy_(src, non_blocking=True)
            ticket.end.record(self._stream)
        if after is not None:
            after()
        return ticket

    def close(self) -> None:
        self._stream.synchronize()


class _CudaTicket(Ticket):
    def __init__(self, nbytes: int, device: torch.device):
        super().__init__(nbytes)
        self.device = device
        self.start = torch.cuda.Event(enable_timing=True)
        self.end = torch.cuda.Event(enable_timing=True)

    def done(self) -> bool:
        return self.end.query()

    def wait(self, timeout: float | None = None) -> float:
        t0 = time.perf_counter()
        torch.cuda.current_stream(self.device).wait_event(self.end)
        if self.seconds is None and self.end.query():
            self.seconds = self.start.elapsed_time(self.end) / 1e3
        return time.perf_counter() - t0
