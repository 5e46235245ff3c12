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


# One process (upstream's import is most of its time) parses twice on an SGLang reported as 0.6.1:
# without a memx feature (it must parse), then with one (it must exit 2); a marker splits stderr.
_PARSE = textwrap.dedent(
    """
    import importlib.metadata as md, sys
    real = md.version
    md.version = lambda name: "0.6.1" if name == "sglang" else real(name)
    from sglang.srt.plugins import load_plugins
    load_plugins()
    from sglang.srt.server_args import prepare_server_args
    args = prepare_server_args(["--model-path", "dummy"])
    print("parsed", args._memx_config["elastic_kv"], flush=True)
    print("WITH A FEATURE", file=sys.stderr, flush=True)
    prepare_server_args(["--model-path", "dummy", "--memx-elastic-kv"])
    print("parsed with a feature", flush=True)
    """
)
MARKER = "WITH A FEATURE"


@pytest.fixture(scope="module")
def on_unsupported():
    """The run, and its stderr before and after the second parse began."""
    run = subprocess.run([sys.executable, "-c", _PARSE], capture_output=True, text=True, timeout=300, cwd=REPO)
    before, _, after = run.stderr.partition(MARKER)
    return run, before, after


def test_a_memx_feature_on_an_unsupported_sglang_exits_2_naming_both_versions(on_unsupported):
    run, _, after = on_unsupported
    assert run.returncode == 2, run.stdout + run.stderr
    assert "parsed with a feature" not in run.stdout
    assert "argument --memx-elastic-kv" in after and "0.6.1" in after
    assert version.SUPPORTED_SGLANG in after


def test_without_memx_features_an_unsupported_sglang_still_parses(on_unsupported):
    run, before, _ = on_unsupported
    assert "parsed False" in run.stdout, run.stderr
    assert "outside the supported range" in before
    assert "argument --memx-elastic-kv" not in before
