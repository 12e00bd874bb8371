"""Shared fixtures: where the build is, the compiled module, the CLI binary, seeds."""

import os
import pathlib
import random
import sys
import zlib

import pytest

REPO = pathlib.Path(__file__).resolve().parents[2]
BUILD = pathlib.Path(os.environ.get("RESHARD_BUILD_DIR", REPO / "build")).resolve()
sys.path.insert(0, str(BUILD / "python"))
sys.path.insert(0, str(pathlib.Path(__file__).resolve().parent))
SHARED_DATA = pathlib.Path(os.environ.get("RESHARD_SHARED_DATA", REPO.parent / "shared" / "data"))

# DeepSpeed's training checkpoints, one factory for the whole session: a session fixture
# imported into several test modules would be made (and its checkpoints trained) once per
# module.
from ds_checkpoints import ds_checkpoint  # noqa: E402,F401
from moe_truth import moe_truth  # noqa: E402,F401


@pytest.fixture(scope="session")
def reshard_bin():
    path = BUILD / "tools" / "reshard" / "reshard"
    assert path.exists(), f"build the CLI first: {path} is missing"
    return str(path)


@pytest.fixture
def rng(request):
    """A random.Random seeded per test, repeatably: from the test's name by default,
    RESHARD_SEED=<seed> replays a logged seed, RESHARD_SEED=random explores."""
    mode = os.environ.get("RESHARD_SEED", "")
    if mode == "random":
        seed = random.SystemRandom().randrange(2**32)
    elif mode:
        seed = int(mode)
    else:
        seed = zlib.crc32(request.node.nodeid.encode())
    print(f"\nseed {seed} (replay with RESHARD_SEED={seed})")
    return random.Random(seed)
