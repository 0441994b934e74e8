"""Runs one Online-LoRA stream:

    .venv/bin/python launch/run.py --config configs/demo.py --workdir DIR

Any config key can be overridden with `--config.KEY=VALUE` (e.g. `--config.seed=2`); the config
is locked, so a misspelt key is an error. Writes config.json, metrics.jsonl, results.json and
plots/*.png (plus tensorboard/ when tensorboardX is installed) and checkpoints/ into DIR and
prints a table of the results at the end. Running the same command again resumes from DIR's newest
good checkpoint (a different config is refused). Aggregate several runs with launch/report.py.

Exit codes:
  0    finished (or DIR already held the finished run)
  2    bad input, reported in one line before any compute, nothing written: an unknown config
       key, an invalid value, a missing or malformed pretrained checkpoint, a dataset that is
       missing or not prepared, bad images or labels, a DIR made with a different config
  3    the loss became NaN or Inf (learner.skip_nonfinite=False): the last good state is
       checkpointed and the message names the step
  128 + signal number (143 for SIGTERM, 130 for SIGINT): stopped by the signal after
       checkpointing the end of the current step; run the same command to resume
"""

import pathlib
import sys

# Config files import `configs.common`: make the repository root importable wherever we run from.
sys.path.insert(0, str(pathlib.Path(__file__).resolve().parents[1]))

from absl import app, flags, logging  # noqa: E402
from ml_collections import config_flags  # noqa: E402

from configs import common  # noqa: E402
from olora_jax import checkpointing, trainer, validation  # noqa: E402

_CONFIG = config_flags.DEFINE_config_file("config", None, "Path to a config file (configs/*.py).",
                                          lock_config=True)
_WORKDIR = flags.DEFINE_string("workdir", None, "Directory for this run's outputs.")
flags.mark_flags_as_required(["config", "workdir"])

EXIT_BAD_INPUT = 2
EXIT_NONFINITE = 3


def _fail(message: str, code: int) -> None:
  print(f"error: {message}", file=sys.stderr)
  sys.exit(code)


def _parse_flags(argv: list[str]) -> list[str]:
  """absl's parser, but a bad flag or config override is one line and exit code 2."""
  try:
    return flags.FLAGS(argv)
  except flags.Error as e:
    _fail(str(e).splitlines()[0], EXIT_BAD_INPUT)
  except Exception as e:  # a config file that fails to load, or a bad override
    overrides = [a[len("--config."):].split("=")[0] for a in argv if a.startswith("--config.")]
    known = validation.flat_keys(common.get_config())
    unknown = [k for k in overrides if k not in known]
    if unknown:
      _fail(f"unknown config key(s) {', '.join(unknown)}; fix the spelling (the keys are listed"
            " in configs/common.py)", EXIT_BAD_INPUT)
    _fail(f"cannot load --config: {type(e).__name__}: {str(e).splitlines()[0]}", EXIT_BAD_INPUT)


def main(argv):
  if len(argv) > 1:
    _fail(f"unexpected arguments: {argv[1:]}", EXIT_BAD_INPUT)
  logging.set_verbosity(logging.WARNING)  # orbax and absl log every save at INFO
  try:
    validation.check_known_keys(_CONFIG.value, common.get_config())
    results = trainer.train_and_evaluate(_CONFIG.value, _WORKDIR.value)
  except (ValueError, FileNotFoundError, ModuleNotFoundError) as e:
    _fail(str(e), EXIT_BAD_INPUT)
  except checkpointing.NonFiniteLossError as e:
    _fail(str(e), EXIT_NONFINITE)
  except checkpointing.Preempted as e:
    _fail(str(e), 128 + e.signum)
  print(trainer.format_results_table(results))
  print(f"\nresults written to {_WORKDIR.value}/results.json")


if __name__ == "__main__":
  app.run(main, flags_parser=_parse_flags)
