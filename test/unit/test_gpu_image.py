"""The GPU image (docker/Dockerfile) checked as far as a machine without Docker Hub or a GPU allows
(issue 29, item 4): both Dockerfiles pass the project's lint (test/support/dockerfile_lint.py),
and a bad one fails it; the pinned base follows upstream's tag scheme and is the locked sglang;
the plugin-check stage (a small base, not upstream's image) asserts the entry point that
SGLang's plugin loader reads; scripts/gpu_check.sh finds everything it reads in the image.
"""

from __future__ import annotations

import importlib
import importlib.util
import re
from pathlib import Path

import pytest
import tomllib

from sglang_memx.upstream import version
from support.dockerfile_lint import from_images, global_args, lint, parse

REPO = Path(__file__).resolve().parents[2]
GPU_DOCKERFILE = REPO / "docker" / "Dockerfile"
IMAGE_ROOT = "/opt/sglang-memx"  # where the GPU image puts this checkout


def lock_pin(name: str) -> str:
    m = re.search(rf"^{re.escape(name)}==([^\s;]+)", (REPO / "requirements" / "lock.txt").read_text(), re.M)
    assert m, f"{name} is not pinned in requirements/lock.txt"
    return m.group(1)


# ---------------------------------------------------------------- lint


@pytest.mark.parametrize("name", ["Dockerfile", "Dockerfile.cpu"])
def test_dockerfiles_pass_the_lint(name):
    assert lint((REPO / "docker" / name).read_text(), REPO) == []


BAD_DOCKERFILE = """\
FROM python
FROM ubuntu:latest AS two
ADD https://example.com/tool.tar.gz /opt/
WORKDIR opt
RUN apt-get update && apt-get upgrade -y && apt-get install curl
RUN pip install requests && sudo ls
COPY no-such-dir /opt/x
USER root
ENTRYPOINT python3 -m app
CMD bash run.sh
"""


def test_a_bad_dockerfile_breaks_every_rule():
    problems = lint(BAD_DOCKERFILE, REPO)
    rules = {p.split(":", 1)[0] for p in problems}
    assert rules == {
        "pinned-from", "add", "workdir", "apt-get", "pip-cache", "pip-pin", "sudo",
        "copy-source", "user", "exec-form",
    }, problems  # fmt: skip
    assert sum(p.startswith("pinned-from") for p in problems) == 2  # untagged and 'latest'
    assert sum(p.startswith("apt-get") for p in problems) == 4  # upgrade, recommends, -y, lists
    assert any("'requests'" in p for p in problems)


def test_lint_accepts_stage_aliases_digests_and_a_stated_root_reason():
    text = (
        "ARG BASE=debian@sha256:" + "0" * 64 + "\n"
        "FROM ${BASE} AS build\nFROM build\n"
        "# lint-root: the tool needs raw sockets\n"
        'RUN python3 -m pip install --no-cache-dir x==1 -r req.txt ./local\nCMD ["tool"]\n'
    )
    assert lint(text) == []
    assert lint(text.replace("# lint-root: the tool needs raw sockets\n", "")) != []
    assert lint(text.replace("# lint-root: the tool needs raw sockets\n", "USER app\n")) == []


# ---------------------------------------------------------------- the pinned base's tag

# Upstream's release workflow tags lmsysorg/sglang as v<version>, with CUDA flavours
# (-cu<major><minor><patch digit>, e.g. -cu130) and -runtime variants beside it.
SGLANG_TAG = re.compile(r"^lmsysorg/sglang:v(?P<version>\d+\.\d+\.\d+)(?:-cu(?P<cuda>\d{3}))?(?:-runtime)?$")


def base_tag_problems(image: str, pinned: str) -> list[str]:
    """What is wrong with `image` as the GPU image's base, given the locked sglang `pinned`."""
    m = SGLANG_TAG.match(image)
    if not m:
        return [f"{image}: not lmsysorg/sglang:v<x.y.z>[-cu<NNN>][-runtime] (upstream's release tags)"]
    problems = []
    if m["version"] != pinned:
        problems.append(f"{image}: is sglang {m['version']}, requirements/lock.txt pins sglang=={pinned}")
    if not version.is_supported(m["version"]):
        problems.append(f"{image}: sglang {m['version']} is outside SUPPORTED_SGLANG")
    return problems


def test_the_gpu_base_follows_upstreams_tag_scheme_and_the_lock():
    image = global_args(parse(GPU_DOCKERFILE.read_text()))["SGLANG_IMAGE"]
    assert base_tag_problems(image, lock_pin("sglang")) == []
    assert lock_pin("sglang") == version.TESTED_SGLANG


@pytest.mark.parametrize(
    ("image", "named"),
    [
        ("lmsysorg/sglang:v0.5.22", "pins sglang==0.5.23"),
        ("lmsysorg/sglang:latest", "not lmsysorg/sglang:v"),
        ("lmsysorg/sglang:v0.5.23-cu13", "not lmsysorg/sglang:v"),
        ("nvidia/cuda:12.8.0-cudnn-runtime-ubuntu22.04", "not lmsysorg/sglang:v"),
    ],
)
def test_a_wrong_base_tag_is_named(image, named):
    problems = base_tag_problems(image, "0.5.23")
    assert problems and named in problems[0], problems


def test_cuda_flavours_and_runtime_variants_are_accepted():
    for tag in ("v0.5.23-cu130", "v0.5.23-runtime", "v0.5.23-cu126-runtime"):
        assert base_tag_problems(f"lmsysorg/sglang:{tag}", "0.5.23") == []


# ---------------------------------------------------------------- the plugin's entry point


def upstream_plugin_group() -> str:
    """The entry-point group upstream's general plugin loader reads (from its installed source)."""
    spec = importlib.util.find_spec("sglang")
    assert spec and spec.origin, "sglang is not installed"
    source = (Path(spec.origin).parent / "srt" / "plugins" / "__init__.py").read_text()
    m = re.search(r'^GENERAL_PLUGINS_GROUP\s*=\s*"([^"]+)"', source, re.M)
    assert m, "upstream's plugin loader no longer names GENERAL_PLUGINS_GROUP"
    return m.group(1)


def test_our_entry_point_is_in_the_group_upstreams_loader_reads():
    eps = tomllib.loads((REPO / "pyproject.toml").read_text())["project"]["entry-points"]
    group = upstream_plugin_group()
    assert group in eps, f"pyproject.toml declares {sorted(eps)}, upstream loads {group!r}"
    assert eps[group] == {"memx": "sglang_memx.plugin:load"}
    module, _, attr = eps[group]["memx"].partition(":")
    assert callable(getattr(importlib.import_module(module), attr))


def test_the_plugin_check_stage_needs_no_base_image_and_asserts_that_entry_point():
    instrs = parse(GPU_DOCKERFILE.read_text())
    stages = from_images(instrs)
    check_at = [alias for _, alias in stages].index("plugin-check") + 1
    base = stages[check_at - 1][0]
    assert not base.startswith("lmsysorg/"), f"the plugin check must not need upstream's image: {base}"
    assert re.match(r"python:3\.11-", base), "the lock's Python (3.11)"
    runs = " ".join(i.rest for i in instrs if i.word == "RUN" and i.stage == check_at)
    assert "pip install --no-cache-dir --no-deps /opt/sglang-memx" in runs
    eps = tomllib.loads((REPO / "pyproject.toml").read_text())["project"]["entry-points"]
    group = upstream_plugin_group()
    assert f"group='{group}'" in runs
    assert "{'memx': '" + eps[group]["memx"] + "'}" in runs


# ---------------------------------------------------------------- gpu_check.sh in the image


def image_paths() -> dict[str, str]:
    """Destination -> source of every COPY of the image's (last) stage."""
    instrs = parse(GPU_DOCKERFILE.read_text())
    last = max(i.stage for i in instrs)
    layout: dict[str, str] = {}
    for ins in instrs:
        if ins.word == "COPY" and ins.stage == last:
            *sources, dest = [w for w in ins.rest.split() if not w.startswith("--")]
            for src in sources:
                layout[dest.rstrip("/") + "/" + src if dest.endswith("/") else dest] = src
    return layout


def gpu_check_reads() -> list[str]:
    """Every repository path scripts/gpu_check.sh reads (relative to the checkout it cds to)."""
    text = (REPO / "scripts" / "gpu_check.sh").read_text()
    suite = re.search(r"FAKE_SUITE=\(([^)]*)\)", text)
    assert suite, "gpu_check.sh names its fake-driver suite"
    benches = re.search(r'for bench in ((?:"[^"]*"\s*)+); do', text)
    assert benches, "gpu_check.sh names its micro benchmarks"
    scripts = ["benchmark/micro/" + b.split()[0] for b in re.findall(r'"([^"]*)"', benches.group(1))]
    reports = re.findall(r"\b(benchmark/\w+\.py)\b", text)
    assert "test/gpu" in text and reports
    return ["scripts/gpu_check.sh", *suite.group(1).split(), "test/gpu", *scripts, *reports, "test/conftest.py",
            "test/support", "python/sglang_memx", "memory_ext"]  # fmt: skip


def test_gpu_check_finds_everything_it_reads_in_the_image():
    layout = image_paths()
    ignored = (REPO / ".dockerignore").read_text().split()
    for path in gpu_check_reads():
        assert (REPO / path).exists(), f"gpu_check.sh reads {path}, which is not in the repository"
        dest = f"{IMAGE_ROOT}/{path}"
        assert any(dest == d or dest.startswith(d + "/") for d in layout), f"{path} is not at {dest} in the image"
        dropped = [i for i in ignored if path == i or path.startswith(i.rstrip("/") + "/")]
        assert not dropped, f".dockerignore drops {path}"
    for dest, src in layout.items():  # the image keeps the checkout's layout (gpu_check.sh cds to its root)
        assert dest == f"{IMAGE_ROOT}/{src}", (dest, src)


def test_gpu_check_uses_the_images_python_and_pytest_is_the_locks():
    text = (REPO / "scripts" / "gpu_check.sh").read_text()
    assert "PY=${MEMX_PY:-$(scripts/env.sh)}" in text, "MEMX_PY skips the environment build"
    instrs = parse(GPU_DOCKERFILE.read_text())
    last = max(i.stage for i in instrs)
    envs = [i.rest for i in instrs if i.word == "ENV" and i.stage == last]
    assert "MEMX_PY=python3" in envs, "the image runs gpu_check.sh with upstream's python3"
    runs = " ".join(i.rest for i in instrs if i.word == "RUN" and i.stage == last)
    for name in ("pytest", "pytest-timeout"):
        assert f"{name}=={lock_pin(name)}" in runs, f"{name} in the image is not the lock's {lock_pin(name)}"
