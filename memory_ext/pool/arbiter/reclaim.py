"""Where the chunks of a borrow that cannot be granted at once come from.

BORROW and reclaim
------------------
``BORROW(n)`` is granted at once from FREE + uncreated chunks when no earlier
borrow is waiting. Otherwise *where the shortfall comes from* is the node
policy's decision, the same one the simulator's ledger makes:
``memory_ext.policy.arbiter.plan_takes`` over the other clients, each seen as
a KV account (``held`` chunks; ``idle``/``headroom``/``busy`` as its last
``REPORT`` said, minus what it was already asked for; ``nominal`` = the fair
share ``budget // clients``): idle memory of clients above their share goes
back first (RETURN), then idle clients' (IDLE_PEER), then busy clients'
surplus beyond their headroom (SURPLUS); memory in use is never asked for.
A client that never reported counts as busy with everything above
``floor_per_client`` idle. If the plan cannot cover ``n`` the borrow is DENIED
at once (``available`` says what it could gather); else it waits (FIFO) and
the arbiter sends ``RECLAIM(k)`` to each planned donor. Clients answer with
ordinary RETURNs. The head of the queue is granted as soon as enough chunks
are FREE (all-or-nothing); a waiting borrow that is not satisfied within
``reclaim_timeout`` seconds (default 2) is DENIED. The requester is never
asked to give chunks back for its own borrow.

A donor that answered short (its REPORT, sent once it gave back what it could, says it has
less idle than it was asked for and has not returned yet) is no longer counted on for the rest
(``replan_short_answer``): the rest of the waiting borrows' shortfall is planned again among the
others (e.g. one holding warm chunks), instead of the borrow waiting for chunks that will not
come until something else frees them or the timeout denies it.
"""

from __future__ import annotations

from collections.abc import Iterable, Sequence

from ...policy.arbiter import DEFAULT_TIERS, AccountKey, Donor, Kind, plan_takes
from .ledger import ChunkLedger
from .records import ClientRecord, PendingBorrow, policy_owner


def donor_view(c: ClientRecord, nominal: int, floor: int) -> Donor:
    """Client ``c`` as the policy sees it (module docstring), net of what it was already asked for."""
    held = c.holding - c.asked
    idle = held - floor if c.idle is None else min(c.idle - c.asked, held - floor)
    idle = max(0, idle)
    return Donor(
        AccountKey(0, policy_owner(c), Kind.KV),
        held,
        idle,
        min(c.headroom, idle),
        1,
        nominal,
        c.holding - nominal,
        c.busy,
    )


def plan_reclaim(
    clients: Iterable[ClientRecord], client: ClientRecord, want: int, budget: int, floor: int
) -> tuple[int, list[tuple[ClientRecord, int, str]]]:
    """Where ``want`` more chunks for ``client`` would come from, among the connected ``clients``:
    (chunks gatherable, [(donor, chunks, tier)])."""
    clients = list(clients)
    others = [c for c in clients if c is not client and c.name is not None]
    named = sum(1 for c in clients if c.name is not None)
    nominal = budget // max(1, named)
    by_key = {}
    donors = []
    for c in others:
        d = donor_view(c, nominal, floor)
        by_key[d.key] = c
        donors.append(d)
    entitled = client.holding < nominal
    gathered, takes = plan_takes(policy_owner(client), want, 0, donors, DEFAULT_TIERS, entitled, 0.0)
    return gathered, [(by_key[d.key], n, tier.value) for d, n, tier in takes]


def replan_short_answer(
    ledger: ChunkLedger, reporter: ClientRecord, pending: Sequence[PendingBorrow], budget: int, floor: int
) -> list[tuple[ClientRecord, int, str]] | None:
    """After ``reporter``'s REPORT: None when nothing changes (no borrow waits, or it still
    reports at least what it was asked for); else withdraw the ask it cannot meet
    (``reporter.asked`` becomes its reported idle) and return the RECLAIMs that cover the waiting
    borrows' remaining shortfall from the others ([] when it is covered, or cannot be: the
    timeout then denies the borrow with what could be had)."""
    if not pending or reporter.idle is None or reporter.asked <= reporter.idle:
        return None
    reporter.asked = max(0, reporter.idle)
    clients = list(ledger.clients.values())
    shortfall = sum(p.n for p in pending) - ledger.available_now() - sum(c.asked for c in clients)
    if shortfall <= 0:
        return []
    gathered, takes = plan_reclaim(clients, pending[0].client, shortfall, budget, floor)  # reporter: idle - asked = 0
    return takes if gathered >= shortfall else []
