"""Request accounting and leak checks for ``benchmark/soak.py`` and ``benchmark/faults.py``
(issue 27, items 1 and 3). Pure functions over records: no server, no clock.

One ``Outcome`` per scheduled request, kept whole in the run's JSON. ``judge`` decides each:

* pass: answered with ``finish_reason`` ``stop`` or ``length`` and the expected tokens (``length``:
  exactly ``expected_tokens``; ``stop``: at most that many), and, when the request carries
  ``expected_text`` (a greedy answer known in advance), that text;
* pass: one of the run's own aborts (kind ``abort``, ended ``aborted``);
* pass, faults only: in flight within a kill's window on the killed process's requests (its
  model; any model for a router kill) and ended with a named error (a router error code; for a
  router kill also a refused / reset / cut connection);
* pass: a 429 (``shed``) while the run's shed budget lasts (0 unless the run tests overload);
* anything else fails, with its reason. The run passes only if every request passes and
  sent == scheduled.

``self_deaths`` finds engine restarts no kill explains; ``leak_check`` compares two quiet-point
snapshots in the pool's own units: one leaked KV group trips it. ``soak_verdict`` and
``faults_verdict`` combine the three into each script's checks.
"""

from __future__ import annotations

from dataclasses import asdict, dataclass, field

# The router's named errors (docs/router.md, "Admission" and "Health"); "starting": serve's answer on
# the router's address while its engines start (after ``engine_restarting``, which contains it).
ROUTER_ERROR_CODES = ("engine_restarting", "engine_down", "engine_error", "engine_timeout",
                      "engine_failed_mid_response", "queue_full", "deadline", "starting")  # fmt: skip
CONNECTION_ERRORS = ("ConnectionRefusedError", "ConnectionResetError", "RemoteDisconnected", "IncompleteRead")
CUT_DETAIL = "stream ended without [DONE]"
ANSWERED = ("stop", "length")
KILL_PRE_S = 0.5  # a kill's window opens this long before the kill (the two clocks are read apart)
# Fault kinds (``faults.py``, ``fault_kinds.py``) by what their kill ends. One engine: its model's
# in-flight requests may end with a router code, and the kill explains one death of that engine
# (a scheduler or detokenizer kill also one hang: upstream's ``launch_server`` may be found hung
# before it exits). The arbiter: nothing may fail, no engine dies.
ENGINE_KINDS = ("engine", "peer_donor", "scheduler", "detokenizer", "join_full_pool")
CHILD_KINDS = ("scheduler", "detokenizer")
ARBITER_KINDS = ("arbiter", "arbiter_reclaim")
OVERLOAD_CODES = ("deadline", "queue_full")  # the router's shedding, named


@dataclass
class Outcome:
    """One scheduled request. Times are seconds on the run's load clock; ``kill`` is the window
    (fault number) that excused it, set by ``judge``; ``verdict`` is ``pass: ...`` / ``fail: ...``."""

    index: int
    model: str
    kind: str
    scheduled_at: float
    phase: str = ""
    sent: bool = False
    sent_at: float | None = None
    ended_at: float | None = None
    result: str | None = None  # the client's: ok | shed | aborted | error | failed
    status: int | None = None  # HTTP status when one came
    finish_reason: str | None = None
    tokens: int | None = None
    expected_tokens: int | None = None
    text: str | None = None  # kept only when compared (expected_text set)
    expected_text: str | None = None
    error: str = ""
    error_code: str | None = None  # a router code, ``connection`` or ``cut``
    engine: str | None = None  # the replica, when known (the router does not say)
    latency_s: float | None = None
    kill: int | None = None
    verdict: str = ""

    def to_json(self) -> dict:
        return asdict(self)


def error_code(text: str) -> str | None:
    """The clear error a failure text names: a router code, ``connection`` or ``cut``; else None."""
    for code in ROUTER_ERROR_CODES:
        if code in text:
            return code
    if any(c in text for c in CONNECTION_ERRORS) or "Connection refused" in text:
        return "connection"
    return "cut" if CUT_DETAIL in text else None


def normalize_finish(reason) -> str | None:
    """``stop`` / ``length`` / ``abort`` ... from OpenAI's string or native ``meta_info``'s dict."""
    if isinstance(reason, dict):
        reason = reason.get("type")
    return None if reason is None else str(reason)


@dataclass
class KillWindow:
    """A kill's window on the load clock: ``[t - KILL_PRE_S, recovered + post_s]``. ``model`` is
    the killed engine's model (None: the router, whose kill ends every model's requests)."""

    n: int
    kind: str
    start: float
    end: float
    model: str | None
    overloaded: tuple[str, ...] = ()  # models the fault itself loaded past their SLOs (join_full_pool's fill)
    overload_start: float = float("inf")

    def _overlaps(self, o: Outcome, start: float) -> bool:
        return o.sent_at is not None and o.ended_at is not None and o.sent_at <= self.end and o.ended_at >= start

    def excuses(self, o: Outcome) -> bool:
        if self.overloads(o) and o.error_code in OVERLOAD_CODES:  # sheds (429) are judged by excuses_shed
            return True
        if not self._overlaps(o, self.start):
            return False
        if self.kind == "router":
            return o.error_code is not None
        if self.kind in ENGINE_KINDS:
            return o.model == self.model and o.error_code in ROUTER_ERROR_CODES
        return False  # the arbiter (ARBITER_KINDS): engines keep serving on private budgets, no request may fail

    def overloads(self, o: Outcome) -> bool:
        """``o`` went to a model this fault overloaded on purpose, while it did."""
        return o.model in self.overloaded and self._overlaps(o, self.overload_start)

    def excuses_shed(self, o: Outcome) -> bool:
        """A 429 of a model this fault overloaded on purpose (the fill is the run's own extra load,
        beyond the schedule), or of the killed model while it restarts (its queue waits past the
        deadline for an engine that is not there): the router shedding by design, not harm."""
        if o.result != "shed":
            return False
        down = self.kind in ENGINE_KINDS and o.model == self.model and self._overlaps(o, self.start)
        return down or self.overloads(o)


def kill_windows(faults: list[dict], load_offset_s: float, post_s: float) -> list[KillWindow]:
    """The windows of ``faults.py``'s fault records (run clock; ``t_recovered`` when healthy
    again, else the window stays open to the end of the run). Skipped faults and arbiter kills
    (``ARBITER_KINDS``) have none."""
    out = []
    for f in faults:
        if f.get("skipped") or f["kind"] in ARBITER_KINDS:
            continue
        end = f.get("t_recovered")
        end = float("inf") if end is None else end - load_offset_s + post_s
        target = f.get("target") or ""
        model = None if f["kind"] == "router" else target.split("#")[0]
        window = KillWindow(f["n"], f["kind"], f["t"] - load_offset_s - KILL_PRE_S, end, model)
        if f.get("fill_models"):  # join_full_pool: its filler loaded these from t_wait_began on
            window.overloaded = tuple(m.split("#")[0] for m in f["fill_models"])
            window.overload_start = f.get("t_wait_began", f["t"]) - load_offset_s - KILL_PRE_S
        out.append(window)
    return out


def _answered(o: Outcome) -> str:
    """'' when ``o`` answered as asked, else why not."""
    if o.finish_reason not in ANSWERED:
        return f"answered {o.status or 200} with finish_reason {o.finish_reason!r}"
    if o.tokens is None:
        return "no completion token count"
    if o.expected_tokens is not None:
        if o.finish_reason == "length" and o.tokens != o.expected_tokens:
            return f"finish_reason length with {o.tokens} tokens, expected {o.expected_tokens}"
        if o.tokens > o.expected_tokens:
            return f"{o.tokens} tokens, more than the {o.expected_tokens} asked"
    if o.expected_text is not None and o.text != o.expected_text:
        return f"wrong greedy answer: {o.text!r} != {o.expected_text!r}"
    return ""


def _decide(o: Outcome, windows: list[KillWindow], shed_left: list[int]) -> str:
    if not o.sent:
        return "fail: scheduled but never sent (dropped)"
    if o.result == "aborted":
        return "pass: our abort" if o.kind == "abort" else f"fail: a {o.kind} request ended as an abort"
    if o.result == "shed":
        for w in windows:
            if w.excuses_shed(o):
                o.kill = w.n
                return f"pass: shed within fault {w.n}'s window ({w.kind})"
        if shed_left[0] > 0:
            shed_left[0] -= 1
            return "pass: shed within the budget"
        return "fail: 429 beyond the shed budget"
    if o.result == "ok":
        why = _answered(o)
        return f"fail: {why}" if why else "pass: answered"
    o.error_code = o.error_code or error_code(o.error)
    for w in windows:
        if w.excuses(o):
            o.kill = w.n
            return f"pass: {o.error_code} within fault {w.n}'s window ({w.kind})"
    if o.error_code == "connection":
        return f"fail: connection error outside any kill window: {o.error[:120]}"
    if o.error_code is not None:
        return f"fail: {o.error_code} that no kill explains: {o.error[:120]}"
    return f"fail: {o.result or 'no outcome'}: {o.error[:160]}"


def judge(outcomes: list[Outcome], windows: list[KillWindow] = (), shed_budget: int = 0,
          min_scheduled: int = 1) -> dict:  # fmt: skip
    """Sets every outcome's ``verdict`` (and ``kill``); returns the run's checks and tallies.
    ``windows`` is empty for the soak: there, every error fails."""
    shed_left = [shed_budget]
    for o in sorted(outcomes, key=lambda o: o.index):
        o.verdict = _decide(o, list(windows), shed_left)
    failed = [o for o in outcomes if o.verdict.startswith("fail")]
    reasons: dict[str, int] = {}
    for o in failed:
        head = o.verdict.split(":")[1].strip()
        reasons[head] = reasons.get(head, 0) + 1
    sent = sum(o.sent for o in outcomes)
    shed = sum(o.result == "shed" and o.kill is None for o in outcomes)  # a fault's own overload apart
    checks = {
        f"sent == scheduled ({sent} of {len(outcomes)})": sent == len(outcomes),
        f"scheduled >= {min_scheduled}": len(outcomes) >= min_scheduled,
        f"429s within the shed budget ({shed} <= {shed_budget})": shed <= shed_budget,
        "every request answered stop/length with its tokens, or is excused": not failed,
    }
    return {"checks": checks, "scheduled": len(outcomes), "sent": sent, "failed": len(failed),
            "failure_reasons": reasons, "excused_by_kills": sum(o.kill is not None for o in outcomes),
            "first_failures": [o.to_json() for o in failed[:10]]}  # fmt: skip


def self_deaths(readings: list[dict[str, dict]], kills_by_target: dict[tuple[int, str], int],
                child_kills: dict[tuple[int, str], int] | None = None) -> list[str]:  # fmt: skip
    """Engine deaths no kill explains. ``readings[i]`` is the last ``/memx/serve`` ``engines`` read
    from router incarnation ``i`` (a router restart starts the counters again); a death is a
    restart, a failed restart attempt or a hang kill; ``kills_by_target[(i, key)]`` counts the
    run's own kills of engine ``key`` in incarnation ``i`` (the soak: none), one death each.
    ``child_kills[(i, key)]`` (of those, the kills of its scheduler or detokenizer alone) may each
    also explain one hang: a hung ``launch_server`` is killed, then restarted (hang + restart)."""
    out = []
    for i, engines in enumerate(readings):
        for key, e in sorted(engines.items()):
            hangs = e.get("hangs") or 0
            deaths = (e.get("restarts") or 0) + (e.get("restart_failures") or 0) + hangs
            if e.get("state") in ("restarting", "dead") and not e.get("alive", True):
                deaths += 1  # down now, not yet counted as a restart
            explained = kills_by_target.get((i, key), 0) + min(hangs, (child_kills or {}).get((i, key), 0))
            extra = deaths - explained
            if extra > 0:
                out.append(f"engine {key} (router incarnation {i}) died {extra} time(s) on its own; "
                           f"last exit: {e.get('last_exit')!r}")  # fmt: skip
    return out


def run_kills(faults: list[dict]) -> tuple[dict[tuple[int, str], int], dict[tuple[int, str], int]]:
    """``self_deaths``' two counts from the fault records: every done kill of one engine
    (``ENGINE_KINDS``) and, of those, its scheduler's or detokenizer's (``CHILD_KINDS``)."""
    kills: dict[tuple[int, str], int] = {}
    child: dict[tuple[int, str], int] = {}
    for f in faults:
        if f["kind"] in ENGINE_KINDS and f.get("target") and not f.get("skipped"):
            at = (f["incarnation"], f["target"])
            kills[at] = kills.get(at, 0) + 1
            if f["kind"] in CHILD_KINDS:
                child[at] = child.get(at, 0) + 1
    return kills, child


@dataclass
class LeakLimits:
    """Growth allowed between two quiet points, each in its own unit: KV groups (per engine:
    mapped groups, mapped bytes / group size, chunks held at the arbiter / chunks per group),
    open fds, threads, RSS bytes (stated as a multiple of the pool's size by the caller).

    fds: the router keeps keep-alive connections to its engines and may hold a few more at the
    second quiet point than at the first (one more was seen in a clean run); a leak of one fd per
    request (a hundred or more in the shortest soak) still trips the limit of 8.

    threads: the router's and each HTTP front end's thread pools (asyncio's default executor,
    which resolves addresses for new connections, and the ASGI server's worker threads) start
    threads on demand up to their bounds and keep them. In six soaks of 1 to 30 minutes the
    growth was -1 to 5, the 5 being the router's +3 and two front ends' +1 each, the schedulers'
    0; a leak of one thread per request is again a hundred or more, and trips 8."""

    kv_groups: int = 0
    fds: int = 8
    threads: int = 8
    rss_bytes: int = 32 << 20
    check_processes: bool = True

    def to_json(self) -> dict:
        return asdict(self)


@dataclass
class LeakReport:
    violations: list[str] = field(default_factory=list)
    growth: dict = field(default_factory=dict)


def _engine_growth(key: str, a: dict, b: dict, limit: int, report: LeakReport) -> None:
    """Growth of one engine's KV between two quiet points; held chunks net of its peer donation."""
    group_bytes, cpg = b.get("group_bytes") or 1, b.get("chunks_per_group") or 1
    row = {"kv_groups": b["kv_groups"] - a["kv_groups"],
           "mapped_groups_by_bytes": (b["mapped_bytes"] - a["mapped_bytes"]) / group_bytes}  # fmt: skip
    if a.get("arbiter_held") is not None and b.get("arbiter_held") is not None:
        donated_a, donated_b = a.get("donated_chunks", 0), b.get("donated_chunks", 0)
        row["held_groups"] = ((b["arbiter_held"] - donated_b) - (a["arbiter_held"] - donated_a)) / cpg
        report.growth[key] = dict(row, donated_groups=(donated_b - donated_a) / cpg)
    else:
        report.growth[key] = row
    for what, grew in row.items():
        if grew >= limit + 1:
            report.violations.append(f"engine {key}: {what} grew by {grew:g} KV groups between quiet points "
                                     f"(limit {limit}); its chunks by owner {a.get('owners_chunks')} -> "
                                     f"{b.get('owners_chunks')}, its arbiter traffic {a.get('arbiter_traffic')} -> "
                                     f"{b.get('arbiter_traffic')}")  # fmt: skip


def _ledgers(label: str, snap: dict, report: LeakReport) -> None:
    """The engine's and the arbiter's counts agree; a donation stays under the donor's cap."""
    for key, e in sorted(snap.get("engines", {}).items()):
        cap = e.get("donation_cap_chunks")
        if cap is not None and e.get("donated_chunks", 0) > cap:
            report.violations.append(f"{label}: engine {key} donates {e['donated_chunks']} chunks to its peers, "
                                     f"over its cap of {cap}")  # fmt: skip
        if e.get("arbiter_held") is not None and e.get("held_chunks") is not None:
            if e["arbiter_held"] != e["held_chunks"]:
                report.violations.append(f"{label}: engine {key} holds {e['held_chunks']} chunks by its own "
                                         f"count, {e['arbiter_held']} by the arbiter's")  # fmt: skip


def leak_check(before: dict, after: dict, limits: LeakLimits) -> LeakReport:
    """Compare two quiet-point snapshots: ``{"engines": {key: {kv_groups, mapped_bytes, group_bytes,
    chunks_per_group, held_chunks (the engine's count), arbiter_held, donated_chunks,
    donation_cap_chunks, owners_chunks}}, "pool_held": {pool: chunks}, "pool_donated": {pool:
    chunks}, "processes": {rss_bytes, fds, threads}}`` (``quiet_point.snapshot``). Violations: an
    engine's and the arbiter's ledgers disagree at either point, or a donation is over its cap;
    an engine's KV (groups, bytes, held chunks net of its peer donation) or a pool's held chunks
    (net of its donations) grew by a whole KV group beyond ``limits.kv_groups``; fds / threads /
    RSS beyond theirs. A donation varies with the donor's idle time and is no leak."""
    report = LeakReport()
    _ledgers("first quiet point", before, report)
    _ledgers("second quiet point", after, report)
    engines_a, engines_b = before.get("engines", {}), after.get("engines", {})
    for key in sorted(set(engines_a) & set(engines_b)):
        _engine_growth(key, engines_a[key], engines_b[key], limits.kv_groups, report)
    cpg = min((e.get("chunks_per_group") or 1 for e in engines_b.values()), default=1)
    donated_a, donated_b = before.get("pool_donated", {}), after.get("pool_donated", {})
    for pool, held in sorted(after.get("pool_held", {}).items()):
        held_a = before.get("pool_held", {}).get(pool, held) - donated_a.get(pool, 0)
        grew = (held - donated_b.get(pool, 0) - held_a) / cpg
        report.growth[f"pool {pool}"] = {"held_groups": grew}
        if grew >= limits.kv_groups + 1:
            report.violations.append(f"pool {pool}: held chunks grew by {grew:g} KV groups (limit {limits.kv_groups})")
    if limits.check_processes:
        pa, pb = before.get("processes", {}), after.get("processes", {})
        for what, limit in (("fds", limits.fds), ("threads", limits.threads), ("rss_bytes", limits.rss_bytes)):
            if what in pa and what in pb:
                grew = pb[what] - pa[what]
                report.growth[what] = grew
                if grew > limit:
                    report.violations.append(f"{what} grew by {grew} between quiet points (limit {limit})")
    return report


def soak_verdict(outcomes, health: dict, before: dict, after: dict, limits: LeakLimits, shed_budget: int,
                min_n: int) -> tuple[dict[str, bool], dict]:  # fmt: skip
    """The request and leak checks of a soak: ``judge`` without kill windows (every error fails),
    no engine death or restart at all (``health``: ``/memx/serve``'s engines at the end), and the
    two quiet points' ``leak_check``. Returns (checks, details for the JSON)."""
    judgement = judge(outcomes, (), shed_budget, min_n)
    deaths = self_deaths([health], {})
    leak = leak_check(before, after, limits)
    checks = dict(judgement["checks"])
    checks["no engine died, restarted or hung"] = not deaths
    checks[f"no leak between quiet points (KV groups <= {limits.kv_groups}, fds <= {limits.fds}, threads <= "
           f"{limits.threads}, RSS <= {limits.rss_bytes / 2**20:.0f} MiB)"] = not leak.violations  # fmt: skip
    return checks, {
        "judgement": judgement,
        "self_deaths": deaths,
        "leak": {"limits": limits.to_json(), "violations": leak.violations, "growth": leak.growth},
    }


def faults_verdict(outcomes, faults: list[dict], health: list[dict], before: dict, after: dict, window_s: float,
                shed_budget: int) -> tuple[dict[str, bool], dict]:  # fmt: skip
    """The request, engine-death and leak checks of a fault run: ``judge`` with every kill's
    window (run clock: ``outcomes`` and ``faults`` share it), engine deaths beyond the run's own
    kills of that engine in that router incarnation, and the pool-unit ``leak_check`` between
    the quiet points before the load and after it (processes are replaced by kills: not compared)."""
    windows = kill_windows(faults, 0.0, window_s)
    judgement = judge(outcomes, windows, shed_budget)
    deaths = self_deaths(health, *run_kills(faults))
    leak = leak_check(before, after, LeakLimits(check_processes=False))
    checks = dict(judgement["checks"])
    checks["no engine died on its own (restarts == the run's kills)"] = not deaths
    checks["no KV group leaked (quiet points before and after the load)"] = not leak.violations
    details = {"judgement": judgement, "self_deaths": deaths, "kill_windows": [vars(w) for w in windows],
               "leak": {"violations": leak.violations, "growth": leak.growth}}  # fmt: skip
    return checks, details
