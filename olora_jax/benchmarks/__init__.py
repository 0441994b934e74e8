"""What a run costs on this machine, and whether a borrowed device runs the project: the logic of
launch/bench.py and launch/device_check.py, as modules a notebook or a test can call.

launch/bench.py (`bench.main`, its command line)
  cases            the step cases: one method's train step per model size, fidelity and compute
                   dtype, timed against the measured matmul peak; their Markdown table
  suite            `--suite accelerator`: the peaks, the step cases, the host input path, the
                   stream and PyTorch's step, and the suite's report text
  stream           the suite's stream: Split CIFAR-100's shape through the real loop
  host             the host input path alone: pipeline and JPEG decode rates
  torch_compare    scripts/torch_step.py's step of the same ViT shapes, where PyTorch is importable
launch/device_check.py (`device_check.main`, its command line)
  device_runs      the check's budget, its parts' processes (stopped at their share), versions
  device_demo      the demo on the device beside the same run on the CPU, compared
  device_steps     the step cases of launch/bench.py, each in its own process
  device_stream    the suite's stream through launch/run.py: stopped, resumed, extrapolated
  device_report    the check's report as Markdown, and its files

Importing this package imports nothing: each module imports what it needs (the device check's
modules import JAX only inside the functions that run a part, after the check's flags are read).
"""

import pathlib

# The repository: its launch/ and scripts/ are run as processes of their own.
ROOT = pathlib.Path(__file__).resolve().parents[2]
