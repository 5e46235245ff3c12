"""After upstream loads its plugins, every memx hook is in force, the report says so per feature,
and a hook that did not apply stops a feature that needs it with an error naming the target.

Runs in a subprocess: upstream's HookRegistry patches classes for good in the process that applies it.
"""

from __future__ import annotations

import json
import subprocess
import sys
import textwrap

from sglang_memx.hooks import all_hook_specs

_SCRIPT = textwrap.dedent(
    """
    import json
    from sglang.srt.plugins import load_plugins
    load_plugins()
    from sglang_memx.config import MemxConfig
    from sglang_memx.hooks import all_hook_specs, verify_hooks
    from sglang_memx.upstream.registry import HookSpec, HooksNotInForce, report, verify
    specs = all_hook_specs()
    features = ["status_endpoint", "elastic_kv", "shared_pool", "host_buffer"]
    rows = report(specs, features)
    stock = report(specs, [])
    config = MemxConfig(elastic_kv=True, host_buffer_gb=1.0)
    verified = verify_hooks(config)
    # a hook registered nowhere: what verify must refuse
    spec = specs[-1]
    ghost = HookSpec(spec.target, spec.kind, lambda *a, **k: None, spec.feature, "a hook upstream never applied")
    try:
        verify([ghost], [spec.feature])
        refused = ""
    except HooksNotInForce as exc:
        refused = str(exc)
    print("REPORT" + json.dumps({"rows": rows, "stock": stock, "verified": len(verified), "refused": refused}))
    """
)


def test_every_hook_is_in_force_after_load_plugins_and_a_missing_one_is_named():
    run = subprocess.run([sys.executable, "-c", _SCRIPT], capture_output=True, text=True, timeout=300)
    assert run.returncode == 0, run.stderr[-3000:]
    doc = json.loads(run.stdout.split("REPORT", 1)[1])
    rows = doc["rows"]
    assert len(rows) == 26 and all(r["in_force"] for r in rows), [r for r in rows if not r["in_force"]]
    assert {r["feature"] for r in rows} == {"flags", "status_endpoint", "elastic_kv", "host_buffer"}
    # MHATokenToKVPool._create_buffers_normal, MLATokenToKVPool._create_buffers, ._get_token_info
    assert sum(r["private"] for r in rows) == 3
    assert all(r["why"] for r in rows)
    assert {r["feature"] for r in doc["stock"]} == {"flags"}  # no feature on: only the flag hooks matter
    assert doc["verified"] == 26
    assert "not in force" in doc["refused"] and all_hook_specs()[-1].target in doc["refused"]
