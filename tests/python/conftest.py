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


# The files that take longest, longest first (measured: about half of the suite's time). The
# xdist workers take files in collection order (`scripts/dev` passes --no-loadscope-reorder;
# xdist's own order is by number of tests, which put a 15-test file of Megatron training runs
# last and left the other worker idle for minutes), so these start first and the many short
# files fill the end. The third starts the shared DeepSpeed training while the other worker
# runs the second.
LONGEST_FIRST = ["test_megatron_optimizer.py", "test_megatron.py", "test_deepspeed_checkpoints.py",
                 "test_transformers_tp.py", "test_no_exception_escapes.py",
                 "test_deepspeed_frozen.py", "test_deepspeed_pipeline.py", "test_moe_reshard.py",
                 "test_dcp_resume.py", "test_deepspeed_moe.py", "test_output_safety.py",
                 "test_fleet_schedule.py"]


def pytest_collection_modifyitems(items):
    rank = {name: i for i, name in enumerate(LONGEST_FIRST)}
    items.sort(key=lambda item: rank.get(item.path.name, len(LONGEST_FIRST)))


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
