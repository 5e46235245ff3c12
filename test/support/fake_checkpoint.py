"""A checkpoint-shaped directory (config.json + a weight file of a given size), no real weights."""

from __future__ import annotations

import json


def fake_model(root, name="m", layers=2, kv_heads=2, head_dim=16, weight_bytes=1000, dtype="bfloat16", hidden=64):
    d = root / name
    d.mkdir(parents=True, exist_ok=True)
    cfg = {"num_hidden_layers": layers, "num_attention_heads": 4, "num_key_value_heads": kv_heads,
           "head_dim": head_dim, "hidden_size": hidden, "torch_dtype": dtype}  # fmt: skip
    (d / "config.json").write_text(json.dumps(cfg))
    with open(d / "model.safetensors", "wb") as f:
        f.truncate(weight_bytes)
    return d
