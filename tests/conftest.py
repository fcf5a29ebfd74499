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


# Figures every test process adds to (tests/hardening's fuzz tallies), summed over the processes of the
# run: the pytest-xdist workers inherit the controller's folder (set before they start).
_OWN_SHARED = "HYBRIDPAR_TEST_SHARED" not in os.environ  # removed at the end only when this run made it
SHARED = os.environ.setdefault("HYBRIDPAR_TEST_SHARED", "") or tempfile.mkdtemp(prefix="hybridpar-tests-shared-")
os.environ["HYBRIDPAR_TEST_SHARED"] = SHARED


def pytest_sessionfinish(session, exitstatus):
    shutil.rmtree(_STATE, ignore_errors=True)


# The longest modules first (`make test --durations`, 2026-12-02): with two pytest-xdist workers taking a
# module at a time (--dist loadfile: a module's fixtures are built once), the long ones start at once
# and the short ones fill in at the end, instead of one long module running alone last. An order only:
# a module missing from the list runs after these, in collection order.
HEAVY_FIRST = [
    "tests/conformance/test_hf_conformance.py", "tests/parallel/test_global_semantics.py",
    "tests/profile/test_profile_run.py", "tests/hardening/test_reliability.py",
    "tests/train/test_example_torchrun.py", "tests/parallel/test_spatial_model.py",
    "tests/hardening/test_two_nodes.py", "tests/test_readme_figures.py", "tests/hardening/test_faults.py",
    "tests/parallel/test_mp_wavefront.py", "tests/profile/test_overhead_once.py",
    "tests/train/test_train_equality.py", "tests/train/test_train_cli.py", "tests/parallel/test_mp_exported.py",
    "tests/parallel/test_sample_mixing.py", "tests/hardening/test_fuzz.py", "tests/search/placer/test_place_ilp.py",
    "tests/parallel/test_conv_dist.py", "tests/train/test_example_1f1b.py", "tests/graph/test_zoo.py",
]


def pytest_collection_modifyitems(config, items):
    rank = {path: i for i, path in enumerate(HEAVY_FIRST)}
    items.sort(key=lambda item: rank.get(item.nodeid.split("::")[0], len(rank)))  # stable: the rest keep their order


def pytest_terminal_summary(terminalreporter):
    import json
    from pathlib import Path

    counts: dict[str, int] = {}
    for f in Path(SHARED).glob("fuzz-*.json"):
        for k, v in json.loads(f.read_text()).items():
            counts[k] = counts.get(k, 0) + v
    if counts:
        terminalreporter.section("hybridpar fuzz counts")
        for k, v in sorted(counts.items()):
            terminalreporter.write_line(f"{k:<48} {v:>6}")
        total = sum(v for k, v in counts.items() if k.endswith(": rejected"))
        generated = total + sum(v for k, v in counts.items() if k.endswith(": accepted"))
        terminalreporter.write_line(f"{'generated inputs (total)':<48} {generated:>6}")
        terminalreporter.write_line(f"{'malformed inputs rejected cleanly (total)':<48} {total:>6}")


def pytest_unconfigure(config):
    if _OWN_SHARED and not hasattr(config, "workerinput"):  # the controller that made it: after the summary
        shutil.rmtree(SHARED, ignore_errors=True)
