"""`python -m sglang.launch_server` with --memx-* flags, as a user types them.

These start the real upstream launcher (argument parsing happens before any
model is loaded, so no server comes up)."""

import os
import subprocess
import sys

import pytest

from support.server import plugins_without_memx

pytestmark = [pytest.mark.integration, pytest.mark.timeout(300)]


def _launch(*args, env=None):
    full_env = dict(os.environ, SGLANG_USE_CPU_ENGINE="1", **(env or {}))
    return subprocess.run([sys.executable, "-m", "sglang.launch_server", *args],
                          capture_output=True, text=True, timeout=240, env=full_env)


def test_help_shows_the_memx_group():
    out = _launch("--help")
    assert out.returncode == 0
    assert "sglang-memx (integrated memory subsystem)" in out.stdout
    assert "--memx-status-path" in out.stdout and "--memx-disable" in out.stdout


@pytest.mark.parametrize("argv, flag, fragment", [
    (["--memx-status-path", "relative"], "--memx-status-path", "absolute URL path"),
    (["--memx-status-path", "/generate"], "--memx-status-path", "upstream SGLang route"),
    (["--memx-disable", "--memx-status-path", "/x"], "--memx-disable", "contradicts --memx-status-path"),
])
def test_bad_memx_value_exits_2_naming_the_flag(argv, flag, fragment):
    out = _launch("--model-path", "unused", *argv)
    assert out.returncode == 2, out.stderr[-2000:]
    assert f"error: argument {flag}: " in out.stderr and fragment in out.stderr


def test_unknown_memx_flag_is_rejected():
    out = _launch("--model-path", "unused", "--memx-no-such-flag", "1")
    assert out.returncode == 2
    assert "unrecognized arguments: --memx-no-such-flag" in out.stderr


def test_filtering_the_plugin_out_removes_the_flags():
    out = _launch("--help", env={"SGLANG_PLUGINS": plugins_without_memx()})
    assert out.returncode == 0
    assert "--memx-" not in out.stdout and "--model-path" in out.stdout


def test_config_reaches_server_args_and_survives_pickling():
    script = (
        "import pickle\n"
        "from sglang.srt.plugins import load_plugins\n"
        "load_plugins()\n"
        "from sglang.srt.server_args import prepare_server_args\n"
        "from sglang_memx.runtime import config_of\n"
        "sa = prepare_server_args(['--model-path', 'unused', '--memx-status-path', '/ops/memx'])\n"
        "clone = pickle.loads(pickle.dumps(sa))\n"
        "print(config_of(clone).status_path, config_of(clone).disabled)\n"
    )
    out = subprocess.run([sys.executable, "-c", script], capture_output=True, text=True,
                         timeout=240, env=dict(os.environ, SGLANG_USE_CPU_ENGINE="1"))
    assert out.returncode == 0, out.stderr[-3000:]
    assert out.stdout.strip().splitlines()[-1] == "/ops/memx False"
    assert "sglang-memx 0.1.0 active on sglang 0.5.23" in out.stderr
