"""The library's messages name no command-line flag: the Python package shows the same
messages, and a caller of the library has no flags. Flags are the CLI's to add (hints such as
"add --force"), so every string literal in src/ (tests aside) is checked against every flag that
`reshard <command> --help` lists."""

import pathlib
import re
import subprocess

REPO = pathlib.Path(__file__).resolve().parents[2]
FLAG = re.compile(r"--[a-z][a-z0-9-]*")


def cli_flags(reshard_bin):
    top = subprocess.run([reshard_bin, "--help"], capture_output=True, text=True, check=True).stdout
    commands = re.findall(r"^\s{2,}([a-z][a-z-]+)\s", top.split("SUBCOMMANDS:")[-1], re.M)
    assert len(commands) >= 10, top
    flags = set()
    for command in commands:
        text = subprocess.run([reshard_bin, command, "--help"], capture_output=True, text=True).stdout
        flags |= set(FLAG.findall(text))
    return flags - {"--help"}


def strings_in(line):
    """The string literals of a line of C++, outside its // comment and character literals."""
    found, current, i = [], None, 0
    while i < len(line):
        c = line[i]
        if current is not None:
            if c == "\\":
                current += line[i:i + 2]
                i += 2
                continue
            if c == '"':
                found.append(current)
                current = None
            else:
                current += c
        elif c == "'":  # a character literal: '"' opens no string
            i = line.find("'", i + 2 if line.startswith("'\\", i) else i + 1) + 1 or len(line)
            continue
        elif c == '"':
            current = ""
        elif line.startswith("//", i):
            break
        i += 1
    return found


def literals(path):
    for number, line in enumerate(path.read_text().splitlines(), 1):
        for text in strings_in(line):
            yield number, text


def test_library_messages_name_no_flag(reshard_bin):
    flags = cli_flags(reshard_bin)
    assert {"--force", "--tp", "--to", "--target-maps"} <= flags
    found = []
    for path in sorted((REPO / "src").rglob("*")):
        if path.suffix not in (".cc", ".h") or path.name.endswith("_test.cc"):
            continue
        for number, text in literals(path):
            named = [f for f in FLAG.findall(text) if f in flags]
            if named:
                found.append(f"{path.relative_to(REPO)}:{number}: {', '.join(named)} in \"{text}\"")
    assert not found, "library messages that name CLI flags:\n" + "\n".join(found)


def test_the_check_finds_a_flag(tmp_path):
    """The scan itself: a literal naming a flag is found, a comment naming one is not."""
    source = tmp_path / "x.cc"
    source.write_text('// see --force\nreturn Error("give --target-maps \\"a\\" // here");  // --tp\n'
                      'f(\'"\', "a");  // "--world"\n')
    got = [(n, FLAG.findall(t)) for n, t in literals(source)]
    assert got == [(2, ["--target-maps"]), (3, [])]
    assert [t for _, t in literals(source)] == ['give --target-maps \\"a\\" // here', "a"]
