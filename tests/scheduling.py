"""How pytest-xdist hands out the tests under -n (conftest.pytest_xdist_make_scheduler): its load
distribution, except that the tests of ONE_WORKER_FILES all go to one worker, which runs
them one after another behind its first chunk, and each file of SAME_WORKER_FILES goes whole to
one worker (the workers in turn, from the last), while the rest goes out as xdist's load
distribution sends it (contiguous chunks, so that a module's fixtures are mostly made once).

SAME_WORKER_FILES are the checks against the authors' recordings whose tests read one
module-scoped run of ours (SCR's live seeds, Online-LoRA's replay, ...): a pytest-xdist worker
makes its own copy of a module fixture, so a file split over both workers made that run twice
(seen: SCR's live runs, 186 s and 163 s of setup on the two workers, Online-LoRA's replay 57 s and
54 s, in one `-m parity` session at a load of 4).

test_slurm.py's tests share one single-node SLURM with 2 CPUs: two of them at once would wait
on each other's cells for the CPUs, and each one's waits would depend on which ran beside which.
xdist's own `--dist loadgroup` would group them too, but it renames the items through an
attribute that pytest 9 no longer reads. An explicit `--dist` other than `load` is left to
xdist."""

from __future__ import annotations

ONE_WORKER_FILES = ("test_slurm.py",)
SAME_WORKER_FILES = ("test_parity_scr.py", "test_parity_online_lora.py", "test_parity_lode.py",
                     "test_parity_pcr.py", "test_parity_pilot.py")


def file_of(nodeid: str) -> str:
  """The test file's name of a node id."""
  return nodeid.split("::")[0].rsplit("/", 1)[-1]


def on_one_worker(nodeid: str) -> bool:
  """Whether the test is one of ONE_WORKER_FILES'."""
  return file_of(nodeid) in ONE_WORKER_FILES


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
      self.send_together([i for i in self.pending if on_one_worker(self.collection[i])],
                         self.nodes[0])
      for k, name in enumerate(SAME_WORKER_FILES):
        grouped = [i for i in self.pending if file_of(self.collection[i]) == name]
        holders = [node for node in self.nodes if any(
            file_of(self.collection[i]) == name for i in self.node2pending[node])]
        self.send_together(grouped, holders[0] if holders else self.nodes[-1 - k % len(self.nodes)])

    def send_together(self, grouped: list[int], node) -> None:
      """Takes the pending tests `grouped` out of the load distribution and sends them to `node`."""
      if grouped:
        taken = set(grouped)
        self.pending[:] = [i for i in self.pending if i not in taken]
        self.node2pending[node].extend(grouped)
        node.send_runtest_some(grouped)

  return LoadWithOneWorkerFiles(config, log)
