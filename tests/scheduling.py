"""How pytest-xdist hands out the tests under -n (conftest.pytest_xdist_make_scheduler): its load
distribution, except that the tests of ONE_WORKER_FILES all go to one worker, which runs
them one after another behind its first chunk, while the rest goes out as xdist's load
distribution sends it (contiguous chunks, so that a module's fixtures are mostly made once).

test_slurm.py's tests share one single-node SLURM with 2 CPUs: two of them at once would wait
on each other's cells for the CPUs, and each one's waits would depend on which ran beside which.
xdist's own `--dist loadgroup` would group them too, but it renames the items through an
attribute that pytest 9 no longer reads. An explicit `--dist` other than `load` is left to
xdist."""

from __future__ import annotations

ONE_WORKER_FILES = ("test_slurm.py",)


def on_one_worker(nodeid: str) -> bool:
  """Whether the test is one of ONE_WORKER_FILES'."""
  return nodeid.split("::")[0].rsplit("/", 1)[-1] in ONE_WORKER_FILES


def make_scheduler(config, log):
  """The scheduler for pytest_xdist_make_scheduler; None (xdist's own) unless --dist is load."""
  if config.getvalue("dist") != "load":
    return None
  from xdist.scheduler import LoadScheduling

  class LoadWithOneWorkerFiles(LoadScheduling):
    def schedule(self) -> None:
      first = self.collection is None
      super().schedule()  # the first chunk of each worker, in collection order
      if not (first and self.collection and self.pending and self.nodes):
        return
      grouped = [i for i in self.pending if on_one_worker(self.collection[i])]
      if grouped:
        taken = set(grouped)
        self.pending[:] = [i for i in self.pending if i not in taken]
        node = self.nodes[0]
        self.node2pending[node].extend(grouped)
        node.send_runtest_some(grouped)

  return LoadWithOneWorkerFiles(config, log)
