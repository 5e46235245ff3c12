"""A small Dockerfile checker with the project's own rules (hadolint is not installed here).

``lint(text, context)`` returns one message per broken rule, each starting with the rule's id;
an empty list means the file passes. Rules (each points to a real fix):

* ``pinned-from``: every FROM names a tag or a digest (after ARG defaults), never ``latest``;
* ``apt-get``: ``apt-get install`` with ``-y`` and ``--no-install-recommends``, after an
  ``apt-get update`` and followed by ``rm -rf /var/lib/apt/lists/*`` in the same RUN; no upgrade;
* ``add``: no ADD (a remote URL is fetched unchecked; a local file wants COPY);
* ``pip-cache``: ``pip install`` with ``--no-cache-dir`` (or ``PIP_NO_CACHE_DIR=1``);
* ``pip-pin``: a package named to ``pip install`` carries ``==`` (paths and ``-r`` files aside);
* ``user``: the final stage sets a non-root USER, or the file states why it runs as root in a
  ``# lint-root: <reason>`` comment;
* ``exec-form``: ENTRYPOINT and CMD in JSON exec form (signals reach the process);
* ``workdir``: WORKDIR is absolute;
* ``sudo``: no sudo in RUN;
* ``copy-source``: with a build context, every COPY source exists in it.

Invariant: the checker reads text only; it never runs Docker.
"""

from __future__ import annotations

import json
import re
import shlex
from dataclasses import dataclass
from pathlib import Path

ROOT_REASON = re.compile(r"^#\s*lint-root:\s*(\S.*)$", re.M)


@dataclass(frozen=True)
class Instruction:
    """One instruction: upper-case keyword, its arguments (continuations joined), its stage."""

    word: str
    rest: str
    stage: int  # 0 for global ARGs before the first FROM, then 1, 2, ... per FROM


def parse(text: str) -> list[Instruction]:
    """Instructions of a Dockerfile: comments dropped, continuations joined."""
    out: list[Instruction] = []
    pending = ""
    stage = 0
    for raw in text.splitlines():
        line = raw.strip()
        if not line or line.startswith("#"):
            continue
        if line.endswith("\\"):
            pending += line[:-1] + " "
            continue
        line, pending = pending + line, ""
        word, _, rest = line.partition(" ")
        word = word.upper()
        if word == "FROM":
            stage += 1
        out.append(Instruction(word, rest.strip(), stage))
    if pending:
        raise ValueError("Dockerfile: dangling line continuation at the end")
    return out


def global_args(instrs: list[Instruction]) -> dict[str, str]:
    """ARG name=default pairs declared before the first FROM."""
    found: dict[str, str] = {}
    for ins in instrs:
        if ins.word == "ARG" and ins.stage == 0 and "=" in ins.rest:
            name, _, default = ins.rest.partition("=")
            found[name.strip()] = default.strip().strip('"')
    return found


def from_images(instrs: list[Instruction]) -> list[tuple[str, str | None]]:
    """(image after ARG defaults, stage alias or None) per FROM, in order."""
    args = global_args(instrs)
    out = []
    for ins in instrs:
        if ins.word != "FROM":
            continue
        words = [w for w in ins.rest.split() if not w.startswith("--")]
        image = re.sub(r"\$\{?(\w+)\}?", lambda m: args.get(m.group(1), m.group(0)), words[0])
        alias = words[2] if len(words) >= 3 and words[1].lower() == "as" else None
        out.append((image, alias))
    return out


def _pinned(image: str) -> bool:
    if "@sha256:" in image:
        return True
    last = image.rsplit("/", 1)[-1]
    return ":" in last and last.split(":", 1)[1] not in ("", "latest")


def _commands(run: str, program: str) -> list[list[str]]:
    """The words of each simple command in a RUN that invokes `program ...`."""
    out = []
    for part in re.split(r"&&|\|\||;|\|", run):
        try:
            words = shlex.split(part)
        except ValueError:
            words = part.split()
        for i in range(len(words) - len(program.split()) + 1):
            if words[i : i + len(program.split())] == program.split():
                out.append(words[i:])
                break
    return out


def _check_run(run: str, env_text: str) -> list[str]:
    problems = []
    if re.search(r"\bapt-get\s+(dist-)?upgrade\b", run):
        problems.append("apt-get: no apt-get upgrade in an image (pin the base instead)")
    if re.search(r"\bapt-get\b.*\binstall\b", run):
        if "--no-install-recommends" not in run:
            problems.append("apt-get: apt-get install without --no-install-recommends")
        if not re.search(r"\binstall\b[^&;]*\s-y\b|\s-y\b[^&;]*\binstall\b", run):
            problems.append("apt-get: apt-get install without -y")
        if "apt-get update" not in run:
            problems.append("apt-get: apt-get install without apt-get update in the same RUN")
        if "rm -rf /var/lib/apt/lists" not in run:
            problems.append("apt-get: the apt lists are not removed (rm -rf /var/lib/apt/lists/*) in the same RUN")
    for words in _commands(run, "pip install"):
        if "--no-cache-dir" not in words and "PIP_NO_CACHE_DIR=1" not in run + env_text:
            problems.append("pip-cache: pip install without --no-cache-dir: " + " ".join(words[:6]))
        skip_next = False
        for word in words[2:]:
            if skip_next:
                skip_next = False
                continue
            if word in ("-r", "-c", "--requirement", "--constraint", "-e", "--target", "--prefix"):
                skip_next = True
                continue
            if word.startswith(("-", "/", ".", "$")) or "==" in word or "@" in word:
                continue
            problems.append(f"pip-pin: pip install of {word!r} without a version (==)")
    if re.search(r"(^|[\s;&|])sudo\s", run):
        problems.append("sudo: RUN uses sudo (the build already runs as the stage's USER)")
    return problems


def _check_final_user(text: str, instrs: list[Instruction]) -> list[str]:
    final = max(ins.stage for ins in instrs)
    users = [ins.rest.split(":")[0] for ins in instrs if ins.word == "USER" and ins.stage == final]
    if users and users[-1] not in ("root", "0"):
        return []
    if ROOT_REASON.search(text):
        return []
    return ["user: the final stage runs as root without a stated reason (USER <name>, or # lint-root: <reason>)"]


def _check_instruction(ins: Instruction, context: Path | None) -> list[str]:
    if ins.word == "ADD":
        return [f"add: ADD {ins.rest}: use COPY (or curl with a checksum for a remote file)"]
    if ins.word in ("ENTRYPOINT", "CMD"):
        try:
            ok = isinstance(json.loads(ins.rest), list)
        except ValueError:
            ok = False
        return [] if ok else [f"exec-form: {ins.word} {ins.rest}: use the JSON exec form"]
    if ins.word == "WORKDIR" and not ins.rest.startswith(("/", "$")):
        return [f"workdir: WORKDIR {ins.rest} is not absolute"]
    if ins.word == "COPY" and context is not None and not ins.rest.startswith("--from"):
        sources = [w for w in ins.rest.split() if not w.startswith("--")][:-1]
        return [f"copy-source: COPY {s}: not in the build context" for s in sources if not (context / s).exists()]
    return []


def lint(text: str, context: Path | None = None) -> list[str]:
    """Every broken rule of the Dockerfile `text` (build context `context`, if given)."""
    instrs = parse(text)
    if not any(ins.word == "FROM" for ins in instrs):
        return ["pinned-from: no FROM"]
    problems = []
    aliases: set[str] = set()
    for image, alias in from_images(instrs):
        if image not in aliases and not _pinned(image):
            problems.append(f"pinned-from: FROM {image} is not pinned to a tag or digest (nor 'latest')")
        if alias:
            aliases.add(alias)
    env_text = " ".join(ins.rest for ins in instrs if ins.word == "ENV")
    for ins in instrs:
        problems += _check_run(ins.rest, env_text) if ins.word == "RUN" else _check_instruction(ins, context)
    return problems + _check_final_user(text, instrs)
