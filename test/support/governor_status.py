"""Reading a memx server's governor: its ``/memx/status`` block and the ``/memx/metrics`` samples
that must agree with it (the SLO in force and its source, the batch cap and why, the refusals)."""

from __future__ import annotations

import re


def governor(server) -> dict:
    """The first scheduler's governor block of ``/memx/status``."""
    return server.request("/memx/status")["schedulers"][0]["elastic_kv"]["governor"]


def metric(text: str, name: str, **labels) -> float | None:
    """The value of the one sample of ``name`` whose labels include ``labels`` (None: no such sample)."""
    want = [f'{k}="{v}"' for k, v in labels.items()]
    found = [float(m.group(2)) for m in re.finditer(rf"^{name}\{{([^}}]*)\}} (\S+)$", text, re.M)
             if all(w in m.group(1).split(",") for w in want)]  # fmt: skip
    assert len(found) <= 1, (name, labels, found)
    return found[0] if found else None


def check_visible(server, gov: dict, source: str = "--memx-tpot-slo-ms") -> str:
    """The status names the SLO and its ``source``; /memx/metrics agrees with it on the SLO,
    the cap, its reason and the refusals. Returns the metrics text."""
    assert gov["slos"]["tpot"] == {"ms": gov["tpot_slo_ms"], "source": source}
    text = server.request_text("/memx/metrics")
    slo_s = metric(text, "memx_governor_tpot_slo_seconds", source=source)
    assert slo_s is not None and abs(slo_s - gov["tpot_slo_ms"] / 1e3) < 1e-12
    assert metric(text, "memx_governor_batch_cap_reason", reason=gov["batch_cap_reason"]) == 1
    assert metric(text, "memx_governor_batch_cap_reason", reason="no_slo") == 0
    assert metric(text, "memx_governor_batch_cap") == gov["batch_cap"]  # None (absent) when there is no cap
    assert metric(text, "memx_governor_decisions_total", reason="over_slo") >= gov["decisions"]["over_slo"]
    return text
