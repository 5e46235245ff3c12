"""``MemoryArbiter``: the node's ledger of accounts (X1), granting by the priority rule
(``priority``) and checking the mechanisms' explicit moves against it.

Only when the node's tiers leave a shortfall may weights of an idle model be
remapped (``move(..., Tier.REMAP)``, the model and the layer count being
Oneiros's decision); the arbiter refuses a remap while they could still
cover it, from a model that has work (its weights are in use), and into a
model whose own weights are remapped out (no mutual lending: it would only
unwind when both pools are idle at once). A weights restore is a
``request`` on the lender's ``weights`` account (free budget and RETURN
only; the lender is entitled, having lent). ``release`` gives bytes of an
account back to free (e.g. a restore given up).

The mechanisms' own decisions are explicit ``move``s checked against the
same rule "never memory in use": eLLM inflation (``OWN``: activation -> KV of the
same model, at most the idle activation) and deflation (KV -> activation, at
most the idle KV), Select-N offload (``OFFLOAD``: weights -> KV of the same
model, keeping one layer), SwiftCache SCALEDOWN (``LEND``: idle KV of the
worker -> the master's peer account on the worker's GPU) and SCALEUP
(``RECLAIM``: peer account -> the worker's KV).

Invariants (``check``, also asserted after every change): for every GPU
``free + sum(held) == budget`` and ``free >= 0`` (so nothing is ever
granted beyond the budget); ``0 <= idle <= held`` and ``held >= floor`` for
every account; the peak of ``sum(held)`` never exceeds the budget.
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence

from .._checks import check_int as _int
from .accounts import DEFAULT_TIERS, Account, AccountKey, Grant, Kind, PriorityViolation, Take, Tier
from .priority import Donor, lendable_bytes, plan_takes
from .priority import ceil_to as _ceil
from .priority import floor_to as _floor

_REQUEST_TIERS = frozenset(DEFAULT_TIERS)


class MemoryArbiter:
    """See the docstrings of this module, ``accounts`` and ``priority``. ``budgets``: bytes per GPU index;
    ``floor_fraction``: share of its nominal KV a model keeps when others
    take its idle KV (``IDLE_PEER``, ``SURPLUS``); ``tiers``: the request
    tiers this node uses (default all four, in priority order; a remap is
    refused while these tiers could cover it)."""

    def __init__(
        self, budgets: Mapping[int, int], floor_fraction: float = 0.25, tiers: Sequence[Tier | str] = DEFAULT_TIERS
    ) -> None:
        if not budgets:
            raise ValueError("budgets must name at least one GPU")
        self.budget: dict[int, int] = {}
        for g, b in budgets.items():
            _int("gpu", g)
            self.budget[g] = _int(f"budgets[{g}]", b)
        if (
            isinstance(floor_fraction, bool)
            or not isinstance(floor_fraction, (int, float))
            or not 0 <= floor_fraction <= 1
        ):
            raise ValueError(f"floor_fraction must be a number in [0, 1], got {floor_fraction!r}")
        self.floor_fraction = float(floor_fraction)
        self.tiers = self._tiers(tiers)
        self.free: dict[int, int] = dict(self.budget)
        self.peak: dict[int, int] = dict.fromkeys(self.budget, 0)
        self.accounts: dict[AccountKey, Account] = {}
        self.busy: dict[tuple[int, str], bool] = {}
        self.moved: dict[Tier, int] = dict.fromkeys(Tier, 0)
        self.events: dict[Tier, int] = dict.fromkeys(Tier, 0)
        self.requests = self.refused = 0

    # ---- setup -----------------------------------------------------------------
    def open(self, gpu: int, owner: str, kind: Kind | str, held: int, unit: int = 1, floor: int = 0) -> AccountKey:
        """Create an account holding ``held`` bytes taken from the free budget."""
        if gpu not in self.budget:
            raise ValueError(f"gpu {gpu!r} has no budget")
        if not isinstance(owner, str) or not owner:
            raise ValueError(f"owner must be a non-empty str, got {owner!r}")
        try:
            kind = Kind(kind)
        except ValueError:
            raise ValueError(f"kind must be one of {[k.value for k in Kind]}, got {kind!r}") from None
        key = AccountKey(gpu, owner, kind)
        if key in self.accounts:
            raise ValueError(f"account {key} already open")
        _int("held", held)
        _int("unit", unit, 1)
        _int("floor", floor)
        if floor > held:
            raise ValueError(f"floor must be <= held ({held}), got {floor}")
        if held > self.free[gpu]:
            raise ValueError(f"held: {held} bytes exceed the {self.free[gpu]} free bytes of gpu {gpu}")
        self.accounts[key] = Account(key, held, unit, floor, held)
        self.busy.setdefault((gpu, owner), False)
        self.free[gpu] -= held
        self._after(gpu)
        return key

    # ---- numbers in ----------------------------------------------------------------
    def report(self, key: AccountKey, idle: int, headroom: int = 0) -> None:
        """How many bytes of ``key`` are idle now (free, or cache nobody uses),
        and how many of those its model wants to keep (``headroom``)."""
        acc = self._acc(key)
        _int("idle", idle)
        _int("headroom", headroom)
        if idle > acc.held:
            raise ValueError(f"idle: {idle} > held {acc.held} of {key}")
        acc.idle, acc.headroom = idle, headroom

    def set_busy(self, gpu: int, owner: str, busy: bool) -> None:
        """Whether ``owner`` has work (requests waiting or running) on ``gpu``."""
        if not isinstance(busy, bool):
            raise ValueError(f"busy must be a bool, got {busy!r}")
        self.busy[(gpu, owner)] = busy

    # ---- queries ---------------------------------------------------------------------
    def held(self, key: AccountKey) -> int:
        return self._acc(key).held

    def allocated(self, gpu: int) -> int:
        return self.budget[gpu] - self.free[gpu]

    def nominal(self, gpu: int, owner: str) -> int:
        return sum(a.nominal for a in self.accounts.values() if a.key.gpu == gpu and a.key.owner == owner)

    def owner_held(self, gpu: int, owner: str) -> int:
        return sum(a.held for a in self.accounts.values() if a.key.gpu == gpu and a.key.owner == owner)

    def excess(self, gpu: int, owner: str) -> int:
        return self.owner_held(gpu, owner) - self.nominal(gpu, owner)

    def lendable(
        self, donor: AccountKey, tier: Tier, requester_owner: str | None = None, entitled: bool = False
    ) -> int:
        """Bytes ``request`` could take from ``donor`` by ``tier`` right now."""
        return self._lendable(self._acc(donor), tier, requester_owner, 0, entitled)

    def _lendable(self, a: Account, tier: Tier, requester_owner: str | None, spent: int, entitled: bool) -> int:
        """``lendable`` after ``spent`` bytes were already planned from ``a``."""
        return lendable_bytes(self._donor(a), tier, requester_owner, spent, entitled, self.floor_fraction)

    def _donor(self, a: Account) -> Donor:
        return Donor(
            a.key,
            a.held,
            a.idle,
            a.headroom,
            a.unit,
            a.nominal,
            self.excess(a.key.gpu, a.key.owner),
            self.busy.get((a.key.gpu, a.key.owner), False),
        )

    def _plan(
        self, key: AccountKey, want: int, tiers: tuple[Tier, ...], entitled: bool
    ) -> tuple[int, list[tuple[Account, int, Tier]]]:
        """Dry run of ``request``: the bytes gathered and the donor takes."""
        g = key.gpu
        donors = [self._donor(a) for a in self.accounts.values() if a.key.gpu == g and a.key.kind is Kind.KV]
        pool, takes = plan_takes(key.owner, want, self.free[g], donors, tiers, entitled, self.floor_fraction)
        return pool, [(self.accounts[d.key], t, tier) for d, t, tier in takes]

    def grantable(
        self, key: AccountKey, tiers: Sequence[Tier | str] | None = None, entitled: bool | None = None
    ) -> int:
        """Bytes ``request(key, ...)`` could gather from ``tiers`` (default:
        the node's) now, whatever it asks."""
        self._acc(key)
        if entitled is None:
            entitled = self.excess(key.gpu, key.owner) < 0
        pool, _ = self._plan(key, 1 << 62, self.tiers if tiers is None else self._tiers(tiers), entitled)
        return pool

    @staticmethod
    def _tiers(tiers: Sequence[Tier | str]) -> tuple[Tier, ...]:
        out = []
        for t in tiers:
            try:
                t = Tier(t)
            except ValueError:
                raise ValueError(f"tiers: expected some of {[x.value for x in DEFAULT_TIERS]}, got {t!r}") from None
            if t not in _REQUEST_TIERS:
                raise ValueError(f"tiers: request draws only from {[x.value for x in DEFAULT_TIERS]}, got {t.value}")
            out.append(t)
        return tuple(out)

    # ---- decisions out ---------------------------------------------------------------
    def request(
        self,
        key: AccountKey,
        nbytes: int,
        partial: bool = True,
        tiers: Sequence[Tier | str] | None = None,
        entitled: bool | None = None,
    ) -> Grant:
        """Grow ``key`` by ``nbytes`` (rounded up to its unit) from idle memory,
        in the priority order of the module docstring (``tiers``: a subset,
        default the node's). ``partial``: accept less than asked (at least
        one unit); otherwise all or nothing. ``entitled``: whether borrowers
        give back idle memory without keeping their headroom (default: the
        requester's owner is below its nominal). A refusal changes nothing."""
        acc = self._acc(key)
        _int("nbytes", nbytes, 1)
        tiers = self.tiers if tiers is None else self._tiers(tiers)
        if entitled is None:
            entitled = self.excess(key.gpu, key.owner) < 0
        self.requests += 1
        g = key.gpu
        want = _ceil(nbytes, acc.unit)
        pool, plan = self._plan(key, want, tiers, entitled)
        granted = min(want, _floor(pool, acc.unit))
        if granted <= 0 or (not partial and granted < want):
            self.refused += 1
            return Grant(
                key,
                want,
                0,
                (),
                f"refused: {pool} bytes idle in tiers "
                f"{'/'.join(t.value for t in tiers) or 'none'} < "
                f"{'one unit' if partial else 'all'} of {want} asked",
            )
        from_free = min(self.free[g], granted) if Tier.FREE in tiers else 0
        takes: list[Take] = []
        if from_free:
            takes.append(Take(None, from_free, Tier.FREE))
            self._count(Tier.FREE, from_free)
        for a, t, tier in plan:
            a.held -= t
            a.idle -= t
            self.free[g] += t
            takes.append(Take(a.key, t, tier))
            self._count(tier, t)
        self.free[g] -= granted
        acc.held += granted
        self._after(g)
        return Grant(
            key, want, granted, tuple(takes), "granted" if granted == want else f"partial: {granted} of {want}"
        )

    def move(self, src: AccountKey, dst: AccountKey, nbytes: int, tier: Tier | str) -> Grant:
        """An explicit decision of a mechanism (module docstring): ``nbytes``
        leave ``src``; ``dst`` receives them rounded down to its unit, the
        remainder goes to free. Refused (``ValueError``) if it would take
        memory in use, cross GPUs, or break the priority rule."""
        s, d = self._acc(src), self._acc(dst)
        tier = Tier(tier)
        _int("nbytes", nbytes, 1)
        if src.gpu != dst.gpu:
            raise ValueError(f"move: {src} and {dst} are on different GPUs")
        allowed = {
            Tier.OWN: {(Kind.ACTIVATION, Kind.KV), (Kind.KV, Kind.ACTIVATION)},
            Tier.OFFLOAD: {(Kind.WEIGHTS, Kind.KV)},
            Tier.REMAP: {(Kind.WEIGHTS, Kind.KV)},
            Tier.LEND: {(Kind.KV, Kind.PEER)},
            Tier.RECLAIM: {(Kind.PEER, Kind.KV)},
        }.get(tier)
        if allowed is None or (src.kind, dst.kind) not in allowed:
            raise ValueError(f"move: tier {tier.value} cannot move {src.kind.value} -> {dst.kind.value}")
        if tier in (Tier.OWN, Tier.OFFLOAD) and src.owner != dst.owner:
            raise ValueError(f"move: tier {tier.value} stays within one model, got {src.owner} -> {dst.owner}")
        if tier is Tier.REMAP and src.owner == dst.owner:
            raise ValueError("move: a model cannot remap its weights into its own KV")
        if tier is Tier.RECLAIM and src.owner == dst.owner:
            raise ValueError("move: a peer account belongs to a model on another GPU")
        if s.key.kind in (Kind.KV, Kind.ACTIVATION):
            if nbytes % s.unit:
                raise ValueError(f"nbytes: {nbytes} is not a multiple of {src}'s unit {s.unit}")
            if nbytes > s.idle:
                raise ValueError(f"nbytes: {nbytes} > {s.idle} idle bytes of {src} (never memory in use)")
        if s.held - nbytes < s.floor:
            raise ValueError(f"nbytes: {src} would keep {s.held - nbytes} < floor {s.floor} bytes")
        if tier is Tier.REMAP:
            why = self.remap_refusal(dst, nbytes, src)
            if why:
                raise PriorityViolation(why)
        got = _floor(nbytes, d.unit)
        s.held -= nbytes
        s.idle = min(max(s.idle - nbytes, 0), s.held)
        d.held += got
        self.free[src.gpu] += nbytes - got
        self._count(tier, nbytes)
        self._after(src.gpu)
        return Grant(dst, nbytes, got, (Take(src, nbytes, tier),), tier.value)

    def remap_refusal(self, dst: AccountKey, nbytes: int, src: AccountKey | None = None) -> str:
        """Why a remap of ``nbytes`` of weights (of ``src``) into ``dst`` is
        refused now ("" if allowed): the lender has work (its weights are in
        use: every iteration reads them), the node's request tiers could still
        cover it, or the borrower has weights of its own remapped out (it gets
        those back first -- two models never hold each other's weights, which
        could only be undone when both pools are idle)."""
        d = self._acc(dst)
        if src is not None and self.busy.get((src.gpu, src.owner), False):
            return f"remap refused: {src.owner} has work, its weights are in use"
        cheap = self.grantable(dst)
        if cheap >= max(_floor(nbytes, d.unit), 1):
            return (
                f"remap refused: {cheap} idle bytes (free / returned / idle peers) can still cover "
                f"{_floor(nbytes, d.unit)}; request() them first"
            )
        w = self.accounts.get(AccountKey(dst.gpu, dst.owner, Kind.WEIGHTS))
        if w is not None and w.held < w.nominal:
            return f"remap refused: {dst.owner} has {w.nominal - w.held} bytes of its own weights remapped out"
        return ""

    def release(self, key: AccountKey, nbytes: int) -> None:
        """Give ``nbytes`` of ``key`` back to the free budget (idle bytes only
        for KV / activation; weights keep their floor)."""
        a = self._acc(key)
        _int("nbytes", nbytes, 1)
        if a.key.kind in (Kind.KV, Kind.ACTIVATION) and nbytes > a.idle:
            raise ValueError(f"nbytes: {nbytes} > {a.idle} idle bytes of {key} (never memory in use)")
        if a.held - nbytes < a.floor:
            raise ValueError(f"nbytes: {key} would keep {a.held - nbytes} < floor {a.floor} bytes")
        a.held -= nbytes
        a.idle = min(max(a.idle - nbytes, 0), a.held)
        self.free[key.gpu] += nbytes
        self._after(key.gpu)

    # ---- invariants ----------------------------------------------------------------------
    def check(self) -> None:
        """Assert the invariants of the module docstring (every GPU)."""
        for g in self.budget:
            self._after(g)

    def _after(self, g: int) -> None:
        held = 0
        for a in self.accounts.values():
            if a.key.gpu != g:
                continue
            assert 0 <= a.idle <= a.held, f"{a.key}: idle {a.idle} not in [0, held {a.held}]"
            assert a.held >= a.floor, f"{a.key}: held {a.held} < floor {a.floor}"
            held += a.held
        assert self.free[g] >= 0, f"gpu {g}: free {self.free[g]} < 0"
        assert held + self.free[g] == self.budget[g], (
            f"gpu {g}: held {held} + free {self.free[g]} != budget {self.budget[g]}"
        )
        self.peak[g] = max(self.peak[g], held)
        assert self.peak[g] <= self.budget[g], f"gpu {g}: peak {self.peak[g]} > budget {self.budget[g]}"

    def _acc(self, key: AccountKey) -> Account:
        a = self.accounts.get(key)
        if a is None:
            raise ValueError(f"no account {key}")
        return a

    def _count(self, tier: Tier, nbytes: int) -> None:
        self.moved[tier] += nbytes
        self.events[tier] += 1

    def stats(self) -> dict[str, object]:
        return {
            "requests": self.requests,
            "refused": self.refused,
            "moved_bytes": {t.value: b for t, b in self.moved.items()},
            "events": {t.value: n for t, n in self.events.items()},
            "budget_bytes": {str(g): b for g, b in self.budget.items()},
            "peak_allocated_bytes": {str(g): p for g, p in self.peak.items()},
            "free_bytes": {str(g): f for g, f in self.free.items()},
        }
