"""What launch/run.py does once its flags are defined: the flags parsed (a bad flag or config key
is one `error:` line and exit 2), the config loaded and checked, the run, its results table, and
every failure turned into one error line, an exit code and, where the docstring of launch/run.py
says so, an error log.

    parse_flags   absl's parser for app.run: a method of one's own loaded first, errors in a line
    main          app.run's main: reads --config, --workdir, --traceback and --compilation_cache
                  (flags.FLAGS, defined by launch/run.py), runs, prints, exits

Its signal handling before the imports is launch/run.py's first lines and olora_jax.signal_watch.
"""

import contextlib
import linecache
import logging as py_logging
import os
import re
import sys
import tempfile
import threading
import time
import traceback

import jax
from absl import flags, logging

from configs import common
from olora_jax import (
    compute,
    distributed,
    errors,
    loggers,
    methods,
    models,
    run_control,
    signal_watch,
    trainer,
    validation,
)


def _reason(text: str) -> str:
  """The informative line of a library's error text: the last line of an embedded traceback
  (the exception itself), else the first line that is not a heading ending with ':'."""
  lines = [line.strip() for line in text.splitlines() if line.strip()]
  if any(line.startswith("Traceback (most recent call last)") for line in lines):
    return lines[-1]
  informative = [line for line in lines if not line.endswith(":")]
  return (informative or lines or ["(no message)"])[0]


def _fail(message: str, code: int, every_process: bool = False) -> None:
  """Prints the one error line last and exits at once: background threads of the libraries
  (orbax's writers after a failed save) must not print their own noise after it. With
  --traceback, the traceback of the exception being handled (if any) comes first, whatever the
  exit code, bad flags and config keys included. `every_process`: every process of a
  multi-process run stops here (`errors.RunError.every_process`), and each leaves once all have
  printed their line (`distributed.finish`; a no-op in one process)."""
  sys.stdout.flush()
  if _traceback_wanted() and sys.exc_info()[0] is not None:
    traceback.print_exc()
  print(f"error: {message}", file=sys.stderr, flush=True)
  if every_process:
    with contextlib.suppress(Exception):  # the line is out and the checkpoint written
      distributed.finish()
  _exit_now(code)


def _traceback_wanted() -> bool:
  """--traceback, read from the command line itself while the flags are being parsed."""
  if flags.FLAGS.is_parsed():
    return flags.FLAGS.traceback
  wanted = False
  for arg in sys.argv[1:]:
    if arg in ("--traceback", "--traceback=true", "--traceback=True", "--traceback=1"):
      wanted = True
    elif arg in ("--notraceback", "--traceback=false", "--traceback=False", "--traceback=0"):
      wanted = False
  return wanted


def _flag_value(argv: list[str], name: str) -> str:
  """The value of flag `name` (e.g. '--config') as given on the command line ('' if none)."""
  for i, arg in enumerate(argv):
    if arg.startswith(f"{name}="):
      return arg.partition("=")[2]
    if arg == name and i + 1 < len(argv):
      return argv[i + 1]
  return ""


def parse_flags(argv: list[str]) -> list[str]:
  """absl's parser, but a bad flag or config override is one line and exit code 2. A method of
  one's own named by --config.method ('path/to/file.py:NAME') is loaded first: its config block
  then exists, and --config.<its block>.KEY overrides parse like any other key."""
  method = _flag_value(argv, "--config.method")
  if methods.is_outside(method):
    try:
      methods.resolve(method)
    except ValueError as e:  # a missing file or module, no MethodSpec there
      _fail(" ".join(str(e).split()), errors.EXIT_BAD_INPUT)
    except Exception as e:  # the method's file fails to import
      _fail(f"cannot load --config.method={method}: {errors.first_line(e)}; fix that file",
            errors.EXIT_BAD_INPUT)
    common.OUTSIDE_METHODS.append(method)
  try:
    return flags.FLAGS(argv)
  except Exception as e:  # a config file that fails to load, a bad flag or override
    overrides = [a[len("--config."):].split("=")[0] for a in argv if a.startswith("--config.")]
    known = validation.flat_keys(common.get_config())
    unknown = [k for k in overrides if k not in known]
    if unknown:
      _fail(validation.unknown_keys_message(unknown, known), errors.EXIT_BAD_INPUT)
    _fail(_config_file_unknown_key(e, known)
          or f"{_reason(str(e))}; fix the flag or the config file", errors.EXIT_BAD_INPUT)


# ml_collections' refusal of a key that a config file sets on the locked config.
_LOCKED_KEY = re.compile(r'Key "([^"]+)" does not exist and cannot be added since the config is'
                         r" locked")
# The key a config file's line sets: `config.learner.learning_rat = ...` or
# `config["learner"]["learning_rat"] = ...`.
_ASSIGNED = re.compile(r"^\s*([A-Za-z_]\w*(?:\.\w+|\[\s*['\"]\w+['\"]\s*\])+)\s*=[^=]")


def _config_file_unknown_key(e: BaseException, known: set[str]) -> str | None:
  """The line for a key that a config file sets but the config does not have (ml_collections
  refuses it with its whole block printed), naming the key, the file's line and the nearest
  known keys; None for any other error."""
  for x in errors.causes(e):
    found = _LOCKED_KEY.search(str(x))
    if found is None:
      continue
    key, (_, where) = found.group(1), errors.code_origin(x)
    if where is not None:
      path, _, line = where.rpartition(":")
      assigned = _ASSIGNED.match(linecache.getline(path, int(line)))
      if assigned:  # the dotted path below the config's own name
        names = re.sub(r"\[\s*['\"](\w+)['\"]\s*\]", r".\1", assigned.group(1)).split(".")[1:]
        dotted = ".".join(names)
        if names and names[-1] == key and any(k.startswith(dotted.rpartition(".")[0] + ".")
                                              for k in known):
          key = dotted
    return validation.unknown_keys_message([key], known, f"set at {where}" if where else "")
  return None


def _load_config():
  """The config file is loaded lazily by ml_collections: its errors surface here."""
  path = _flag_value(sys.argv[1:], "--config")
  try:
    config = flags.FLAGS.config
    config.keys()  # a config that failed to load is a proxy that raises on first use
    return config
  except Exception as e:
    file_name = path.split(":")[0]
    if not os.path.isfile(file_name):
      raise errors.BadInput(f"config file {file_name!r} does not exist; check the --config path"
                            " (settings are in configs/)") from e
    unknown = _config_file_unknown_key(e, validation.flat_keys(common.get_config()))
    raise errors.BadInput(unknown or f"cannot load --config={path}: {_reason(str(e))}") from e


def _warn_unread_overrides(method: str) -> None:
  """One warning line for --config overrides of another method's block, which this run's method
  never reads (e.g. --config.method=er --config.inflora.learning_rate=1e-2)."""
  keys = [a[len("--config."):].partition("=")[0] for a in sys.argv[1:]
          if a.startswith("--config.")]
  unread = methods.unread_overrides(method, keys)
  if unread:
    blocks = ", ".join(sorted({k.split(".")[0] for k in unread}))
    py_logging.warning("method=%s does not read the %s block: %s change%s nothing (it reads"
                       " --config.%s.*)", method, blocks,
                       " ".join(f"--config.{k}" for k in unread),
                       "s" if len(unread) == 1 else "", methods.resolve(method).block)


def _refuse_preset_size_overrides(name: str) -> None:
  """A size key given on the command line for a preset that sizes itself (e.g.
  --config.model.window_size=4 with model.name=swin_t) would change nothing: refused in one
  line."""
  if name == models.resnet.NAME:  # fixed sizes, none of the size keys
    given = [a[len("--config.model."):].partition("=")[0] for a in sys.argv[1:]
             if a.startswith("--config.model.")]
    ignored = [key for key in given if key in models.SIZE_KEYS]
    if ignored:
      raise errors.BadInput(
          f"model.name={name!r} has fixed sizes (20 initial filters, 2-2-2-2 BasicBlocks): "
          + ", ".join(f"--config.model.{k}" for k in ignored) + " would change nothing; drop"
          " it (model.image_size sets its input size)")
    return
  preset = models.preset_sizes(name)
  if preset is None:
    return
  custom, sizes = preset
  given = [a[len("--config.model."):].partition("=")[0] for a in sys.argv[1:]
           if a.startswith("--config.model.")]
  ignored = [key for key in given if key in sizes]
  if ignored:
    raise errors.BadInput(
        f"model.name={name!r} is a preset with its own sizes: "
        + ", ".join(f"--config.model.{k} would change nothing (the preset's is {sizes[k]})"
                    for k in ignored)
        + f"; drop it, or use model.name={custom!r} and give its sizes ("
        + ", ".join(f"model.{k}" for k in sizes) + ")")


def _write_error_log(workdir: str) -> str:
  """Writes the current exception's traceback to DIR/error.log, or to a temp file when DIR
  cannot be written; returns where, for the error line (empty if nothing could be written)."""
  text = f"{time.strftime('%Y-%m-%d %H:%M:%S %Z')} pid {os.getpid()}\n{traceback.format_exc()}\n"
  if _BACKGROUND_ERRORS:
    text += "errors raised in library threads meanwhile:\n" + "\n".join(_BACKGROUND_ERRORS)
  candidates = [os.path.join(workdir, "error.log")] if os.path.isdir(workdir) else []
  candidates.append(os.path.join(tempfile.gettempdir(), f"olora_jax-error-{os.getpid()}.log"))
  for path in candidates:
    before = os.path.getsize(path) if os.path.isfile(path) else None
    try:
      with open(path, "a") as f:
        f.write(text)
      return f"traceback in {path}"
    except OSError:  # e.g. the file-size limit that stopped the run: keep what was written
      after = os.path.getsize(path) if os.path.isfile(path) else None
      if after is not None and after > (before or 0):  # part of this traceback is there
        return f"traceback, cut short, in {path}"
      if before is None and after == 0:  # made empty by this attempt (a full disk)
        with contextlib.suppress(OSError):
          os.remove(path)
      # else a read-only DIR, or an older run's log: this traceback goes to the next candidate
  return ""


# Tracebacks that library threads print on their own (orbax's and tensorstore's callbacks after a
# failed save) are kept for the error log instead of being printed over the one error line.
_BACKGROUND_ERRORS: list[str] = []


def _keep_background_error(*args) -> None:
  if len(args) == 1:  # threading.excepthook / sys.unraisablehook: one record
    record = args[0]
    args = (record.exc_type, record.exc_value, record.exc_traceback)
  _BACKGROUND_ERRORS.append("".join(traceback.format_exception(*args)))


def main(argv):
  signal_watch.STARTED[0] = True
  if len(argv) > 1:
    _fail(f"unexpected arguments: {argv[1:]}; give every setting as --config.KEY=VALUE",
          errors.EXIT_BAD_INPUT)
  # Libraries log through absl (orbax: every save at INFO, and each failure of a save at length
  # before raising it): the run's own warnings go through Python's root logger and the one error
  # line says what failed.
  logging.get_absl_logger().setLevel(py_logging.CRITICAL)
  py_logging.getLogger().setLevel(py_logging.WARNING)
  sys.excepthook = threading.excepthook = sys.unraisablehook = _keep_background_error
  # Before JAX's backend starts: each step's temporary buffer is reused, not page-faulted anew.
  compute.keep_host_memory()
  workdir = flags.FLAGS.workdir
  if flags.FLAGS.compilation_cache != "off":
    compute.enable_compilation_cache(compute.default_cache_dir()
                                     if flags.FLAGS.compilation_cache == "auto"
                                     else flags.FLAGS.compilation_cache)
  try:
    run_control.stop_if_signalled()  # nothing is written yet
    config = _load_config()
    validation.check_known_keys(config, common.get_config())
    _warn_unread_overrides(config.method)
    _refuse_preset_size_overrides(config.model.name)
    results = trainer.train_and_evaluate(config, workdir)
  except Exception as e:
    write_log, every_process = True, False
    if isinstance(e, errors.RunError):
      code, message, write_log = e.exit_code, str(e), e.write_log
      every_process = e.every_process
    elif errors.out_of_memory(e):  # while the data or the model were set up
      code = errors.EXIT_ENVIRONMENT
      message = (f"the machine ran out of memory while the run was set up"
                 f" ({errors.first_line(e)[:200]}); {errors.OOM_ADVICE}")
    elif isinstance(e, (ValueError, FileNotFoundError, ModuleNotFoundError)):
      # The run phase wraps its own errors (trainer.train_and_evaluate): a plain one is from
      # the checks before any compute, which write nothing.
      code, message, write_log = errors.EXIT_BAD_INPUT, str(e), False
    else:
      code = errors.EXIT_INTERNAL
      message = errors.unexpected(e)  # olora_jax's bug, or the file of the user's own code
    if write_log:
      where = _write_error_log(workdir)
      if where:
        message += f" ({where})"
    _fail(" ".join(message.split()), code, every_process)
  if jax.process_index() == 0:  # one table for a run over many processes
    # The traceback of an earlier failure of this run, which has now finished: not left behind.
    with contextlib.suppress(OSError):
      os.remove(os.path.join(workdir, "error.log"))
    sent = []
    if results.get("already_finished"):  # an upload a stop or a kill cut short: finished now
      try:
        sent = loggers.send_unsent(workdir, config)
      except errors.Preempted as e:
        _fail(str(e), e.exit_code)
    _print_results(results, config, workdir, sent)
  distributed.finish()  # with the other processes, if any, before the runtime is left behind
  _exit_now(0)


def _print_results(results: dict, config, workdir: str, sent: list[str] = ()) -> None:
  print(trainer.format_results_table(results, config))
  if results.get("already_finished"):
    print(f"\nnothing ran: {workdir} already holds this finished run (results.json written"
          f" {results['already_finished']}); pass a new --workdir to run it again")
    if sent:
      print(f"the results its {' and '.join(sent)} run had not received (an upload cut short)"
            " were sent to it now, and that run is marked finished")
  else:
    print(f"\nresults written to {workdir}/results.json")


def _exit_now(code: int) -> None:
  """Ends the process without tearing the runtime down. Every file of the run is written and
  closed by now (results, plots, checkpoints, logs, the workdir lock), and the interpreter's
  teardown of XLA's thread pools, compiled programs and caches (about 0.6 s on 2 CPU cores) has
  nothing left to keep."""
  sys.stdout.flush()
  sys.stderr.flush()
  py_logging.shutdown()
  os._exit(code)
