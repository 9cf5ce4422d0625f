"""Test set-up: without a GPU the Triton kernels run in Triton's CPU interpreter, which must be
switched on before triton is imported."""
import os
import zlib

import torch

if not torch.cuda.is_available():
    os.environ.setdefault("TRITON_INTERPRET", "1")

import numpy as np  # noqa: E402
import pytest  # noqa: E402
from hypothesis import settings  # noqa: E402

settings.register_profile("ci", max_examples=25, deadline=None, derandomize=True)
settings.register_profile("dev", max_examples=60, deadline=None)
settings.load_profile(os.environ.get("HYPOTHESIS_PROFILE", "ci"))


@pytest.fixture
def rng(request):
    """A fresh, per-test seeded generator: reproducible across runs and processes (``hash`` of a
    str is salted per process), different for every test. ``TREEATTN_TEST_SEED`` shifts every
    seed, to run the random cases on other inputs."""
    seed = zlib.crc32(request.node.nodeid.encode()) ^ int(os.environ.get("TREEATTN_TEST_SEED", "0"))
    return np.random.default_rng(seed)


@pytest.fixture
def device():
    return torch.device("cuda" if torch.cuda.is_available() else "cpu")


@pytest.fixture(scope="module")
def one_thread():
    """Tiny matmuls on several threads of a busy 2-core machine are 100x slower than on one."""
    before = torch.get_num_threads()
    torch.set_num_threads(1)
    yield
    torch.set_num_threads(before)
