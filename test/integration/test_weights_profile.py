"""``sglang-memx profile`` on real SGLang (CPU): the record it writes loads and is sane."""

from __future__ import annotations

import json
import subprocess
import sys

import pytest

from memory_ext.policy.layer_profile import LayerProfile
from sglang_memx.models.tiny import TinyModelSpec, tiny_model
from support.server import LOG_DIR

pytestmark = [pytest.mark.integration, pytest.mark.timeout(900)]

SPEC = TinyModelSpec(arch="llama", num_layers=4, hidden_size=128, num_heads=4, num_kv_heads=2, head_dim=32,
                     intermediate_size=256, seed=3)  # fmt: skip


def test_profile_writes_a_valid_record(tiny_model_root, tmp_path):
    model = tiny_model(SPEC, tiny_model_root)
    out = tmp_path / "profile.json"
    LOG_DIR.mkdir(exist_ok=True)
    cmd = [sys.executable, "-m", "sglang_memx.cli", "profile", "--model-path", str(model), "--out", str(out),
           "--batch-sizes", "1,2", "--decode-tokens", "16", "--log", str(LOG_DIR / "w-profile.log"),
           "--", "--dtype", "float32", "--max-total-tokens", "2048"]  # fmt: skip
    done = subprocess.run(cmd, capture_output=True, text=True, timeout=600)
    assert done.returncode == 0, done.stderr[-3000:]
    record = LayerProfile.load(out)
    assert record.n_layers == 4 and record.dtype == "float32" and set(record.decode_layer_s) == {1, 2}
    # the layer's parameters: qkv, o, gate_up, down, two norms, float32
    assert record.layer_bytes == 4 * (128 * (128 + 2 * 64) + 128 * 128 + 2 * 256 * 128 + 128 * 256 + 2 * 128)
    assert record.link_bytes_per_s > 1e8 and record.prefill_layer_s_per_token > 0
    assert json.loads(out.read_text())["schema"] == "memx.layer_profile/1"
    assert "--batch-sizes 1,2" in record.command
