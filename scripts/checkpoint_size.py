"""Measures the size of an Online-LoRA checkpoint of a given backbone, storing every array (as
checkpoints did before unchanged arrays were left out) and leaving out what is unchanged since the
initial state, before and after a merge:

    .venv/bin/python scripts/checkpoint_size.py --size vit_b16 --fidelity paper

Random backbone weights (the size does not depend on them); the merge is the paper's exact merge
of a non-zero LoRA (`paper`) or the released code's factor sum (`reference`), as consolidation
does it. Prints one line per case with the bytes under the checkpoint's directory.
"""

from __future__ import annotations

import argparse
import os
import pathlib
import sys
import tempfile

sys.path.insert(0, str(pathlib.Path(__file__).resolve().parents[1]))

import jax  # noqa: E402

from olora_jax import checkpointing, trainer  # noqa: E402
from olora_jax.benchmarks import cases  # noqa: E402
from olora_jax.learner import online_lora  # noqa: E402
from olora_jax.models import lora as lora_lib  # noqa: E402


def directory_bytes(path: str) -> int:
  return sum(os.path.getsize(os.path.join(root, name))
             for root, _, names in os.walk(path) for name in names)


def main() -> None:
  parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
  parser.add_argument("--size", default="vit_b16", choices=cases.SIZES)
  parser.add_argument("--fidelity", default="paper", choices=cases.FIDELITIES)
  args = parser.parse_args()
  setup = trainer.Setup(cases.case_config(args.size, args.fidelity, "online_lora", None))
  init_key, method_key = jax.random.split(jax.random.key(0))
  params = trainer.initial_params(setup, setup.config, init_key)
  initial = trainer.initial_state(setup.method, method_key, params)
  lora = jax.tree.map(lambda x: x + 0.01, initial["state"].trainable["lora"])  # non-zero B
  factor_sum = online_lora.FROZEN_LORA in initial["frozen"]  # reference fidelity
  if factor_sum:
    frozen = {**initial["frozen"], online_lora.FROZEN_LORA: lora_lib.merge_factor_sum(
        initial["frozen"][online_lora.FROZEN_LORA], lora)}
  else:  # paper: the exact merge into the q/v kernels
    frozen = lora_lib.merge_into_backbone(initial["frozen"], lora)
  merged = {**initial, "frozen": frozen}
  progress = checkpointing.Progress.initial(1)
  meta = {"config": {}, "stream_sha256": ""}
  print(f"{args.size}, {args.fidelity} fidelity ({'factor sum' if factor_sum else 'exact merge'}):")
  with tempfile.TemporaryDirectory() as tmp:
    for name, keep_initial, state in (("every array", False, initial),
                                      ("every array, after a merge", False, merged),
                                      ("unchanged left out", True, initial),
                                      ("unchanged left out, after a merge", True, merged)):
      workdir = os.path.join(tmp, name.replace(" ", "_").replace(",", ""))
      ckpt = checkpointing.Checkpointer(workdir, 1, initial=initial if keep_initial else None)
      progress.cursor = 1
      ckpt.save(state, progress, meta)
      ckpt.close()
      size = directory_bytes(os.path.join(workdir, checkpointing.CHECKPOINT_DIR))
      print(f"  {name:36s} {size / 2**20:9.2f} MiB")


if __name__ == "__main__":
  main()
