"""Per-block generation counters in shared memory: the donor writes, borrowers read.

One ``uint64`` per block of a region, in a memfd of ``8 * capacity`` bytes that the donor
creates (``create``) and sends to the borrower, who maps it read-only (``open``). It lives in
host memory whatever the KV device is: the checks are made by the CPU.

Invariants:
* a counter only grows (``bump``), so a (block, generation) pair names one tenancy of the
  block forever: a reclaimed block never comes back with a generation a borrower saw before;
* the donor bumps a block's counter *before* anything else may write the block's bytes
  (region.revoke_tail), so a borrower that reads the counter before and after its copy and
  finds it unchanged has read bytes no one else wrote in between (seqlock).

Ordering: counters are aligned 8-byte words, loaded and stored whole. The copy between the
two loads is an opaque call (memcpy / a device copy followed by a stream sync), so neither
compiler nor CPU moves the loads across it on x86-64 (TSO: loads are not reordered with
loads, stores not with stores). A weakly ordered CPU would need explicit fences here.
"""

from __future__ import annotations

import mmap
import os
import stat

from ..policy._checks import check_int

WORD = 8


class GenerationTable:
    """``capacity`` counters; writable only in the process that created it."""

    def __init__(self, fd: int, capacity: int, writable: bool):
        self.capacity = check_int("capacity", capacity, minimum=1)
        self._fd = fd
        self._writable = writable
        prot = mmap.PROT_READ | (mmap.PROT_WRITE if writable else 0)
        self._mm = mmap.mmap(fd, capacity * WORD, flags=mmap.MAP_SHARED, prot=prot)
        self._words = memoryview(self._mm).cast("Q")
        self.closed = False

    @classmethod
    def create(cls, capacity: int, *, name: str = "memx-peer-gen") -> GenerationTable:
        """A new table, every counter 1 (0 is never a valid generation)."""
        check_int("capacity", capacity, minimum=1)
        fd = os.memfd_create(name, os.MFD_CLOEXEC)
        try:
            os.ftruncate(fd, capacity * WORD)
            table = cls(fd, capacity, writable=True)
        except BaseException:
            os.close(fd)
            raise
        for b in range(capacity):
            table._words[b] = 1
        return table

    @classmethod
    def open(cls, fd: int, capacity: int) -> GenerationTable:
        """Map a table received from the donor, read-only. Takes ownership of ``fd``."""
        try:
            st = os.fstat(fd)
            if not stat.S_ISREG(st.st_mode) or st.st_size != capacity * WORD:
                raise ValueError(
                    f"generations: fd {fd} is not a table of {capacity} counters ({st.st_size} bytes, "
                    f"mode {st.st_mode:#o})"
                )
            return cls(fd, capacity, writable=False)
        except BaseException:
            os.close(fd)
            raise

    def export_fd(self) -> int:
        """A new fd for the same table (the caller owns and closes it)."""
        return os.dup(self._fd)

    def get(self, block: int) -> int:
        return self._words[block]

    def bump(self, blocks) -> None:
        """Increase each listed block's counter by one (donor only)."""
        if not self._writable:
            raise PermissionError("generations: this table is a borrower's read-only map")
        words = self._words
        for b in blocks:
            words[b] += 1

    def close(self) -> None:
        if self.closed:
            return
        self.closed = True
        self._words.release()
        self._mm.close()
        os.close(self._fd)
