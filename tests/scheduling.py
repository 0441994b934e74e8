"""How pytest-xdist hands out the tests under -n (conftest.pytest_xdist_make_scheduler): its load
distribution, except that the tests of ONE_WORKER_FILES are one unit, which one worker runs one
after another while the other tests go one at a time to whichever worker is free.

test_slurm.py's tests share one single-node SLURM with 2 CPUs: two of them at once would wait
on each other's cells for the CPUs, and each one's waits would depend on which ran beside which.
Their unit, the largest, is handed out first. xdist's own `--dist loadgroup` would group them
too, but it renames the items through an attribute that pytest 9 no longer reads. An explicit
`--dist` other than `load` is left to xdist."""

from __future__ import annotations

ONE_WORKER_FILES = ("test_slurm.py",)


def unit(nodeid: str) -> str:
  """The unit a test is handed out in: its file for ONE_WORKER_FILES, else the test itself."""
  file = nodeid.split("::")[0].rsplit("/", 1)[-1]
  return file if file in ONE_WORKER_FILES else nodeid


def make_scheduler(config, log):
  if config.getvalue("dist") != "load":
    return None
  from xdist.scheduler import LoadScopeScheduling

  class OneWorkerForSomeFiles(LoadScopeScheduling):
    def _split_scope(self, nodeid: str) -> str:
      return unit(nodeid)

  return OneWorkerForSomeFiles(config, log)
