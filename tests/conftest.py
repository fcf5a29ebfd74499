import importlib.util
import os
import shutil
import tempfile

# Ranks time-share 2 cores: one intra-op thread per process keeps timings sane.
os.environ.setdefault("OMP_NUM_THREADS", "1")

# Caches and calibration live in a fresh folder per test session, so a run here behaves like CI on a
# new machine (cold graph/projection caches, no calibration file) and leaves the user's home alone.
# Set in the environment so spawned ranks and CLI subprocesses see the same folder.
_STATE = tempfile.mkdtemp(prefix="hybridpar-tests-")
os.environ["HYBRIDPAR_CACHE"] = os.path.join(_STATE, "cache")
os.environ["HYBRIDPAR_CALIBRATION"] = os.path.join(_STATE, "calibration.json")

import torch

torch.set_num_threads(1)

# The ranks of in-process spawns fork from one server per test session; Hugging Face models' shared
# base (~6 s of CPU to import) is imported there once instead of in every rank of every HF test.
if importlib.util.find_spec("transformers") is not None:
    from hybridpar.train.launch import preload

    preload("transformers.modeling_utils")


def pytest_sessionfinish(session, exitstatus):
    shutil.rmtree(_STATE, ignore_errors=True)
