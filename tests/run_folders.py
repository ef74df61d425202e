"""The folders of a test run's own, set up when this module is first imported, before torch is: tests/conftest.py
imports it first, and so does the timm plugin (tests/timm_suite/timm_plugin.py), which pytest loads before the
conftest (`-p timm_plugin`) and which imports torch."""
import os
import shutil
import tempfile

# Each test process (the xdist controller and each worker) has a temporary folder of its own under the system's,
# removed at its end: TMPDIR for it and for every process its tests start, so that what they leave there (torchrun's
# torchelastic_* folders of a killed launch, the forked-python servers' sockets) goes with the run. pytest's own
# folders (tmp_path: the last three runs kept for a look after a failure) stay in the system's.
os.environ.setdefault("PYTEST_DEBUG_TEMPROOT", tempfile.gettempdir())
TMP = tempfile.mkdtemp(prefix="tests-tmp-")
os.environ["TMPDIR"] = TMP
tempfile.tempdir = None  # found again from TMPDIR

# torch.compile's cache in a folder of this test run's own (made by the first process to import this module, the
# xdist controller, whose workers and their processes inherit it), set before torch is imported (importing torch
# sets the variable to its default, /tmp/torchinductor_<user>, which this would then keep as a user's own):
# inductor's FX graph cache key leaves out ATEN_CPU_CAPABILITY, which picks the vector ISA of the C++ it writes
# (pytorch/pytorch#123514), so code written under `avx2` was found again under `default` and failed to build
# there (`at::vec` undeclared). A user's own setting is kept.
if "TORCHINDUCTOR_CACHE_DIR" not in os.environ:
    os.environ["TORCHINDUCTOR_CACHE_DIR"] = tempfile.mkdtemp(prefix="inductor-")


def remove_at_end(config) -> None:
    """Remove this process's TMPDIR when its pytest session ends."""
    config.add_cleanup(lambda: shutil.rmtree(TMP, ignore_errors=True))
