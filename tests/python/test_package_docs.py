"""docs/python.md runs as written, and a typed user program passes mypy --strict."""

import os
import re
import subprocess
import sys

from conftest import BUILD, REPO


def test_the_python_tour_runs(tmp_path):
    text = (REPO / "docs" / "python.md").read_text()
    code = "\n".join(re.findall(r"```python\n(.*?)```", text, re.S))
    assert "reshard.transfer" in code and "reshard.checkpoint.gather" in code
    script = tmp_path / "tour.py"
    script.write_text(code)
    r = subprocess.run([sys.executable, str(script)], capture_output=True, text=True, cwd=tmp_path,
                       env={**os.environ, "PYTHONPATH": str(BUILD / "python")}, timeout=120)
    assert r.returncode == 0, r.stderr
    assert "INVALID_ARGUMENT" in r.stdout and "4 [1, 2, 4]" in r.stdout


def test_a_typed_program_passes_mypy_strict():
    example = REPO / "tests" / "package" / "typed_example.py"
    assert (BUILD / "python" / "reshard" / "py.typed").exists()
    r = subprocess.run([sys.executable, "-m", "mypy", "--strict", "--cache-dir", str(BUILD / "mypy-cache"), str(example)],
                       capture_output=True, text=True, timeout=300,
                       env={**os.environ, "MYPYPATH": str(BUILD / "python")})
    assert r.returncode == 0, r.stdout + r.stderr
    r = subprocess.run([sys.executable, str(example)], capture_output=True, text=True,
                       env={**os.environ, "PYTHONPATH": str(BUILD / "python")})
    assert r.returncode == 0 and "INVALID_ARGUMENT" in r.stdout, r.stderr
