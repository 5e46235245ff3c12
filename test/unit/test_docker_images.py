"""The Docker images' promises, checked without Docker (docker/, issue 18).

The GPU image is upstream's image of the pinned release plus the plugin and nothing else
that changes how a container starts; the CPU image puts the locked environment on PATH and
installs it in layers that a source change does not invalidate; docker/test_images.sh is a
valid, executable script. Building and running the CPU image is ``test_images_script``,
which needs a Docker engine and an explicit opt-in (it builds a ~11 GB image).
"""

from __future__ import annotations

import os
import re
import shutil
import subprocess
from pathlib import Path

import pytest

from sglang_memx.upstream import version
from support import dockerfile_lint

REPO = Path(__file__).resolve().parents[2]
DOCKER = REPO / "docker"
SCRIPT = DOCKER / "test_images.sh"

# Instructions that decide how a container starts; the GPU image must leave upstream's alone.
START_INSTRUCTIONS = {"ENTRYPOINT", "CMD", "WORKDIR", "USER", "SHELL"}


def instructions(path: Path) -> list[tuple[str, str]]:
    """(INSTRUCTION, arguments) of a Dockerfile: comments dropped, continuations joined
    (``support.dockerfile_lint.parse``)."""
    return [(ins.word, ins.rest) for ins in dockerfile_lint.parse(path.read_text())]


def arg_default(instrs: list[tuple[str, str]], name: str) -> str:
    for word, rest in instrs:
        if word == "ARG" and rest.startswith(name + "="):
            return rest.split("=", 1)[1].strip().strip('"')
    raise AssertionError(f"no ARG {name}=<default>")


def copy_sources(rest: str) -> list[str]:
    """The source paths of a COPY (flags such as --chown dropped; the last word is the destination)."""
    words = [w for w in rest.split() if not w.startswith("--")]
    return words[:-1]


def lock_pin(name: str) -> str:
    m = re.search(rf"^{re.escape(name)}==([^\s;]+)", (REPO / "requirements" / "lock.txt").read_text(), re.M)
    assert m, f"{name} is not pinned in requirements/lock.txt"
    return m.group(1)


# ---------------------------------------------------------------- GPU image


def test_gpu_image_is_upstreams_image_of_the_pinned_release():
    instrs = instructions(DOCKER / "Dockerfile")
    froms = [rest for word, rest in instrs if word == "FROM"]
    # The image is the last stage, on upstream's image; the only other stage is the plugin
    # check on a small base, which the image takes nothing from.
    assert froms == ["${PLUGIN_CHECK_BASE} AS plugin-check", "${SGLANG_IMAGE} AS gpu"], froms
    assert not [rest for word, rest in instrs if word == "COPY" and "--from" in rest]
    image = arg_default(instrs, "SGLANG_IMAGE")
    # Upstream tags each release lmsysorg/sglang:v<version>; the pinned one is the tested one.
    assert image == f"lmsysorg/sglang:v{version.TESTED_SGLANG}"
    assert version.TESTED_SGLANG == lock_pin("sglang")
    assert version.is_supported(version.TESTED_SGLANG)


def test_gpu_image_keeps_upstreams_entrypoint_command_and_workdir():
    instrs = instructions(DOCKER / "Dockerfile")
    changed = [(word, rest) for word, rest in instrs if word in START_INSTRUCTIONS]
    assert not changed, f"the GPU image must not change how upstream's image starts: {changed}"
    # ENV PATH (or another python) would change what `python3` means in upstream's command line.
    assert not [rest for word, rest in instrs if word == "ENV" and "PATH" in rest]


def test_gpu_image_installs_the_plugin_into_upstreams_python3():
    runs = " ".join(rest for word, rest in instructions(DOCKER / "Dockerfile") if word == "RUN")
    assert "python3 -m pip install" in runs and "--no-deps" in runs  # upstream's sglang and torch stay
    assert "require_supported" in runs  # the build fails on an image outside SUPPORTED_SGLANG
    assert "sglang.srt.plugins" in runs  # SGLang will load the plugin
    assert "sglang-memx version" in runs  # the command is on PATH


# ---------------------------------------------------------------- CPU image

# What the environment layer may depend on: a change anywhere else must not rebuild it.
ENV_LAYER_INPUTS = {"requirements", "scripts/env.sh", "pyproject.toml", "sgl-kernel/pyproject.toml"}


def env_layer_index(instrs: list[tuple[str, str]]) -> int:
    runs = [i for i, (word, rest) in enumerate(instrs) if word == "RUN" and "scripts/env.sh" in rest]
    assert runs, "Dockerfile.cpu builds the environment with scripts/env.sh (the same lock as the tests)"
    return runs[0]


def test_cpu_image_installs_dependencies_before_copying_the_source():
    instrs = instructions(DOCKER / "Dockerfile.cpu")
    env_at = env_layer_index(instrs)
    before = [src for word, rest in instrs[:env_at] if word in {"COPY", "ADD"} for src in copy_sources(rest)]
    assert before, "the lock must be copied before the environment is built"
    assert set(before) <= ENV_LAYER_INPUTS, f"only the lock and metadata before the environment layer: {before}"
    after = {src for word, rest in instrs[env_at:] if word in {"COPY", "ADD"} for src in copy_sources(rest)}
    assert {"python", "memory_ext", "sgl-kernel"} <= after, "the source is copied after the environment"
    # The environment layer's marker of the empty editable install is dropped, so that the
    # later env.sh run installs the real source.
    assert ".editable" in instrs[env_at][1]
    assert any(word == "RUN" and "scripts/env.sh" in rest for word, rest in instrs[env_at + 1 :])


def test_cpu_image_puts_the_environment_on_path_and_keeps_docker_run_commands():
    instrs = instructions(DOCKER / "Dockerfile.cpu")
    env_at = env_layer_index(instrs)
    link = re.search(r"ln -sfn \"\$env_dir\" (\S+)", instrs[env_at][1])
    assert link, "the environment gets a stable path (its real one is keyed by the lock's hash)"
    env_path = link.group(1)
    path_envs = [rest for word, rest in instrs if word == "ENV" and re.search(r"\bPATH=", rest)]
    assert path_envs and re.search(rf"\bPATH={re.escape(env_path)}/bin:\$\{{?PATH", path_envs[-1]), path_envs
    # No ENTRYPOINT: `docker run IMAGE python3 -m sglang.launch_server ...` runs that command.
    assert not [w for w, _ in instrs if w == "ENTRYPOINT"]
    assert [w for w, _ in instrs if w == "CMD"], "a default command (serve the embedded model)"


def test_cpu_image_base_matches_the_locks_python():
    instrs = instructions(DOCKER / "Dockerfile.cpu")
    assert [rest for word, rest in instrs if word == "FROM"] == ["${BASE}"]
    base = arg_default(instrs, "BASE")
    m = re.search(r"python3 -m uv pip compile .* -p (\d+\.\d+)", (REPO / "scripts" / "lock.sh").read_text())
    assert m, "scripts/lock.sh names the Python the lock is compiled for"
    assert base.startswith(f"python:{m.group(1)}-"), (base, m.group(1))


# ---------------------------------------------------------------- docker/test_images.sh


def test_images_script_is_executable_and_parses():
    assert SCRIPT.is_file()
    assert os.access(SCRIPT, os.X_OK), "docker/test_images.sh must be executable"
    mode = subprocess.run(["git", "ls-files", "-s", str(SCRIPT)], cwd=REPO, capture_output=True, text=True)
    if mode.stdout:  # committed: the mode git stores is what a fresh clone gets
        assert mode.stdout.startswith("100755"), mode.stdout
    subprocess.run(["bash", "-n", str(SCRIPT)], check=True)
    text = SCRIPT.read_text()
    assert "docker push" not in text, "images built here carry the host's CA bundle: never pushed"
    assert "Dockerfile.cpu" in text and "/memx/status" in text and "/v1/chat/completions" in text


def docker_engine() -> str | None:
    """None when the script has an engine (one answers `docker info`, or it can start its own
    dockerd as root), else why not."""
    if shutil.which("docker") is not None:
        try:
            if subprocess.run(["docker", "info"], capture_output=True, timeout=30).returncode == 0:
                return None
        except subprocess.TimeoutExpired:
            pass
    if os.geteuid() == 0 and shutil.which("dockerd") is not None:
        return None  # docker/test_images.sh starts a private dockerd
    return "no Docker engine answers `docker info`, and no dockerd this user could start"


@pytest.mark.slow
@pytest.mark.timeout(3 * 3600)
def test_images_script():
    """Build the CPU image and smoke-test it (tens of minutes; ~11 GB of image)."""
    if os.environ.get("MEMX_TEST_DOCKER_IMAGES") != "1":
        pytest.skip("builds the ~11 GB CPU image: opt in with MEMX_TEST_DOCKER_IMAGES=1 (needs a Docker engine)")
    why = docker_engine()
    if why:
        pytest.skip(why)
    subprocess.run([str(SCRIPT)], cwd=REPO, check=True)
