#!/usr/bin/env python3
"""Runs clang-tidy over the translation units whose input changed since its last clean run.

    scripts/tidy_changed.py BUILD_DIR CACHE JOBS < FILES   (NUL-separated paths)

A translation unit's key is the SHA-256 of what decides clang-tidy's verdict on the project's
code: the clang-tidy version (not the host CPU it also names, so that machines of other CPUs
agree), `.clang-tidy`, the extra arguments, the unit's compile flags, and the contents of the unit
and of every header of the project it includes (`clang++ -MM` with the unit's own compile
command: system and third-party headers left out, so that a machine whose packages are newer
point releases agrees; the checkout's path replaced so that clones anywhere agree). CACHE
(committed, `.ci/clang-tidy-passed`) lists `path key` for every unit of the last clean run; a unit
whose key is listed passed clang-tidy with exactly this input and is not checked again. The
others go to run-clang-tidy; when it passes, CACHE is rewritten with every unit's key, so a clean
run leaves it current and the next commit carries it. A unit that cannot be preprocessed is
checked, never skipped.

Exits with run-clang-tidy's status (its log in BUILD_DIR/clang-tidy.log).
"""

import concurrent.futures
import hashlib
import json
import pathlib
import re
import shlex
import subprocess
import sys

EXTRA_ARGS = ["-Wno-overlength-strings"]


def compile_commands(build: pathlib.Path) -> dict[str, list[str]]:
    entries = json.loads((build / "compile_commands.json").read_text())
    commands = {}
    for entry in entries:
        path = str(pathlib.Path(entry["directory"], entry["file"]).resolve())
        args = entry.get("arguments") or shlex.split(entry["command"])
        commands[path] = args
    return commands


def depend_args(args: list[str], path: str) -> tuple[list[str], list[str]]:
    """The unit's compile command as a clang++ -MM to stdout (the headers it includes, system
    headers left out), and the flags that decide how it compiles."""
    out = ["clang++", "-MM", "-Wno-unknown-warning-option"]
    flags = []
    skip = False
    for arg in args[1:]:
        if skip:
            skip = False
            continue
        if arg in ("-o", "-MF", "-MT", "-MQ"):
            skip = True
            continue
        if arg in ("-c", "-MD", "-MMD") or arg == path:
            continue
        out.append(arg)
        flags.append(arg)
    return out + EXTRA_ARGS + [path], flags


def unit_key(root: str, salt: bytes, args: list[str], path: str, cwd: str) -> str | None:
    command, flags = depend_args(args, path)
    run = subprocess.run(command, cwd=cwd, capture_output=True, text=True)
    if run.returncode != 0:
        return None
    rule = run.stdout.replace("\\\n", " ")
    deps = sorted({str(pathlib.Path(cwd, d).resolve())
                   for d in rule.partition(":")[2].split()})
    h = hashlib.sha256(salt)
    h.update(" ".join(flags).replace(root, "@ROOT@").encode() + b"\0")
    for dep in deps:
        try:
            contents = pathlib.Path(dep).read_bytes()
        except OSError:
            return None
        h.update(dep.replace(root, "@ROOT@").encode() + b"\0" + contents + b"\0")
    return h.hexdigest()


def main() -> int:
    build, cache, jobs = pathlib.Path(sys.argv[1]).resolve(), pathlib.Path(sys.argv[2]), sys.argv[3]
    files = [str(pathlib.Path(f).resolve()) for f in sys.stdin.read().split("\0") if f]
    root = str(pathlib.Path(__file__).resolve().parents[1])
    # Its version, without the line naming the machine's CPU ("Host CPU: znver3").
    version = b"".join(line for line in subprocess.run(
        ["clang-tidy", "--version"], capture_output=True, check=True).stdout.splitlines(True)
        if b"Host CPU" not in line)
    salt = version + pathlib.Path(root, ".clang-tidy").read_bytes() + " ".join(EXTRA_ARGS).encode()
    commands = compile_commands(build)
    # As run-clang-tidy itself does, a file the build does not compile (the MPI runner without
    # MPI) is not checked.
    files = [f for f in files if f in commands]

    def key_of(f: str) -> str | None:
        return unit_key(root, salt, commands[f], f, str(build))

    with concurrent.futures.ThreadPoolExecutor(max_workers=int(jobs)) as pool:
        keys = dict(zip(files, pool.map(key_of, files)))
    passed = {}
    if cache.exists():
        for line in cache.read_text().splitlines():
            name, _, key = line.partition(" ")
            passed[name] = key

    def rel(f: str) -> str:
        return str(pathlib.Path(f).relative_to(root))

    todo = [f for f in files if keys[f] is None or passed.get(rel(f)) != keys[f]]
    print(f"clang-tidy: {len(todo)} of {len(files)} units changed since its last clean run")
    status = 0
    if todo:
        log = build / "clang-tidy.log"
        with open(log, "wb") as out:
            status = subprocess.run(
                ["run-clang-tidy", "-p", str(build), "-j", jobs, "-quiet"]
                + [f"-extra-arg={a}" for a in EXTRA_ARGS]
                + ["^" + re.escape(f) + "$" for f in todo],
                stdout=out,
                stderr=subprocess.STDOUT,
            ).returncode
    if status == 0:
        lines = sorted(f"{rel(f)} {k}" for f, k in keys.items() if k is not None)
        text = "\n".join(lines) + "\n"
        if not cache.exists() or cache.read_text() != text:
            cache.write_text(text)
    return status


if __name__ == "__main__":
    sys.exit(main())
