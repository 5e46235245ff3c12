"""The supported SGLang range is one constant (``sglang_memx.upstream.version.SUPPORTED_SGLANG``):
every file that names the SGLang version agrees with it, and a memx feature asked on an SGLang
outside the range stops the launch at parse time with an error naming both versions."""

from __future__ import annotations

import re
import subprocess
import sys
import textwrap
from importlib.metadata import version as dist_version
from pathlib import Path

import pytest
from packaging.specifiers import SpecifierSet

from sglang_memx.upstream import version

REPO = Path(__file__).resolve().parents[2]


def test_the_range_parses_and_holds_the_tested_release():
    assert version.TESTED_SGLANG in SpecifierSet(version.SUPPORTED_SGLANG)
    assert dist_version("sglang") == version.TESTED_SGLANG  # CI runs the release it tests


@pytest.mark.parametrize(
    "installed,ok", [("0.5.23", True), ("0.5.23.post1", True), ("0.5.22", False), ("0.6.0", False), ("dev", False)]
)
def test_is_supported(installed, ok):
    assert version.is_supported(installed) is ok


def test_the_message_names_both_versions():
    with pytest.raises(version.UnsupportedSGLang) as err:
        version.require_supported("--memx-elastic-kv", installed="0.6.0")
    text = str(err.value)
    assert "0.6.0" in text and version.SUPPORTED_SGLANG in text and "--memx-elastic-kv" in text


def test_every_file_that_names_the_sglang_version_agrees():
    pyproject = (REPO / "pyproject.toml").read_text()
    assert f'"sglang{version.SUPPORTED_SGLANG}"' in pyproject
    assert re.search(rf"^sglang=={re.escape(version.TESTED_SGLANG)}$", (REPO / "requirements/cpu.in").read_text(), re.M)
    assert re.search(
        rf"^sglang=={re.escape(version.TESTED_SGLANG)}$", (REPO / "requirements/lock.txt").read_text(), re.M
    )
    gpu = (REPO / "docker/Dockerfile").read_text()
    assert f"lmsysorg/sglang:v{version.TESTED_SGLANG}" in gpu and "sglang_memx.upstream.version" in gpu
    readme = (REPO / "README.md").read_text()
    assert f"sglang=={version.TESTED_SGLANG}" in readme and version.SUPPORTED_SGLANG in readme
    other = re.compile(r"sglang[=: v]+=?(0\.\d+\.\d+)")
    for path in [REPO / "README.md", *sorted((REPO / "docs").glob("*.md"))]:
        for found in other.findall(path.read_text()):
            assert found == version.TESTED_SGLANG, f"{path.name} names sglang {found}"


_PARSE = textwrap.dedent(
    """
    import importlib.metadata as md, sys
    real = md.version
    md.version = lambda name: "0.6.1" if name == "sglang" else real(name)
    from sglang.srt.plugins import load_plugins
    load_plugins()
    from sglang.srt.server_args import prepare_server_args
    args = prepare_server_args(["--model-path", "dummy", *sys.argv[1:]])
    print("parsed", args._memx_config["elastic_kv"])
    """
)


def _parse_on_unsupported(*flags):
    return subprocess.run([sys.executable, "-c", _PARSE, *flags], capture_output=True, text=True, timeout=300,
                          cwd=REPO)  # fmt: skip


def test_a_memx_feature_on_an_unsupported_sglang_exits_2_naming_both_versions():
    run = _parse_on_unsupported("--memx-elastic-kv")
    assert run.returncode == 2, run.stdout + run.stderr
    assert "argument --memx-elastic-kv" in run.stderr and "0.6.1" in run.stderr
    assert version.SUPPORTED_SGLANG in run.stderr


def test_without_memx_features_an_unsupported_sglang_still_parses():
    run = _parse_on_unsupported()
    assert run.returncode == 0, run.stderr
    assert "parsed False" in run.stdout
    assert "outside the supported range" in run.stderr
