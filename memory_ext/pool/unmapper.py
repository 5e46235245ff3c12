"""AsyncUnmapper: one worker thread that runs unmap/release jobs off the hot path.

    u = AsyncUnmapper()
    fut = u.submit(fn, *args)   # returns at once with a concurrent.futures.Future
    u.flush()                   # waits for every job submitted so far; re-raises the first failure
    u.close()                   # flush, then stop the thread (idempotent)

Jobs run one at a time, in submission order, on one daemon thread. A job's
exception is kept in its future and is raised again by the next ``flush()``
(the first one, with the count of others in the message), so a failed unmap
is never silently lost. Jobs must not call ``flush``/``close`` of their own
unmapper (they would wait for themselves).

Engine-agnostic: the jobs are plain callables; ``KVETensor`` submits
"unmap this retiring slot unless the retirement was cancelled".
"""

from __future__ import annotations

import queue
import threading
from collections.abc import Callable
from concurrent.futures import Future
from typing import Any

_STOP = object()


class AsyncUnmapper:
    def __init__(self, name: str = "memx-unmapper"):
        self._queue: queue.SimpleQueue = queue.SimpleQueue()
        self._lock = threading.Lock()
        self._pending: list[Future] = []
        self._closed = False
        self._thread = threading.Thread(target=self._run, name=name, daemon=True)
        self._thread.start()

    # ----------------------------------------------------------------- worker
    def _run(self) -> None:
        while True:
            item = self._queue.get()
            if item is _STOP:
                return
            fut, fn, args, kwargs = item
            if not fut.set_running_or_notify_cancel():
                continue
            try:
                result = fn(*args, **kwargs)
            except BaseException as exc:  # surfaced by flush()
                fut.set_exception(exc)
            else:
                fut.set_result(result)

    # ------------------------------------------------------------------- API
    @property
    def closed(self) -> bool:
        return self._closed

    def pending(self) -> int:
        """Jobs submitted and not yet flushed (done or not)."""
        with self._lock:
            return len(self._pending)

    def submit(self, fn: Callable[..., Any], *args: Any, **kwargs: Any) -> Future:
        fut: Future = Future()
        with self._lock:
            if self._closed:
                raise RuntimeError("AsyncUnmapper is closed")
            self._pending.append(fut)
            self._queue.put((fut, fn, args, kwargs))
        return fut

    def flush(self, timeout: float | None = None) -> int:
        """Wait for every job submitted before this call; return how many were waited on.

        Raises the first exception raised by any of them (``TimeoutError`` if
        ``timeout`` seconds pass first; the jobs then stay pending).
        """
        if threading.current_thread() is self._thread:
            raise RuntimeError("flush() called from the unmapper's own worker thread")
        with self._lock:
            futs = self._pending
            self._pending = []
        errors = []
        try:
            for fut in futs:
                exc = fut.exception(timeout=timeout)
                if exc is not None:
                    errors.append(exc)
        except BaseException:
            with self._lock:  # not waited on: keep them for the next flush
                self._pending[:0] = [f for f in futs if not f.done() or f.exception() is not None]
            raise
        if errors:
            first = errors[0]
            if len(errors) > 1:
                raise RuntimeError(f"{len(errors)} unmap jobs failed; first: {first!r}") from first
            raise first
        return len(futs)

    def close(self) -> None:
        """Flush, then stop the worker thread. Idempotent; raises like ``flush``."""
        with self._lock:
            if self._closed:
                return
            self._closed = True
        try:
            self.flush()
        finally:
            self._queue.put(_STOP)
            self._thread.join()

    def __enter__(self) -> AsyncUnmapper:
        return self

    def __exit__(self, *exc) -> None:
        self.close()
