"""Smoke test of an installed reshard package, run from outside the source tree by
`scripts/dev test`: the module comes from site-packages, the CLI is on PATH and runs through
`python -m reshard`, and the package works without torch."""

import importlib.util
import os
import pathlib
import subprocess
import sys

import numpy as np

import reshard

site = pathlib.Path(reshard.__file__).resolve()
assert "site-packages" in site.parts, f"reshard imported from {site}, not an installed package"
assert importlib.util.find_spec("torch") is None, "installing reshard must not pull in torch"

m = reshard.ParamMap.from_dict({
    "logical_shape": [4, 6],
    "ranks": {str(r): {"shard_shape": [2, 6],
                       "pieces": [{"shape": [2, 6], "source": [12 * r, [6, 1]],
                                   "dest": [0, [6, 1]], "locations": [r]}]} for r in range(2)},
})
full = np.arange(24, dtype=np.float32).reshape(4, 6)
shards = [reshard.extract(m, full, r) for r in range(2)]
assert np.array_equal(reshard.rebuild(m, shards), full)
plan = reshard.compose(source=m, target=m)
assert plan.bytes_moved(np.float32) == full.nbytes

bindir = pathlib.Path(sys.executable).parent
for cmd in ([str(bindir / "reshard"), "--version"], [sys.executable, "-m", "reshard", "--version"]):
    out = subprocess.run(cmd, check=True, capture_output=True, text=True).stdout
    assert out.strip() == f"reshard {reshard.__version__}", (cmd, out)
print(f"reshard {reshard.__version__} installed at {site.parent} works ({os.getcwd()})")
