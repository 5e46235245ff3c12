"""Performance record of one model on one machine (Select-N S2, Oneiros T_T / T_c).

``sglang-memx profile`` measures it on real hardware, the simulator builds it
from its roofline; both write and read it through this module, so the
interval manager (``interval_manager.py``) sees the same numbers either way.
Standard library only.

Invariants (checked in ``__post_init__``; every error is a ValueError whose
message names the field as ``layer profile field '<name>': ...``):

* ``n_layers >= 1``, ``layer_bytes >= 1``, ``seq_len >= 1`` are ints;
* ``link_bytes_per_s``, ``prefill_layer_s_per_token`` and every
  ``decode_layer_s`` value are finite and > 0; ``decode_layer_s`` has at least
  one entry, its keys are batch sizes >= 1 and it is stored sorted by batch;
* ``measured_at`` is an ISO 8601 time; ``model``, ``device``, ``dtype`` are
  non-empty strings.

JSON form (``to_json`` / ``from_json``): the fields above plus
``"schema": "memx.layer_profile/1"``; batch sizes become string keys. An
unknown schema, a missing, unknown or mistyped field raises ValueError.
"""

from __future__ import annotations

import json
import math
from dataclasses import dataclass, fields
from datetime import datetime
from pathlib import Path
from typing import Any

__all__ = ["SCHEMA", "LayerProfile"]

SCHEMA = "memx.layer_profile/1"


def _err(name: str, msg: str) -> ValueError:
    return ValueError(f"layer profile field {name!r}: {msg}")


def _str(name: str, v: Any, empty_ok: bool = False) -> str:
    if not isinstance(v, str) or (not v and not empty_ok):
        raise _err(name, f"must be a {'' if empty_ok else 'non-empty '}string, got {v!r}")
    return v


def _int(name: str, v: Any) -> int:
    if isinstance(v, bool) or not isinstance(v, int) or v < 1:
        raise _err(name, f"must be an int >= 1, got {v!r}")
    return v


def _pos(name: str, v: Any) -> float:
    if isinstance(v, bool) or not isinstance(v, (int, float)) or not math.isfinite(v) or v <= 0:
        raise _err(name, f"must be a finite number > 0, got {v!r}")
    return float(v)


def _iso(name: str, v: Any) -> str:
    _str(name, v)
    try:
        datetime.fromisoformat(v[:-1] + "+00:00" if v.endswith("Z") else v)
    except ValueError:
        raise _err(name, f"must be an ISO 8601 time, got {v!r}") from None
    return v


def _decode_table(name: str, v: Any) -> dict[int, float]:
    if not isinstance(v, dict) or not v:
        raise _err(name, f"must be a non-empty mapping batch -> seconds, got {v!r}")
    out: dict[int, float] = {}
    for b, t in v.items():
        if isinstance(b, str) and b.isdigit():
            b = int(b)
        if isinstance(b, bool) or not isinstance(b, int) or b < 1:
            raise _err(name, f"batch sizes must be ints >= 1, got {b!r}")
        if b in out:
            raise _err(name, f"batch size {b} given twice")
        if isinstance(t, bool) or not isinstance(t, (int, float)) or not math.isfinite(t) or t <= 0:
            raise _err(name, f"seconds at batch {b} must be a finite number > 0, got {t!r}")
        out[b] = float(t)
    return dict(sorted(out.items()))


@dataclass(frozen=True)
class LayerProfile:
    """Measured per-layer times of one model on one device (module docstring).

    ``decode_layer_s[b]``: seconds of one decoder layer's forward in a decode
    step of batch ``b`` at context ``seq_len``; ``prefill_layer_s_per_token``:
    seconds per prompt token per layer; ``link_bytes_per_s``: measured
    host -> device copy bandwidth (on CPU: a memory copy); ``layer_bytes``:
    bytes of one decoder layer's parameters.
    """

    model: str
    device: str
    dtype: str
    n_layers: int
    layer_bytes: int
    link_bytes_per_s: float
    decode_layer_s: dict[int, float]
    prefill_layer_s_per_token: float
    seq_len: int
    measured_at: str
    command: str

    def __post_init__(self) -> None:
        _str("model", self.model)
        _str("device", self.device)
        _str("dtype", self.dtype)
        _int("n_layers", self.n_layers)
        _int("layer_bytes", self.layer_bytes)
        object.__setattr__(self, "link_bytes_per_s", _pos("link_bytes_per_s", self.link_bytes_per_s))
        object.__setattr__(self, "decode_layer_s", _decode_table("decode_layer_s", self.decode_layer_s))
        object.__setattr__(
            self, "prefill_layer_s_per_token", _pos("prefill_layer_s_per_token", self.prefill_layer_s_per_token)
        )
        _int("seq_len", self.seq_len)
        _iso("measured_at", self.measured_at)
        _str("command", self.command, empty_ok=True)

    # ---- derived times -------------------------------------------------------------------
    @property
    def layer_transfer_s(self) -> float:
        """T_T / t_tr: seconds to copy one layer host -> device, no contention."""
        return self.layer_bytes / self.link_bytes_per_s

    def decode_layer_seconds(self, batch: int) -> float:
        """One layer's decode time at ``batch`` (at the profile's ``seq_len``).

        Piecewise-linear between measured batches; below the smallest measured
        batch the smallest batch's time (flat: a decode step does not get
        cheaper than its weight reads); above the largest, linear
        extrapolation from the last two points, with a negative slope
        (measurement noise) taken as flat, so the result never drops below a
        measured time beyond the grid. One measured point: flat everywhere.
        """
        if isinstance(batch, bool) or not isinstance(batch, int) or batch < 1:
            raise ValueError(f"batch must be an int >= 1, got {batch!r}")
        pts = list(self.decode_layer_s.items())
        b0, t0 = pts[0]
        if batch <= b0:
            return t0
        for (b1, t1), (b2, t2) in zip(pts, pts[1:]):
            if batch <= b2:
                return t1 + (t2 - t1) * (batch - b1) / (b2 - b1)
        if len(pts) == 1:
            return t0
        (b1, t1), (b2, t2) = pts[-2], pts[-1]
        return t2 + max(0.0, (t2 - t1) / (b2 - b1)) * (batch - b2)

    def prefill_layer_seconds(self, tokens: int) -> float:
        """One layer's prefill time for ``tokens`` prompt tokens (linear in tokens)."""
        if isinstance(tokens, bool) or not isinstance(tokens, int) or tokens < 1:
            raise ValueError(f"tokens must be an int >= 1, got {tokens!r}")
        return tokens * self.prefill_layer_s_per_token

    # ---- JSON ----------------------------------------------------------------------------
    def to_json(self) -> dict[str, Any]:
        """JSON-able dict with the schema key; batch keys as strings."""
        out: dict[str, Any] = {"schema": SCHEMA}
        for f in fields(self):
            out[f.name] = getattr(self, f.name)
        out["decode_layer_s"] = {str(b): t for b, t in self.decode_layer_s.items()}
        return out

    @classmethod
    def from_json(cls, obj: Any) -> LayerProfile:
        """Inverse of ``to_json``; strict about schema, missing and unknown fields."""
        if not isinstance(obj, dict):
            raise ValueError(f"layer profile: expected a JSON object, got {type(obj).__name__}")
        if obj.get("schema") != SCHEMA:
            raise _err("schema", f"expected {SCHEMA!r}, got {obj.get('schema')!r}")
        names = [f.name for f in fields(cls)]
        for name in names:
            if name not in obj:
                raise _err(name, "missing")
        for name in obj:
            if name != "schema" and name not in names:
                raise _err(name, "unknown field")
        return cls(**{name: obj[name] for name in names})

    def save(self, path: str | Path) -> None:
        """Write the JSON form to ``path`` (parent directories created)."""
        p = Path(path)
        p.parent.mkdir(parents=True, exist_ok=True)
        p.write_text(json.dumps(self.to_json(), indent=1) + "\n")

    @classmethod
    def load(cls, path: str | Path) -> LayerProfile:
        """Read a profile written by ``save`` (or ``sglang-memx profile``)."""
        p = Path(path)
        try:
            obj = json.loads(p.read_text())
        except json.JSONDecodeError as e:
            raise ValueError(f"layer profile {p}: not JSON: {e}") from None
        return cls.from_json(obj)
