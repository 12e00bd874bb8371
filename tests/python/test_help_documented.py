"""What `reshard --help` offers is documented: every command has a row in the README's table of
commands, and every flag of `reshard CMD --help` appears in that command's README rows or in the
user guide's sections about the command (docs/user-guide.md)."""

import pathlib
import re
import subprocess

import pytest

ROOT = pathlib.Path(__file__).resolve().parents[2]


def help_text(reshard_bin, *args):
    r = subprocess.run([reshard_bin, *args, "--help"], capture_output=True, text=True, timeout=30)
    assert r.returncode == 0, r.stderr
    return r.stdout


def section(text, title):
    """The lines of `text` under the heading `title` ("Options:") up to the next heading."""
    lines = text.splitlines()
    start = lines.index(title) + 1
    end = next((i for i in range(start, len(lines)) if lines[i] and not lines[i][0].isspace()),
               len(lines))
    return lines[start:end]


def commands(reshard_bin):
    return [m.group(1) for line in section(help_text(reshard_bin), "Subcommands:")
            if (m := re.match(r"  ([\w-]+)\s", line))]


def flags(reshard_bin, command):
    """The flags of `reshard command --help`, --help left out, each as [its names] (-o and
    --output are one flag, documented by either)."""
    found = []
    for line in section(help_text(reshard_bin, command), "Options:"):
        m = re.match(r"  ((?:-\w,)?--[\w-]+)", line)
        if m and m.group(1) != "-h,--help":
            found.append(m.group(1).split(","))
    return found


def readme_rows(command):
    """The rows of the README's table of commands that show `reshard <command>`."""
    text = (ROOT / "README.md").read_text()
    return [line for line in text.splitlines()
            if line.startswith("| `reshard ") and f"reshard {command} " in line]


def guide_sections(command):
    """The text of every user-guide section whose heading names `command` (with its
    subsections); headings inside code blocks do not count."""
    lines = (ROOT / "docs" / "user-guide.md").read_text().splitlines()
    headings, fenced = [], False
    for i, line in enumerate(lines):
        if line.startswith("```"):
            fenced = not fenced
        elif not fenced and (m := re.match(r"(#+) (.*)", line)):
            headings.append((i, len(m.group(1)), m.group(2)))
    text = []
    for n, (i, level, title) in enumerate(headings):
        if not re.search(rf"\b{command}\b", title):
            continue
        end = next((j for j, lv, _ in headings[n + 1:] if lv <= level), len(lines))
        text.extend(lines[i:end])
    return "\n".join(text)


def test_the_cli_has_the_commands_it_is_known_by(reshard_bin):
    # The parsing below reads these; an empty list would make the other tests vacuous.
    assert {"scatter", "gather", "convert", "export", "demo"} <= set(commands(reshard_bin))
    names = {n for f in flags(reshard_bin, "convert") for n in f}
    assert {"-o", "--output", "--to", "--no-sync", "--force", "--tp"} <= names


def test_every_command_has_a_row_in_the_readme(reshard_bin):
    missing = [c for c in commands(reshard_bin) if not readme_rows(c)]
    assert missing == [], f"README.md's table of commands lacks {missing}"


def test_every_flag_of_every_command_is_documented(reshard_bin):
    undocumented = []
    for command in commands(reshard_bin):
        docs = "\n".join(readme_rows(command)) + "\n" + guide_sections(command)
        for names in flags(reshard_bin, command):
            if not any(re.search(r"(?<![\w-])" + re.escape(n) + r"(?![\w-])", docs)
                       for n in names):
                undocumented.append(f"reshard {command} {names[-1]}")
    assert undocumented == [], ("documented neither in README.md's table nor in the user "
                                f"guide's sections on the command: {undocumented}")


@pytest.mark.parametrize("mode", ["convert DS_CKPT --to universal", "--no-sync", "sync="])
def test_the_readme_names_what_the_cli_and_the_package_offer(mode):
    readme = (ROOT / "README.md").read_text()
    assert mode.split()[-1] in readme and "Later (see the issue tracker)" not in readme
