"""Per-device chunk arbiter: several engine processes share one device's memory.

One ``Arbiter`` per device owns the physical chunks (created lazily, at most
``budget_chunks``) and lends them to client processes over a Unix socket
(SOCK_SEQPACKET, mode 0600). Chunks travel as fds (SCM_RIGHTS, ``vmm.ipc``);
the client imports them into its own backend and maps them where it likes.
Wire format: ``arbiter_protocol``. Client: ``arbiter_client.ArbiterClient``.

Ledger and invariants (``check_invariants``)
--------------------------------------------
Every created chunk is either FREE or held by exactly one connected client;
``sum(held) + free == created <= budget``. A chunk is only granted from FREE
(or freshly created), so it is never granted twice. ``created`` counts the
chunks clients ``ADOPT``ed too: memory a client kept privately after an earlier
arbiter died, booked as held by it without fds (never FREE). Adopted chunks
leave ``created`` when the client ``RELEASE``s them or disconnects, so
``sum(held incl. adopted) + free + uncreated == budget`` always.

Client death
------------
When a client's socket reaches EOF or errors (including the process being
SIGKILLed: the kernel closes its end), every chunk it held returns to FREE
immediately and its waiting borrows are dropped. The arbiter does not scrub
the bytes of returned chunks (the next borrower may see old contents).

Arbiter death
-------------
If this process dies, its clients keep the chunks they hold (the memfds stay
mapped in their processes) and fall back to a private budget of exactly those
(``lent_pool``). A new arbiter on the same socket starts with the full budget;
each survivor reconnects and ``ADOPT``s what it kept, so the budget again counts
every chunk of the device (an adoption the budget cannot cover is partial, and
the survivor retries and destroys its unbooked chunks first when it gives memory
back).

Robustness
----------
A malformed message gets an ERROR naming the field and changes nothing (an
empty packet included: field ``message``; only EOF ends a connection);
fds sent to the arbiter are closed on arrival; one event-loop thread does all
the work under one lock, so ``status()``/``check_invariants()`` are safe from
other threads. A reply too big for one packet (a STATUS listing many clients with
long names) is an ERROR with field ``message``, not a dropped connection. At most
``max_clients`` connections (default 64) are served at once; one more gets ERROR
``clients`` and is closed, so a flood of connections cannot exhaust the arbiter's
fds. ``test/unit/test_arbiter_fuzz.py`` drives a live arbiter with random message
sequences and checks all of this after every step.

Who may connect
---------------
The socket file is 0600 and ``vmm.ipc.listen_unix`` refuses a directory that another
user owns or may write to. On top of that the arbiter reads each connection's peer
credentials (``SO_PEERCRED``) and refuses a uid outside ``allowed_uids`` (default: its
own effective uid): one ERROR with field ``peer_uid``, then the connection is closed,
before anything is read from it.

Modules: ``server`` (``Arbiter``: the socket event loop and the message handlers), ``ledger``
(the chunks and who holds them), ``records`` (a client, a waiting borrow), ``reclaim`` (BORROW:
where a borrow's chunks come from), ``link`` (the shared host link), ``cli`` (``python -m
memory_ext.pool.arbiter``); this package re-exports ``Arbiter``, ``ArbiterInvariantError`` and
``main``.

Run as a process::

    python -m memory_ext.pool.arbiter --socket /run/memx/gpu0.sock \\
        --budget-chunks 4096 --granularity-mib 2
"""

from .cli import main
from .ledger import ArbiterInvariantError
from .server import Arbiter

__all__ = ["Arbiter", "ArbiterInvariantError", "main"]
