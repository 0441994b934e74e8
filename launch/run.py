"""Runs one stream:

    .venv/bin/python launch/run.py --config configs/demo.py --workdir DIR

The learner is Online-LoRA unless `--config.method=NAME` picks a baseline (docs/methods.md).
Any config key can be overridden with `--config.KEY=VALUE` (e.g. `--config.seed=2`); the config
is locked, so a misspelt key is an error. Writes config.json, metrics.jsonl, results.json and
plots/ (plus tensorboard/ when tensorboardX is installed) and checkpoints/ into DIR and prints a
table of the results at the end. Running the same command again resumes from DIR's newest good
checkpoint (a different config is refused); on a finished DIR it says so and runs nothing. One
process at a time holds DIR (OS locks on DIR/.lock and DIR, released when the process ends;
the .lock file is removed when the run ends).
Aggregate several runs with launch/report.py.

Compiled programs are kept in JAX's persistent compilation cache (`--compilation_cache`, by
default ~/.cache/olora_jax/jax): a later run of the same shapes loads them instead of compiling,
with identical results. `--compilation_cache=off` compiles everything afresh.

Exit codes (olora_jax/errors.py); every non-zero exit ends stderr with one `error: ...` line that
names the cause and the fix. Exits 1, 3 and 4 (but a busy DIR) also write the full traceback to
DIR/error.log (or, when DIR cannot be written, to the system's temp directory; the line says
where); bad input (2), a busy DIR and signals leave no error.log, and DIR/error.log is removed
once the run finishes. `--traceback` prints the traceback to the terminal, before the line, for
every failure, bad input included:
  0    finished (or DIR already held the finished run: nothing ran, the table is reprinted)
  1    an unexpected error (a bug; please report it with error.log): the newest checkpoint is kept
  2    bad input, refused before any compute, nothing written: a missing or broken config file,
       an unknown config key, an invalid value, a missing or malformed pretrained checkpoint
       (NaN/Inf weights included), a dataset that is missing or not prepared, bad images or
       labels, a DIR that is a file, a DIR made with a different config or whose metrics.jsonl
       no longer matches its checkpoint
  3    the loss became NaN or Inf (learner.skip_nonfinite=False), or more than
       learner.max_skipped_fraction of the stream was skipped: the last good state is
       checkpointed and the message names the step; or the model a method computes for
       evaluation (its eval_state) holds NaN/Inf: the line names the key that sets it
  4    the environment failed: disk full, file-size limit, read-only or unwritable DIR, or DIR in
       use by another process (named by pid and host). The newest good checkpoint is intact:
       remove the cause and run the same command to resume
  128 + signal number (143 for SIGTERM, 130 for SIGINT): stopped by the signal after
       checkpointing the end of the current step; run the same command to resume
"""

import os
import signal
import sys

# First thing: SIGINT / SIGTERM before the run's own handlers (imports, set-up) are recorded,
# never raised inside an import or a library's callback, where an extension could swallow
# them; the run stops at its next stage with 128 + signal and one error line
# (olora_jax/run_control.py: `PENDING_SIGNALS`, `stop_if_signalled`).
_PENDING_SIGNALS: list[int] = []


def _record_signal(signum, frame) -> None:
  _PENDING_SIGNALS.append(signum)


for _signal in (signal.SIGINT, signal.SIGTERM):
  signal.signal(_signal, _record_signal)

# Config files import `configs.common`: make the repository root importable wherever we run from.
sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.realpath(__file__))))
# Before any thread starts: glibc's malloc keeps freed memory, in one arena for every thread, so
# XLA's worker threads reuse each step's large buffer instead of faulting it in afresh
# (olora_jax/allocator.py: the standard library alone; $OLORA_KEEP_HOST_MEMORY=0 turns it off).
from olora_jax import allocator  # noqa: E402

allocator.keep_host_memory()
# A signal while the main thread is held (the imports below, a long device call later) ends the
# process from a thread of its own (olora_jax/signal_watch.py imports no JAX: a few milliseconds).
from olora_jax import signal_watch  # noqa: E402

signal_watch.watch()

from absl import app, flags  # noqa: E402
from ml_collections import config_flags  # noqa: E402

from olora_jax import run_cli, run_control  # noqa: E402

run_control.PENDING_SIGNALS = _PENDING_SIGNALS  # the loop's handlers take over from here

# The flags, read by olora_jax/run_cli.py: the config, parsing, the run and its failures.
config_flags.DEFINE_config_file("config", None, "Path to a config file (configs/*.py).",
                                lock_config=True)
flags.DEFINE_string("workdir", None, "Directory for this run's outputs.")
flags.DEFINE_bool("traceback", False,
                  "On an error, also print the full traceback to stderr (it is always written to"
                  " the error log).")
flags.DEFINE_string(
    "compilation_cache", "auto",
    "Directory of JAX's persistent compilation cache, where compiled programs are kept for later"
    " runs of the same shapes: 'auto' is $JAX_COMPILATION_CACHE_DIR when set, else"
    " ~/.cache/olora_jax/jax ($XDG_CACHE_HOME respected); 'off' compiles everything afresh.")
flags.mark_flags_as_required(["config", "workdir"])

if __name__ == "__main__":
  app.run(run_cli.main, flags_parser=run_cli.parse_flags)
