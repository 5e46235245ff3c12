"""The sglang-memx command line (no server needed)."""

import json

from sglang_memx.cli import main
from support.server import free_port


def test_version(capsys):
    assert main(["version"]) == 0
    assert capsys.readouterr().out.strip() == (
        "sglang-memx 0.1.0 (upstream sglang 0.5.23, supported; supported range >=0.5.23,<0.5.24)"
    )


def test_models_tiny_writes_a_model(tmp_path, capsys):
    out = tmp_path / "m"
    assert main(["models", "tiny", "--out", str(out), "--arch", "qwen3", "--kv-heads", "4"]) == 0
    assert capsys.readouterr().out.strip() == str(out)
    cfg = json.loads((out / "config.json").read_text())
    assert cfg["architectures"] == ["Qwen3ForCausalLM"] and cfg["num_key_value_heads"] == 4


def test_models_tiny_bad_shape_names_the_field(tmp_path, capsys):
    assert main(["models", "tiny", "--out", str(tmp_path / "m"), "--kv-heads", "3"]) == 2
    assert "num_kv_heads" in capsys.readouterr().err
    assert not (tmp_path / "m").exists()


def test_models_path_honours_cache_root(tmp_path, capsys):
    assert main(["models", "path", "--cache-root", str(tmp_path)]) == 0
    assert capsys.readouterr().out.strip() == str(tmp_path / "SmolLM2-135M-Instruct-bf16")


def test_status_reports_unreachable_server(capsys):
    url = f"http://127.0.0.1:{free_port()}"
    assert main(["status", "--url", url, "--timeout", "2"]) == 1
    err = capsys.readouterr().err
    assert "cannot read" in err and url in err
