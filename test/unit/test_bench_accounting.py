"""benchmark/accounting.py, without servers: a constructed run that is clean passes; each fault
of issue 27's "Done when" -- a 200 with finish_reason abort, a wrong greedy answer, a dropped
request, a reset outside any kill window, an engine dying on its own, one leaked KV group --
fails it, naming the reason; a reset in a kill window on the killed model passes in faults only."""

from __future__ import annotations

import copy

import pytest

from benchmark.accounting import (
    KillWindow,
    LeakLimits,
    Outcome,
    error_code,
    faults_verdict,
    judge,
    kill_windows,
    leak_check,
    normalize_finish,
    self_deaths,
    soak_verdict,
)

RESET = "connection: ConnectionResetError(104, 'Connection reset by peer')"


def answered(i, model="tiny-a", kind="long", t=10.0, **kw) -> Outcome:
    fields = dict(sent=True, sent_at=t, ended_at=t + 1.0, result="ok", status=200, finish_reason="length",
                  tokens=16, expected_tokens=16)  # fmt: skip
    fields.update(kw)
    return Outcome(index=i, model=model, kind=kind, scheduled_at=t, **fields)


def clean_outcomes() -> list[Outcome]:
    return [
        answered(0),
        answered(1, kind="chat", finish_reason="stop", tokens=5, expected_tokens=24),
        Outcome(
            index=2,
            model="tiny-b",
            kind="abort",
            scheduled_at=11.0,
            sent=True,
            sent_at=11.0,
            ended_at=11.2,
            result="aborted",
            status=200,
        ),  # fmt: skip
        answered(3, kind="generate", model="tiny-c", expected_text="same", text="same"),
    ]


def engine_kv(groups=2, held=4) -> dict:
    return {"pid": 11, "kv_groups": groups, "mapped_bytes": groups * 1024, "group_bytes": 1024,
            "chunks_per_group": 2, "held_chunks": held, "arbiter_held": held}  # fmt: skip


def quiet_point(groups=2, held=4, rss=100 << 20, fds=500, threads=90) -> dict:
    return {"engines": {"tiny-a": engine_kv(groups, held), "tiny-b": engine_kv()}, "pool_held": {"cpu0": held + 4},
            "processes": {"rss_bytes": rss, "fds": fds, "threads": threads}}  # fmt: skip


HEALTHY = {"tiny-a": {"state": "awake", "alive": True, "restarts": 0, "restart_failures": 0, "hangs": 0}}


def soak(outcomes=None, health=HEALTHY, after=None) -> tuple[dict, dict]:
    before = quiet_point()
    return soak_verdict(clean_outcomes() if outcomes is None else outcomes, health, before,
                        quiet_point() if after is None else after, LeakLimits(), 0, 1)  # fmt: skip


def failed_checks(checks: dict) -> list[str]:
    return [k for k, v in checks.items() if not v]


def test_a_clean_run_passes_soak_and_faults():
    checks, details = soak()
    assert not failed_checks(checks), details
    checks, details = faults_verdict(clean_outcomes(), [], [HEALTHY], quiet_point(), quiet_point(), 10.0, 0)
    assert not failed_checks(checks), details


def _fails_with(outcomes, reason: str) -> None:
    checks, details = soak(outcomes)
    assert failed_checks(checks) == ["every request answered stop/length with its tokens, or is excused"]
    assert any(reason in r for r in details["judgement"]["failure_reasons"]), details["judgement"]
    checks, details = faults_verdict(outcomes, [], [HEALTHY], quiet_point(), quiet_point(), 10.0, 0)
    assert any(reason in r for r in details["judgement"]["failure_reasons"]), details["judgement"]


def test_a_200_with_finish_reason_abort_fails():
    _fails_with(clean_outcomes() + [answered(4, finish_reason="abort", tokens=3)], "finish_reason 'abort'")


def test_a_length_answer_short_of_its_tokens_fails():
    _fails_with(clean_outcomes() + [answered(4, tokens=15)], "expected 16")


def test_a_wrong_greedy_answer_fails():
    _fails_with(clean_outcomes() + [answered(4, expected_text="abc", text="abd")], "wrong greedy answer")


def test_a_dropped_request_fails_and_sent_differs_from_scheduled():
    outcomes = clean_outcomes() + [Outcome(index=4, model="tiny-a", kind="chat", scheduled_at=30.0)]
    checks, details = soak(outcomes)
    assert "sent == scheduled (4 of 5)" in failed_checks(checks)
    assert details["judgement"]["failure_reasons"] == {"scheduled but never sent (dropped)": 1}


def test_a_reset_outside_any_kill_window_fails_in_both():
    reset = Outcome(index=4, model="tiny-a", kind="chat", scheduled_at=50.0, sent=True, sent_at=50.0, ended_at=50.1,
                    result="error", error=RESET)  # fmt: skip
    _fails_with(clean_outcomes() + [reset], "connection error outside any kill window")
    faults = [{"n": 0, "kind": "router", "t": 100.0, "t_recovered": 200.0, "target": "router", "incarnation": 0}]
    checks, details = faults_verdict(clean_outcomes() + [copy.copy(reset)], faults, [HEALTHY, HEALTHY],
                                     quiet_point(), quiet_point(), 10.0, 0)  # fmt: skip
    assert "connection error outside any kill window" in details["judgement"]["failure_reasons"]


def test_a_named_error_in_the_killed_models_window_passes_in_faults_only():
    in_window = [
        Outcome(index=4, model="tiny-a", kind="chat", scheduled_at=99.0, sent=True, sent_at=99.0, ended_at=100.2,
                result="error", status=503, error='HTTP 503: {"code": "engine_restarting"}'),
        Outcome(index=5, model="tiny-b", kind="chat", scheduled_at=300.0, sent=True, sent_at=300.0, ended_at=300.1,
                result="error", error=RESET),
        # the restarted serve answers 503 "starting" on the router's address until its engines are up
        Outcome(index=6, model="tiny-b", kind="chat", scheduled_at=310.0, sent=True, sent_at=310.0, ended_at=310.1,
                result="error", status=503, error='HTTP 503: {"error": {"code": "starting"}}'),
    ]  # fmt: skip
    faults = [
        {"n": 0, "kind": "engine", "t": 100.0, "t_recovered": 150.0, "target": "tiny-a#1", "incarnation": 0},
        {"n": 1, "kind": "router", "t": 299.0, "t_recovered": 400.0, "target": "router", "incarnation": 0},
    ]
    health = [{"tiny-a#1": {"restarts": 1, "state": "awake", "alive": True}}, HEALTHY]
    checks, details = faults_verdict(clean_outcomes() + in_window, faults, health, quiet_point(), quiet_point(),
                                     10.0, 0)  # fmt: skip
    assert not failed_checks(checks), details
    assert details["judgement"]["excused_by_kills"] == 3
    checks, details = soak(clean_outcomes() + copy.deepcopy(in_window))
    assert details["judgement"]["failure_reasons"] == {"engine_restarting that no kill explains": 1,
                                                       "connection error outside any kill window": 1,
                                                       "starting that no kill explains": 1}  # fmt: skip


def test_an_error_on_another_model_or_after_the_window_is_not_excused():
    faults = [{"n": 0, "kind": "engine", "t": 100.0, "t_recovered": 150.0, "target": "tiny-a", "incarnation": 0}]
    windows = kill_windows(faults, 0.0, 10.0)
    assert windows == [KillWindow(0, "engine", 99.5, 160.0, "tiny-a")]
    other = Outcome(index=0, model="tiny-b", kind="chat", scheduled_at=120.0, sent=True, sent_at=120.0,
                    ended_at=121.0, result="error", error='"engine_restarting"')  # fmt: skip
    late = Outcome(index=1, model="tiny-a", kind="chat", scheduled_at=170.0, sent=True, sent_at=170.0,
                   ended_at=171.0, result="error", error='"engine_down"')  # fmt: skip
    reset = Outcome(index=2, model="tiny-a", kind="chat", scheduled_at=120.0, sent=True, sent_at=120.0,
                    ended_at=121.0, result="error", error=RESET)  # an engine kill never resets the client  # fmt: skip
    verdict = judge([other, late, reset], windows)
    assert verdict["failed"] == 3 and all(o.kill is None for o in (other, late, reset))
    arbiter = kill_windows([{"n": 1, "kind": "arbiter", "t": 100.0, "t_recovered": 101.0}], 0.0, 10.0)
    assert arbiter == []  # an arbiter kill excuses nothing


def test_429s_pass_only_within_the_shed_budget():
    shed = [Outcome(index=i, model="m", kind="chat", scheduled_at=1.0, sent=True, sent_at=1.0, ended_at=1.1,
                    result="shed", status=429) for i in range(3)]  # fmt: skip
    assert judge(copy.deepcopy(shed), shed_budget=3)["failed"] == 0
    verdict = judge(shed, shed_budget=1)
    assert verdict["failure_reasons"] == {"429 beyond the shed budget": 2}
    assert not verdict["checks"]["429s within the shed budget (3 <= 1)"]


def test_an_engine_dying_on_its_own_fails_both():
    died = {"tiny-a": {"state": "awake", "alive": True, "restarts": 1, "last_exit": "signal 9"}}
    checks, details = soak(health=died)
    assert failed_checks(checks) == ["no engine died, restarted or hung"]
    assert "died 1 time(s) on its own" in details["self_deaths"][0]
    faults = [{"n": 0, "kind": "engine", "t": 5.0, "t_recovered": 6.0, "target": "tiny-a", "incarnation": 0}]
    twice = {"tiny-a": {"state": "awake", "alive": True, "restarts": 1, "restart_failures": 1}}
    checks, details = faults_verdict(clean_outcomes(), faults, [twice], quiet_point(), quiet_point(), 10.0, 0)
    assert failed_checks(checks) == ["no engine died on its own (restarts == the run's kills)"]
    checks, _ = faults_verdict(clean_outcomes(), faults, [died], quiet_point(), quiet_point(), 10.0, 0)
    assert not failed_checks(checks)  # the one restart is the run's own kill
    down = {"tiny-b": {"state": "restarting", "alive": False, "restarts": 0}}
    assert self_deaths([{}, down], {}) == ["engine tiny-b (router incarnation 1) died 1 time(s) on its own; "
                                           "last exit: None"]  # fmt: skip


def test_one_leaked_kv_group_fails_both():
    after = quiet_point(groups=3, held=6)  # one group (2 chunks) more mapped and held by tiny-a
    checks, details = soak(after=after)
    assert failed_checks(checks) == [k for k in checks if k.startswith("no leak")]
    assert any("engine tiny-a: kv_groups grew by 1" in v for v in details["leak"]["violations"])
    checks, details = faults_verdict(clean_outcomes(), [], [HEALTHY], quiet_point(), after, 10.0, 0)
    assert failed_checks(checks) == ["no KV group leaked (quiet points before and after the load)"]


def test_a_kv_group_held_at_the_arbiter_but_not_by_the_engine_is_a_leak():
    after = quiet_point()
    after["engines"]["tiny-b"]["arbiter_held"] += 2  # the arbiter books a group the engine lost track of
    report = leak_check(quiet_point(), after, LeakLimits())
    assert any("tiny-b holds 4 chunks by its own count, 6 by the arbiter's" in v for v in report.violations)


def donating(snap: dict, chunks: int, cap: int = 8) -> dict:
    """``snap`` with tiny-a donating ``chunks`` more to its peers (held at the arbiter as its own)."""
    e = snap["engines"]["tiny-a"]
    e["held_chunks"] += chunks
    e["arbiter_held"] += chunks
    e.update(donated_chunks=chunks, donation_cap_chunks=cap, owners_chunks={"kv": 4, "peer_donation": chunks})
    snap["pool_held"]["cpu0"] += chunks
    snap["pool_donated"] = {"cpu0": chunks}
    return snap


def test_a_peer_donation_that_grew_is_no_leak_but_a_group_beside_it_is():
    before, after = donating(quiet_point(), 2), donating(quiet_point(), 6)  # the donor idled: 2 groups more
    report = leak_check(before, after, LeakLimits())
    assert report.violations == []
    assert report.growth["tiny-a"] == {"kv_groups": 0, "mapped_groups_by_bytes": 0.0, "held_groups": 0.0,
                                       "donated_groups": 2.0}  # fmt: skip
    assert report.growth["pool cpu0"] == {"held_groups": 0.0}
    leaked = donating(quiet_point(), 6)
    leaked["engines"]["tiny-a"]["held_chunks"] = leaked["engines"]["tiny-a"]["arbiter_held"] = 12  # a FREE group kept
    leaked["pool_held"]["cpu0"] += 2
    violations = leak_check(before, leaked, LeakLimits()).violations
    assert any(v.startswith("engine tiny-a: held_groups grew by 1 KV groups") and "'peer_donation': 6" in v
               for v in violations), violations  # fmt: skip
    assert any(v.startswith("pool cpu0: held chunks grew by 1") for v in violations)


def test_a_donation_over_the_donors_cap_is_a_violation():
    report = leak_check(donating(quiet_point(), 2), donating(quiet_point(), 10, cap=8), LeakLimits())
    assert report.violations == ["second quiet point: engine tiny-a donates 10 chunks to its peers, over its cap of 8"]


def test_less_than_a_group_and_process_limits():
    after = quiet_point()
    after["engines"]["tiny-a"]["arbiter_held"] = after["engines"]["tiny-a"]["held_chunks"] = 5  # half a group
    after["pool_held"]["cpu0"] += 1
    assert leak_check(quiet_point(), after, LeakLimits()).violations == []
    grown = quiet_point(rss=(100 << 20) + (33 << 20), fds=509, threads=99)
    violations = leak_check(quiet_point(), grown, LeakLimits()).violations
    assert [v.split()[0] for v in violations] == ["fds", "threads", "rss_bytes"]
    assert leak_check(quiet_point(), grown, LeakLimits(check_processes=False)).violations == []
    assert leak_check(quiet_point(), quiet_point(fds=508), LeakLimits()).violations == []  # keep-alive slack


@pytest.mark.parametrize(
    "text, code",
    [('HTTP 503: {"code": "engine_restarting"}', "engine_restarting"), (RESET, "connection"),
     ('HTTP 503: {"error": {"message": "sglang-memx serve is starting its engines", "code": "starting"}}',
      "starting"),
     ("connection: RemoteDisconnected('closed')", "connection"), ("stream ended without [DONE]", "cut"),
     ("HTTP 500: oops", None)],
)  # fmt: skip
def test_error_codes(text, code):
    assert error_code(text) == code


def test_finish_reasons_of_openai_and_native():
    assert normalize_finish("length") == "length"
    assert normalize_finish({"type": "abort", "message": "x"}) == "abort"
    assert normalize_finish(None) is None


def test_join_full_pool_excuses_the_sheds_of_the_models_its_filler_overloaded():
    """The fill is the run's own extra load: while it runs, the filled models' 429s and deadline
    errors are the router shedding by design; other models' and later ones still fail."""
    fault = {"n": 0, "kind": "join_full_pool", "t": 20.0, "t_wait_began": 10.0, "t_recovered": 40.0,
             "target": "tiny-a", "fill_models": ["tiny-a", "tiny-b#1"]}  # fmt: skip
    [w] = kill_windows([fault], 0.0, 5.0)
    assert w.overloaded == ("tiny-a", "tiny-b") and w.overload_start == 9.5 and w.end == 45.0

    def out(i, model, result, error="", t=12.0):
        return Outcome(i, model, "chat", t, sent=True, sent_at=t, ended_at=t + 1, result=result, status=429
                       if result == "shed" else None, error=error)  # fmt: skip

    deadline = "HTTP 503: {'code': 'deadline'}"
    outcomes = [out(0, "tiny-b", "shed"), out(1, "tiny-b", "error", deadline), out(2, "tiny-c", "shed"),
                out(3, "tiny-b", "shed", t=60.0)]  # fmt: skip
    verdict = judge(outcomes, [w], shed_budget=0)
    assert [o.verdict.split(":")[0] for o in outcomes] == ["pass", "pass", "fail", "fail"]
    assert not verdict["checks"]["429s within the shed budget (2 <= 0)"]


def test_a_429_of_the_killed_model_while_it_restarts_is_excused_others_are_not():
    fault = {"n": 3, "kind": "detokenizer", "t": 100.0, "t_recovered": 150.0, "target": "tiny-b"}
    windows = kill_windows([fault], 0.0, 10.0)

    def shed(i, model, t):
        return Outcome(i, model, "chat", t, sent=True, sent_at=t, ended_at=t + 25, result="shed", status=429)

    outcomes = [shed(0, "tiny-b", 110.0), shed(1, "tiny-c", 110.0), shed(2, "tiny-b", 170.0)]
    verdict = judge(outcomes, windows, shed_budget=0)
    assert [o.verdict.split(":")[0] for o in outcomes] == ["pass", "fail", "fail"]
    assert outcomes[0].kill == 3 and not verdict["checks"]["429s within the shed budget (2 <= 0)"]
