"""The host loop: one loop for every method (olora_jax/methods), read as the paper's protocol
(`_train_and_evaluate`, a screen long):

    for each batch of the stream (seen once, no task ids):
      1. train step of the method on the batch                                  [jitted]
      2. the non-finite policy: a NaN/Inf loss checkpoints and stops, or is skipped
         (olora_jax/run_control.py)
      3. the method's host hook (Online-LoRA: loss window, plateau rule, consolidation and
         hard-buffer update, paper steps 3-5)                                   [host + jitted]
         and the boundary switch's decision (`boundaries.rule`, olora_jax/boundaries.py)
      4. its events and the step's `train` line in the run log (olora_jax/runlog.py)
      5. evaluation at anytime points and at true task ends (olora_jax/protocol.py: the
         evaluator alone knows the tasks); then, at a boundary the switch signalled, the
         method's `at_boundary`: the step's evaluations see the model that finished the task
      6. checkpoint cadence and signals (olora_jax/run_control.py)
    results.json from the protocol's records (`EvaluationProtocol.results`)

The method is picked by the `method` config key; its whole state is one pytree that the loop
checkpoints, evaluates through the method's pure `predict`, and never looks inside.

Outputs in `workdir`: config.json, stream_manifest.json (data/manifest.py), metrics.jsonl (one
event per line), results.json (every metric with its definition), plots/*.png, checkpoints/ (the
whole run state, see `olora_jax.checkpointing`) and, when tensorboardX is installed,
tensorboard/ (the `loggers` key: also a W&B or MLflow run, `olora_jax.loggers`). Running
again with the same workdir and config resumes from the newest good checkpoint, bit-exactly on
CPU.
"""

from __future__ import annotations

import contextlib
import functools
import logging
import os
import time
from collections.abc import Callable

import jax
import jax.numpy as jnp
import ml_collections
import numpy as np
import tqdm

from olora_jax import (
  background,
  checkpointing,
  distributed,
  errors,
  evaluate,
  models,
  reporting,
  run_control,
  runlog,
  sharding,
  validation,
)
from olora_jax import compute as compute_lib
from olora_jax import export as export_lib
from olora_jax import fidelity as fidelity_lib
from olora_jax import methods as methods_lib
from olora_jax import plots as plots_lib
from olora_jax import pretrained as pretrained_lib
from olora_jax import trace as trace_lib
from olora_jax import workdir as workdir_lib
from olora_jax.boundaries import BoundarySwitch
from olora_jax.data import manifest as manifest_lib
from olora_jax.data import sources as sources_lib
from olora_jax.data import streams as streams_lib
from olora_jax.data.pipeline import InputPipeline
from olora_jax.evaluate import Evaluator
from olora_jax.methods import base as methods_base
from olora_jax.methods import online_lora as online_lora_method
from olora_jax.models import build_model, spec_from_config
from olora_jax.models.swin import SwinSpec
from olora_jax.models.vit import ViTSpec, init_head
from olora_jax.protocol import EvaluationProtocol, task_il_map
from olora_jax.run_control import NonFinitePolicy, Saver, StopSignal, make_guarded_step

RUN_FILES = ("config.json", "stream_manifest.json", "metrics.jsonl", "results.json")
EXPORT_FILENAME = online_lora_method.EXPORT_FILENAME  # export_online_lora=True


class Setup:
  """Everything validated and built from the config before any compute. `self.config` is the
  config with every fidelity key resolved (olora_jax/fidelity.py)."""

  def __init__(self, config: ml_collections.ConfigDict):
    c = self.config = fidelity_lib.resolve(config)
    # A ViT's weights for a Swin (or the reverse) is said first, not as the model's sizes.
    if c.pretrained.path and os.path.isfile(c.pretrained.path) and models.family(c.model.name):
      pretrained_lib.check_backbone_kind(c.pretrained.path, c.pretrained.format,
                                         models.family(c.model.name) == "Swin")
    self.spec: ViTSpec | SwinSpec = spec_from_config(c.model)  # the backbone's static sizes
    validation.check_config(c, self.spec.width)
    for key, path in (("pretrained.path", c.pretrained.path),
                      ("learner.initial_lora", c.learner.initial_lora)):
      if path and not os.path.isfile(path):
        raise FileNotFoundError(f"{key}={path!r} does not exist; give a local checkpoint file"
                                + _fetch_hint(path))
    self.train_source, self.test_source = sources_lib.load_sources(c.data, self.spec.image_size)
    self.num_classes = self.train_source.num_classes
    export_lib.check_config(c.eval.export, c.eval.export_top_k, self.num_classes)
    for source in (self.train_source, self.test_source):
      sample_images, _ = source.get(np.arange(min(len(source), 8)))
      validation.check_source(source.labels, sample_images, self.num_classes,
                              f"data.dataset={c.data.dataset!r} ({source.split} split)")
    validation.check_class_count(self.num_classes, [self.train_source.labels,
                                                    self.test_source.labels],
                                 f"data.dataset={c.data.dataset!r}")
    self.model = build_model(c, self.spec, self.num_classes)  # a ViT or a Swin
    # From the seed, or replayed from data.stream_manifest (data/manifest.py).
    # A manifest recorded on another source re-indexes the sources to the images it names.
    self.stream, self.manifest, self.train_source, self.test_source = (
        manifest_lib.build_stream_and_manifest(c.data, c.seed, c.learner.batch_size,
                                               self.train_source, self.test_source))
    # The method's builder validates its config block before any compute.
    self.method = methods_lib.build(methods_base.Context(
        config=c, model=self.model, spec=self.spec, num_classes=self.num_classes,
        batch_size=c.learner.batch_size,
        image_shape=(self.spec.image_size, self.spec.image_size, 3),
        stream_samples=self.stream.n_samples, stream_steps=len(self.stream.steps),
        stream_step_items=tuple(len(ids) for ids in self.stream.steps)))
    # What the method's hooks return is checked before the loop uses it (its first host record
    # here, before any compute), so a mistake there is named in its own file.
    self.hook_check = methods_base.HookCheck(self.method)
    self.hook_check.init_host()
    # (A replayed manifest lists its own steps; the batch size only pads them.)
    if c.learner.batch_size > self.stream.n_samples and not c.data.stream_manifest:
      raise validation.InputError(
          f"learner.batch_size={c.learner.batch_size} is larger than the whole stream"
          f" ({self.stream.n_samples} training samples): every step would hold all of it; lower"
          " learner.batch_size")
    self.benchmark_manifest_sha256 = None  # set when the method trains on another order
    if self.method.iid_stream:  # the upper bound: the stream's samples in an i.i.d. order
      self.benchmark_manifest_sha256 = manifest_lib.manifest_sha256(self.manifest)
      self.stream = streams_lib.iid_order(self.stream, c.learner.batch_size, c.seed, c.iid.epochs)
      self.manifest = manifest_lib.stream_manifest(c.data, c.seed, c.learner.batch_size,
                                                   self.stream, self.train_source,
                                                   self.test_source)
      self.manifest["params"]["order"] = "iid"
      if c.iid.epochs > 1:  # each sample once per epoch (a replay counts repeats against it)
        self.manifest["params"]["epochs"] = c.iid.epochs
    self.mesh = sharding.make_mesh(c.sharding.fsdp)
    sharding.check_divisible(c.learner.batch_size, self.mesh, "learner.batch_size")
    sharding.check_divisible(c.eval.batch_size, self.mesh, "eval.batch_size")
    evaluate.check_predict_chunk(c.eval.predict_chunk, c.eval.batch_size, self.mesh.devices.size)
    # -1: by the backend; config.json records the value that ran.
    c.eval.predict_chunk = evaluate.resolve_predict_chunk(c.eval.predict_chunk,
                                                          c.eval.batch_size,
                                                          self.mesh.devices.size)
    # Each process prepares only its rows of every batch (all of them with one process).
    self.pipeline = InputPipeline(self.train_source, self.stream, c.learner.batch_size,
                                  self.spec.image_size, c.data.augment, c.seed, c.data.prefetch,
                                  c.data.input_scale, c.data.preprocess,
                                  sharding.local_rows(c.learner.batch_size, self.mesh))


def _fetch_hint(path: str) -> str:
  """How to get `path` when it is a benchmark preset's default checkpoint (configs/benchmark.py),
  else ''."""
  from configs import benchmark

  for preset, (_, default, _) in benchmark.BACKBONES.items():
    if os.path.basename(path) == os.path.basename(default):
      return (f", or fetch this one on a machine with network: python scripts/get_weights.py"
              f" {preset} (it writes {default})")
  return ""


def load_params(setup: Setup, config: ml_collections.ConfigDict) -> dict | None:
  """The checkpoint of pretrained.path read and placed on the device (a bad file fails here,
  before any compute), or None when the backbone is randomly initialised."""
  if not config.pretrained.path:
    if not models.is_resnet(setup.spec):  # the ResNet is always trained from scratch
      logging.warning("pretrained.path is empty: the backbone is randomly initialised")
    return None
  return pretrained_lib.load_pretrained(config.pretrained.path, setup.spec, setup.num_classes,
                                        config.pretrained.format,
                                        require_head=config.pretrained.keep_head)


def complete_params(setup: Setup, config: ml_collections.ConfigDict, key: jax.Array,
                    loaded: dict | None) -> dict:
  """The model's params (traceable): the loaded checkpoint with a fresh head from `key`, or a
  random init from `key` when nothing was loaded."""
  if loaded is None:
    size = setup.spec.image_size
    return setup.model.init(key, jnp.zeros((1, size, size, 3), jnp.float32))["params"]
  # The C-way head is created fresh for the benchmark (docs/method.md), even when the
  # checkpoint's head happens to have C outputs: the stream must teach every class. Replaying
  # another codebase's run keeps the checkpoint's head instead (pretrained.keep_head).
  if config.pretrained.keep_head:
    return loaded
  return {**loaded, "head": init_head(key, setup.spec.width, setup.num_classes)}


def initial_params(setup: Setup, config: ml_collections.ConfigDict, key: jax.Array) -> dict:
  """`complete_params` as one compiled program (an eager Flax init or head init runs every op on
  its own, each op a program)."""
  return jax.jit(functools.partial(complete_params, setup, config))(
      key, load_params(setup, config))


def seeded_init(setup: Setup, config: ml_collections.ConfigDict,
                params_given: bool = False) -> Callable:
  """`(seed, loaded) -> state`: the run's whole initial state from its seed (uint32) and
  `load_params`' result, traceable. The seed's key is split into the params' and the method's
  keys inside it, so the run's state initialisation is one compiled program (a random model on
  one device is drawn by one before it, `run_initial_state`): no eager PRNG or head-init
  programs. The values are those of the same steps run one by one:
  the params pass an optimisation barrier, so XLA cannot fuse their initialisation into the
  method's arithmetic on them (which would round last bits differently). With `params_given`,
  `loaded` is the model's whole params already (`random_params`), used as they are."""

  def init(seed, loaded):
    init_key, method_key = jax.random.split(jax.random.key(seed))
    params = loaded if params_given else complete_params(setup, config, init_key, loaded)
    return setup.method.init(method_key, jax.lax.optimization_barrier(params))

  return init


def random_init(setup: Setup, config: ml_collections.ConfigDict) -> Callable:
  """`seed -> params`: the randomly initialised model's params of `seed` (uint32), from the key
  `seeded_init` derives for them. Compiled on its own (`random_params`), it depends on the model
  alone (not the method, not the seed's value), so the persistent compilation cache shares it
  across a sweep's methods and seeds. A random init draws every weight through JAX's PRNG, whose
  program is slow to compile (a tiny ViT's 24 draws: seconds at XLA's default level); inside
  `seeded_init` it was compiled again for every method. The values are those `seeded_init`
  computes itself (the same operations, up to the same optimisation barrier)."""

  def random_model_params(seed):
    init_key, _ = jax.random.split(jax.random.key(seed))
    return complete_params(setup, config, init_key, None)

  return random_model_params


def random_params(setup: Setup, config: ml_collections.ConfigDict, seed) -> dict:
  """`random_init(setup, config)(seed)` as one compiled program of its own."""
  return jax.jit(random_init(setup, config))(seed)


def run_initial_state(setup: Setup, seed, loaded: dict | None):
  """The run's initial state (`seeded_init` of the seed and `load_params`' result) by one
  compiled program, or by two where the backbone is random on one device (`random_params` first;
  on several devices the one program builds the state where it lives, sharded)."""
  if loaded is None and setup.mesh.devices.size == 1:
    return build_state(setup.method, seeded_init(setup, setup.config, params_given=True),
                       (seed, random_params(setup, setup.config, seed)), setup.mesh)
  return build_state(setup.method, seeded_init(setup, setup.config), (seed, loaded), setup.mesh)


def initial_state(method: methods_base.Method, key: jax.Array, params: dict,
                  mesh: jax.sharding.Mesh | None = None):
  """The method's whole initial state, one pytree, built by one compiled program rather than op
  by op (fewer, larger compilations; the same values). With a mesh of several devices it is
  built where it lives (`sharding.state_shardings`): a backbone split FSDP style is never whole
  on one device."""
  return build_state(method, method.init, (key, params), mesh)


def build_state(method: methods_base.Method, init: Callable, args: tuple,
                mesh: jax.sharding.Mesh | None = None):
  """`init(*args)`, a method's state (`method.init` or `seeded_init`), by one compiled program,
  refused first when it does not fit the devices (`check_state_fits`)."""
  shapes = jax.eval_shape(init, *args)
  check_state_fits(method, shapes, mesh)
  if mesh is None or mesh.devices.size == 1:
    return jax.jit(init)(*args)
  args = sharding.replicate(args, mesh)
  return jax.jit(init, out_shardings=sharding.state_shardings(shapes, mesh))(*args)


def check_state_fits(method: methods_base.Method, shapes,
                     mesh: jax.sharding.Mesh | None = None) -> None:
  """Refuses (exit 2, before anything is computed or written) a method state (`shapes`, from
  `jax.eval_shape`) larger than the memory of the devices that hold it, naming its largest part:
  a replay buffer of a billion images is a config error, not a crash an hour later."""
  leaves = jax.tree_util.tree_flatten_with_path(shapes)[0]
  sizes = [(jax.tree_util.keystr(path), x.size * x.dtype.itemsize, x) for path, x in leaves]
  total = sum(size for _, size, _ in sizes)
  n_devices = 1 if mesh is None else mesh.devices.size  # the state at most split over them
  limit = compute_lib.device_memory_bytes()
  if limit is None or total <= limit * n_devices:
    return
  path, size, x = max(sizes, key=lambda item: item[1])
  block = "learner" if method.name == "online_lora" else method.name
  raise validation.InputError(
      f"method={method.name!r}: its state needs {total / 2**30:.1f} GiB, more than the"
      f" {limit * n_devices / 2**30:.1f} GiB the device(s) hold; its largest part is {path}"
      f" {tuple(x.shape)} {x.dtype} ({size / 2**30:.1f} GiB): lower {block}.buffer_size (or the"
      " size that sets it), or use a device with more memory")


def _check_workdir(workdir: str, config: ml_collections.ConfigDict) -> dict | None:
  """Refuses a workdir made with a different config; returns its results if it is finished."""
  workdir_lib.check_is_directory(workdir)
  config_path = os.path.join(workdir, "config.json")
  if os.path.exists(config_path):
    saved = runlog.read_json(config_path, "restore it, or pass a new --workdir")
    results_path = os.path.join(workdir, "results.json")
    finished = os.path.exists(results_path)
    # A finished run is reprinted, not run: keys that came or went with a version since it
    # was made are no difference (checkpointing.check_same_config).
    checkpointing.check_same_config(saved, config, workdir, finished=finished)
    if finished:
      return runlog.read_json(results_path, "delete it and rerun to rebuild it from the final"
                              " checkpoint")
  elif any(os.path.exists(os.path.join(workdir, f)) for f in RUN_FILES) or (
      checkpointing.has_checkpoint(workdir)):
    raise checkpointing.WorkdirError(
        f"workdir {workdir!r} holds run files but no config.json, so it cannot be checked;"
        " pass a new --workdir")
  return None


def train_and_evaluate(config: ml_collections.ConfigDict, workdir: str,
                       progress: bool = True) -> dict:
  """Runs one stream end to end and returns (and writes) the results.

  Resumes from the newest good checkpoint in `workdir` if there is one (same config only).
  Checkpoints every `checkpoint_every` steps, at the end, and on SIGTERM/SIGINT (then raises
  `errors.Preempted`). A finished workdir runs nothing: its stored results come back with
  `already_finished` (when results.json was written) added, and missing plots are redrawn.

  Every failure is an `errors.RunError` with its exit code: bad input (`BadInput`, before any
  compute and before anything is written), `NonFiniteLoss`, `EnvironmentFailure` (disk full,
  read-only or busy workdir: the newest good checkpoint is intact), `InternalError`.
  """
  compile_start = compute_lib.COMPILE_CLOCK.snapshot()  # the ledger counts this call's compiles
  # A multi-process run (olora_jax/distributed.py) is joined before any backend starts.
  distributed.initialize(config.distributed)
  checkpointing.import_in_background()  # orbax, needed at the first save or a resume
  setup = Setup(config)  # every config or data error surfaces here, before any compute or file
  run_control.stop_if_signalled()  # nothing is written yet
  config = setup.config  # fidelity keys resolved: config.json records what actually ran
  # The state's initialisation (run_initial_state): the seed and the loaded checkpoint.
  init = (np.uint32(config.seed), load_params(setup, config))  # a bad file fails here
  # A state larger than the devices is refused before the workdir (and its lock) exists.
  check_state_fits(setup.method, jax.eval_shape(seeded_init(setup, config), *init), setup.mesh)
  # A different config is refused before anything is written.
  finished = _check_workdir(workdir, config)
  if finished is not None and not os.access(workdir, os.W_OK):
    return _finished_read_only(workdir, config, finished)
  primary = sharding.is_primary()  # the process that writes the files (process 0)
  # One run per workdir, from here to the end; in a multi-process run process 0 holds the lock.
  with workdir_lib.WorkdirLock(workdir) if primary else contextlib.nullcontext():
    finished = _check_workdir(workdir, config)
    sharding.barrier("workdir checked")  # nothing is written before every process has read
    if finished is not None:
      if primary:
        _restore_finished_log(workdir)
      missing = workdir_lib.missing_plots(workdir, plots_lib.plot_files(config))
      if config.eval.write_plots and missing and primary:
        logging.warning("redrawing the missing plot(s) %s of the finished run in %s",
                        ", ".join(missing), workdir)
        _guarded(lambda: plots_lib.write_run_plots(workdir), workdir)
      return {**finished, "already_finished": workdir_lib.finished_at(workdir)}
    return _guarded(lambda: _train_and_evaluate(setup, init, workdir, progress, compile_start),
                    workdir)


def _finished_read_only(workdir: str, config: ml_collections.ConfigDict, results: dict) -> dict:
  """A finished run in a workdir that cannot be written (a read-only mount of results): its
  stored results, with no lock to take and nothing to repair; a damaged run log and what would be
  redrawn are named."""
  damage = _finished_log_damage(workdir) if sharding.is_primary() else None
  if damage:  # what a writable workdir would rebuild (`_restore_finished_log`), said
    logging.warning("the finished run's %s; %s cannot be written, so it stays so: %s", *damage)
  missing = workdir_lib.missing_plots(workdir, plots_lib.plot_files(config))
  if config.eval.write_plots and missing and sharding.is_primary():
    logging.warning("the finished run in %s lacks the plot(s) %s, which cannot be redrawn there"
                    " (it cannot be written)", workdir, ", ".join(missing))
  return {**results, "already_finished": workdir_lib.finished_at(workdir)}


def _final_record(workdir: str) -> tuple[int, dict] | None:
  """(step, host record) of a finished run's final checkpoint, or None when it has none."""
  step = checkpointing.latest_step(workdir)
  host = None if step is None else checkpointing.read_host(workdir, step)
  return None if host is None else (step, host)


def _finished_log_damage(workdir: str) -> tuple[str, str, str] | None:
  """(what differs, `workdir`, the fix) between a finished run's metrics.jsonl and what its final
  checkpoint recorded (missing, cut, edited, or lines after the end), read without changing
  anything; None when the log is intact (or there is no checkpoint to compare with)."""
  record = _final_record(workdir)
  if record is None:
    return None
  step, host = record
  p = host["progress"]
  try:
    workdir_lib.verify_run_log(workdir, p["metrics_bytes"], p.get("metrics_sha256", ""), step)
  except errors.BadInput as damage:
    found = str(damage).split(";")[0]
  else:
    path = os.path.join(workdir, "metrics.jsonl")
    extra = os.path.getsize(path) - p["metrics_bytes"] if os.path.exists(path) else 0
    if extra <= 0:
      return None
    found = f"{path} has {extra} bytes after the end of the finished run (edited?)"
  if host.get("run_log") is None:  # a checkpoint older than the log's copy
    return found, workdir, f"restore the log as it was (checkpoint {step} keeps no copy of it)"
  return found, workdir, ("make it writable and run the same command: it rebuilds the log from"
                          f" the copy checkpoint {step} keeps")


def _restore_finished_log(workdir: str) -> None:
  """A finished run's metrics.jsonl is what its final checkpoint recorded: a damaged or deleted
  log is rebuilt from the copy the checkpoint keeps, and the run says so."""
  record = _final_record(workdir)
  if record is None:
    return
  step, host = record
  p = host["progress"]
  repaired = workdir_lib.restore_run_log(workdir, p["metrics_bytes"], p.get("metrics_sha256", ""),
                                         host.get("run_log"), p["cursor"], finished=True)
  if repaired:
    logging.warning("the finished run's %s", repaired)


def _guarded(fn: Callable, workdir: str):
  """Runs `fn`, turning any failure that is not already an `errors.RunError` into one: running
  out of memory into `OutOfMemory` and storage failures (disk full, file-size limit, read-only)
  into `EnvironmentFailure` (exit 4), as is the loss of another process of a multi-process run
  (a collective whose peer is gone: the processes left stop with one line, none waits for it);
  the rest into `InternalError`. Each names the checkpoint a rerun resumes from."""
  try:
    return fn()
  except errors.RunError:
    raise
  except Exception as e:
    step = checkpointing.latest_step(workdir)
    resume = f"from checkpoint {step}" if step is not None else "from the start"
    if errors.out_of_memory(e):
      raise errors.OutOfMemory(
          f"the device ran out of memory ({errors.first_line(e)[:200]}); {errors.OOM_ADVICE};"
          f" the run can resume {resume}") from e
    cause = errors.storage_cause(e)
    if cause is not None:
      raise errors.EnvironmentFailure(
          f"cannot write to workdir {workdir!r} ({cause}); {errors.storage_advice(cause)},"
          f" then run the same command to resume {resume}") from e
    if jax.process_count() > 1 and errors.peer_lost(e):  # a collective lost its peer
      raise errors.EnvironmentFailure(
          f"another process of this {jax.process_count()}-process run died or lost contact"
          f" ({errors.first_line(e)[:160]}); its own error line (or the scheduler's log) says"
          f" why: fix that, then start every process again to resume {resume}") from e
    # A method's own error names its file (not a JAX frame); olora_jax's asks to be reported.
    raise errors.InternalError(errors.unexpected(e, resume)) from e


def _train_and_evaluate(setup: Setup, init: tuple, workdir: str,
                        progress: bool, compile_start: tuple[float, int]) -> dict:
  """The run itself, in a locked workdir whose config has been checked: the paper's protocol,
  one stream step at a time (olora_jax/protocol.py says when evaluations fall)."""
  state, p, saver, protocol, switch = _start(setup, init, workdir, compile_start)
  shardings = sharding.state_shardings(state, setup.mesh)  # where every leaf of the state lives
  # The trackers (loggers) stay open until they have the results, and are closed however the
  # run ends.
  with contextlib.closing(saver.log):
    return _train_loop(setup, workdir, progress, state, p, saver, protocol, switch, shardings)


def _train_loop(setup: Setup, workdir: str, progress: bool, state, p, saver: Saver,
                protocol: EvaluationProtocol, switch: BoundarySwitch, shardings) -> dict:
  """`_train_and_evaluate`'s loop over the stream, then results.json and the trackers' copy."""
  c, method, stream = setup.config, setup.method, setup.stream
  log, ledger = saver.log, saver.ledger
  train_step = make_guarded_step(method.train_step)
  nonfinite = NonFinitePolicy(c.learner.skip_nonfinite, c.learner.max_skipped_fraction,
                              len(stream.steps), saver, run_control.learning_rate_key(
                                  c, methods_lib.resolve(c.method).block))
  # eval.export: each task end's predictions and trained parameters (a no-op when off).
  export = export_lib.make_export(c, workdir, method, protocol.evaluator, setup.test_source,
                                  stream, lambda: protocol.log.seen_classes,
                                  protocol.eval_state)
  run_control.stop_if_signalled("while the state was built and restored")
  # XLA's estimate of the forward pass, traced while the first step compiles (the main thread
  # waits on XLA then); read after that step.
  forward_flops = background.call(forward_flops_per_image, setup) if ledger.needs_flops else None
  bar = _progress_bar(len(stream.steps), p.cursor, progress)
  # The files are closed however the loop ends (finished, preempted, non-finite loss). A signal
  # is heard until the end's exports are written: it then stops the run before results.json.
  with StopSignal() as stop, contextlib.closing(saver), bar:
    for step, batch in _batches(setup, p.cursor, ledger):  # the stream, seen once; no task ids
      with compute_lib.Stopwatch() as step_time:  # 1. the method's train step    [jitted]
        state, scalars, extras = train_step(state, batch)
        scalars = sharding.to_host(scalars)  # replicated: no communication
      labels = setup.train_source.labels[stream.steps[step]]  # the whole batch's
      ledger.timed_step(len(labels), step_time.seconds)
      if ledger.needs_flops:  # XLA's estimate; the trace is reused
        ledger.set_flops(compute_lib.flops(train_step.lower(state, batch)),
                         forward_flops.result())
      finite = nonfinite.check(step, scalars, state, p)  # 2. NaN/Inf: stop (exit 3) or skip
      p.samples_seen += len(labels)
      protocol.observe(labels)  # the classes the stream has shown (evaluator only)
      if not finite:
        nonfinite.record_skip(step, scalars, p, log)
      state, report, crossed = _after_step(setup, switch, shardings, state, p, step, batch,
                                           scalars, extras, finite, saver.trace)  # 3. hooks
      _record_step(log, p, step, scalars, report, c.log_every)  # 4. its events, the train line
      protocol.evaluate_if_due(step, p.samples_seen, state)  # 5. anytime points, task ends
      export.at_step(step, p.samples_seen, state)  # 5a. eval.export at a task end
      if crossed:  # 5b. the boundary's change, after the evaluations of the step that ended it
        state = _tell_boundary(setup, switch, shardings, state, p)
      p.cursor = step + 1
      saver.after_step(state, p, step, stop)  # 6. checkpoint cadence; a signal: save and stop
      _advance(bar, step, scalars, p)
    saver.save(state, p)  # the final state (a no-op if the last periodic save already wrote it)
    export.at_end(len(stream.steps) - 1, p.samples_seen, state)  # eval.export: final.npz
    if method.finish is not None and sharding.is_primary():  # e.g. Online-LoRA's export
      method.finish(state, workdir)
    saver.stop_if_signalled_at_end(stop, p)
  results = _write_results(setup, workdir, protocol, switch, p, saver)
  log.summarize(results, workdir)  # W&B / MLflow: summary values, accuracy matrix, files
  return results


def _start(setup: Setup, init: tuple, workdir: str,
           compile_start: tuple[float, int]):
  """The run's state and progress, resumed from the newest checkpoint that verifies or fresh;
  config.json and the stream manifest written; the run log, compute ledger, trace, saver and
  evaluation protocol and boundary switch that continue them. Returns (state, progress, saver,
  protocol, switch)."""
  c, method, stream = setup.config, setup.method, setup.stream
  primary = sharding.is_primary()  # writes the run's files; every process computes
  state = run_initial_state(setup, *init)
  # One device: jit's single-device shardings.
  state = sharding.place_state(state, sharding.state_shardings(state, setup.mesh))
  if c.eval.write_plots and primary:
    plots_lib.import_in_background()  # drawn at the end: imported while the device computes
  # Resume: the whole run state from the newest checkpoint that verifies, read onto the
  # shardings of the initial state (each process reads only its shards).
  checkpointer = checkpointing.Checkpointer(workdir, c.max_to_keep, initial=state)
  meta = {"config": checkpointing.config_to_dict(c), "stream_sha256": stream.sha256()}
  restored = checkpointing.restore_run(checkpointer, state, c, meta["stream_sha256"],
                                       with_host=True)
  switch = BoundarySwitch(c.boundaries, stream, method)  # who tells the method of boundaries
  if restored is None:
    p = checkpointing.Progress.initial(c.eval.eval_every, method.init_host(), switch.init_host())
  else:
    state, p, host = restored
    if primary:  # the log as the checkpoint recorded it, rebuilt from its copy if damaged
      repaired = workdir_lib.restore_run_log(workdir, p.metrics_bytes, p.metrics_sha256,
                                             host.get("run_log"), p.cursor)
      if repaired:
        logging.warning("%s", repaired)
    logging.warning("resuming %s at stream step %d of %d", workdir, p.cursor, len(stream.steps))
  if primary:
    runlog.write_json(os.path.join(workdir, "config.json"), meta["config"])
    manifest_lib.write_manifest(os.path.join(workdir, "stream_manifest.json"), setup.manifest)
  log = runlog.open_run_log(workdir, primary, truncate_to=p.metrics_bytes, config=c)
  ledger = compute_lib.Ledger(p.compute, compile_start)  # results.json "compute"
  # Per-step records into WORKDIR/trace.npz when trace.enabled (olora_jax/trace.py), else no-ops.
  trace = trace_lib.make_trace(c.trace.enabled and primary, workdir, stream,
                               manifest_lib.record_ids(setup.train_source), c.learner.buffer_unit,
                               c.learner.buffer_size, c.learner.batch_size, p.cursor)
  saver = Saver(checkpointer, meta, log, ledger, trace, c.checkpoint_every, p.wall_seconds,
                setup.hook_check.host_failed)
  # The evaluator reads the state through the method's pure `predict` and never changes it.
  evaluator = Evaluator(setup.test_source, setup.spec.image_size, c.eval.batch_size,
                        setup.num_classes, method.predict, c.eval.mask_unseen_logits,
                        mesh=setup.mesh, input_scale=c.data.input_scale,
                        preprocess=c.data.preprocess, predict_chunk=c.eval.predict_chunk,
                        task_of_class=task_il_map(stream, setup.test_source, setup.num_classes,
                                                  c.data.scenario))
  protocol = EvaluationProtocol(p.evaluation, stream, setup.test_source, evaluator,
                                setup.num_classes, c.eval.eval_every, method.anytime_eval,
                                c.eval.mask_unseen_logits, log.write, ledger.timed_eval,
                                run_control.evaluated_state(method, checkpointer))
  return state, p, saver, protocol, switch


def _batches(setup: Setup, cursor: int, ledger: compute_lib.Ledger):
  """(step, batch) from stream step `cursor` on. Host threads prepare the next batches while
  the device runs (data/pipeline.py), each placed on the devices by the thread that prepared
  it; a batch is a pure function of its step, so a resumed run sees the same batches.
  data.preprocess='device': uint8 becomes the float batch every method takes, on the device.
  The time the loop waits for a batch goes to the ledger (`host_wait_seconds`)."""
  place = functools.partial(sharding.shard_batch, mesh=setup.mesh)
  batches = enumerate(setup.pipeline.iterate(cursor, place), start=cursor)
  while True:
    with compute_lib.Stopwatch() as wait:
      item = next(batches, None)
    if item is None:  # the stream's end (the pipeline's threads are done)
      return
    ledger.timed_host_wait(wait.seconds)
    step, placed = item
    yield step, setup.pipeline.on_device(placed)


def _after_step(setup: Setup, switch: BoundarySwitch, shardings, state, p, step: int,
                batch: dict, scalars: dict, extras, finite: bool, trace):
  """The method's host hook after a step (also told of a skipped step, finite=False), then the
  boundary switch's decision (`boundaries.rule`); returns the state, the step's `StepReport`
  and whether a boundary was passed (the method is told by `_tell_boundary`, after the step's
  evaluations)."""
  method, report, check = setup.method, methods_base.StepReport(), setup.hook_check
  if check.first:  # the train step's scalars keep their names: checked once
    check.scalars(scalars)
  if method.after_step is not None:
    state, p.method_host, report = check.after_step(method.after_step(
        state, p.method_host, step, batch, scalars, extras, finite, trace), scalars)
  check.first = False
  crossed, events, values = switch.after_step(p.boundary, step, scalars, finite)
  if events or values:
    report = methods_base.StepReport(tuple(report.events) + events,
                                     {**report.train_values, **values})
  if setup.mesh.devices.size > 1:  # the hook's programs may leave leaves elsewhere: put back
    state = sharding.place_state(state, shardings)
  return state, report, crossed


def _tell_boundary(setup: Setup, switch: BoundarySwitch, shardings, state, p):
  """The method's `at_boundary` for a boundary passed at this step: called after the step's
  task-end and anytime evaluations, so they see the model that finished the task; the state it
  returns is what the step's checkpoint holds and the next step trains."""
  state, p.method_host = switch.tell(state, p.method_host, setup.hook_check)
  if setup.mesh.devices.size > 1:
    state = sharding.place_state(state, shardings)
  return state


def _record_step(log, p, step: int, scalars: dict, report: methods_base.StepReport,
                 log_every: int) -> None:
  """The method's events (a plateau is also kept for results.json), then the `train` line."""
  for event, values in report.events:
    if event == "plateau":
      p.plateau_steps.append(step)
      p.plateau_samples.append(p.samples_seen)
    log.write(event, step, p.samples_seen, **values)
  if step % log_every == 0:
    log.write("train", step, p.samples_seen, **scalars, **report.train_values)


def _write_results(setup: Setup, workdir: str, protocol: EvaluationProtocol,
                   switch: BoundarySwitch, p, saver: Saver) -> dict:
  """results.json (and the figures) from the protocol's records and what the run was."""
  c, stream = setup.config, setup.stream
  results = protocol.results(p.plateau_steps, p.plateau_samples, p.nonfinite_steps, {
      "n_steps": len(stream.steps),
      "samples_seen": p.samples_seen,
      "stream_sha256": stream.sha256(),
      "stream_manifest_sha256": manifest_lib.manifest_sha256(setup.manifest),
      "fidelity": fidelity_lib.fidelity_record(c),
      # The run's method's check, and which of its settings differ from the checked ones.
      "check": methods_lib.resolve(c.method).check_record(c),
      **switch.results(p.boundary),  # absent with boundaries.rule='none'
      # Keys that may change on resume (checkpointing.OPERATIONAL_KEYS) and did.
      **({"config_changes": p.config_changes} if p.config_changes else {}),
      **({} if setup.benchmark_manifest_sha256 is None else {
          "benchmark_manifest_sha256": setup.benchmark_manifest_sha256}),
      "wall_seconds": saver.wall_seconds(),
      "compute": saver.ledger.results(),
  })
  if sharding.is_primary():
    runlog.write_json(os.path.join(workdir, "results.json"), results)
    if c.eval.write_plots:
      plots_lib.write_run_plots(workdir)
  sharding.barrier("results written")  # every process returns once the run's files are there
  return results


COMPILING = "compiling"  # the progress bar's description until the first step ends


def _progress_bar(n_steps: int, cursor: int, progress: bool) -> tqdm.tqdm:
  """One progress bar per run: process 0's. It says "compiling" until this process's first step
  ends (that step compiles the loop's programs); smoothing=0: the rate is the average over the
  steps since `_steady_eta` restarted it."""
  return tqdm.tqdm(total=n_steps, initial=cursor, desc=COMPILING,
                   disable=not (progress and sharding.is_primary()), unit="step",
                   dynamic_ncols=True, mininterval=0.5, smoothing=0)


def _advance(bar: tqdm.tqdm, step: int, scalars: dict, p) -> None:
  # Shown with the next redraw, which `update` makes at most every 0.5 s.
  bar.set_postfix(loss=f"{scalars['loss']:.3f}", plateaus=len(p.plateau_steps), refresh=False)
  if getattr(bar, "steady", False):
    bar.update(1)
    return
  # This process's first step, which compiled: counted without the redraw `update` would make
  # (its rate, and so its estimate, would be the compile's: hours for a long stream), the clock
  # restarted, and shown with no estimate until a steady step has run.
  bar.n += 1
  _steady_eta(bar)
  bar.steady = True
  bar.set_description_str("", refresh=False)
  bar.refresh()


def _steady_eta(bar: tqdm.tqdm) -> None:
  """Restarts the bar's clock after a process's first step, which compiles: the rate and ETA
  then come from steady-state steps (evaluations and checkpoints included), not from the
  compilation (the elapsed time shown counts from here too)."""
  bar.initial = bar.n
  bar.start_t = bar.last_print_t = time.time()
  bar.last_print_n = bar.n


def forward_flops_per_image(setup: Setup, params: dict | None = None) -> float | None:
  """XLA's estimate of the backbone's forward pass on one image (lowered, and compiled only where
  the backend estimates compiled programs alone: compute.flops). `params` may be shapes; None:
  the model's, from `jax.eval_shape`."""
  size = setup.spec.image_size
  image = jax.ShapeDtypeStruct((1, size, size, 3), jnp.float32)
  if params is None:
    params = jax.eval_shape(lambda x: setup.model.init(jax.random.key(0), x), image)["params"]
  return compute_lib.flops(jax.jit(setup.model.apply).lower({"params": params}, image))


def _fmt(v, spec: str = ".2f") -> str:
  return "n/a" if v is None else format(v, spec)


def format_results_table(results: dict, config: dict | ml_collections.ConfigDict | None = None
                         ) -> str:
  """The run's closing tables (Markdown, percentages): the headline row in the README's layout
  (setting and seed, then the method: A_final, Forgetting, A_auc, plateaus), the other metrics
  (and how the run stands to its method's check, `reporting.check_summary`), and the accuracy
  matrix. `config` (the run's) names the setting and the method; without it
  the headline says 'this run'."""

  def pct(v):
    return "n/a" if v is None else reporting.format_fixed(100 * v)

  detects_plateaus = True  # Online-LoRA's plateau rule, or the plateau boundary switch
  if config is not None:
    flat = validation.flatten(config)
    detects_plateaus = (flat.get("method", "online_lora") == "online_lora"
                        or flat.get("boundaries.rule") == "plateau")
    method = reporting.method_label(flat)
    if flat.get("method", "online_lora") == "online_lora" and flat.get("fidelity"):
      method += f" (`{flat['fidelity']}` fidelity)"
    setting = f"{reporting.setting_title(flat)}, seed {flat.get('seed')}"
  else:
    setting, method = "this run", "method"
  plateaus = results["n_plateaus"] if detects_plateaus else "none"  # as the detail row says
  lines = [f"| {setting} | A_final % | Forgetting % | A_auc % | plateaus |",
           "|---|---|---|---|---|",
           f"| {method} | {pct(results['A_final'])} | {pct(results['forgetting'])}"
           f" | {pct(results['A_auc'])} | {plateaus} |", ""]
  detection = results["plateau_detection"]
  rows = [("A_last, Si-Blurry sample-weighted (%)", pct(results["A_last"])),
          ("F_last, class-wise (%)", pct(results["F_last"])),
          ("backward transfer (%)", pct(results["backward_transfer"])),
          *([("Task-IL A_final / A_auc (%)",
              f"{pct(results['A_final_task_il'])} / {pct(results['A_auc_task_il'])}")]
            if "A_final_task_il" in results else []),
          *([("plateau precision / recall",
              f"{_fmt(detection['precision'])} / {_fmt(detection['recall'])}"),
             ("plateau mean latency (samples)", _fmt(detection["mean_latency_samples"], ".0f"))]
            if detects_plateaus else
            [("plateau detection", "none: this method has no plateau rule")]),
          ("samples", str(results["samples_seen"])),
          ("wall time (s)", f"{results['wall_seconds']:.1f}"),
          *([("check", reporting.check_summary(results["check"]))] if results.get("check")
            else [])]
  skipped = results.get("nonfinite_steps") or []
  if skipped:
    shown = ", ".join(map(str, skipped[:10])) + (", ..." if len(skipped) > 10 else "")
    rows.append(("steps skipped for a non-finite loss", f"{len(skipped)} ({shown})"))
  lines += ["| more | value |", "|---|---|"] + [f"| {k} | {v} |" for k, v in rows]
  acc = np.asarray(results["acc_matrix"])
  t = acc.shape[0]
  row = "domain" if "task_domains" in results else "task"  # a stream evaluated by domain
  lines += ["", f"accuracy matrix (%), row = {row} i, column = after task j:", "",
            f"| {row} | " + " | ".join(f"after {j}" for j in range(t)) + " |",
            "|---|" + "---|" * t]
  lines += [f"| {i} | " + " | ".join(reporting.format_half_up(100 * a) for a in acc[i]) + " |"
            for i in range(t)]
  return "\n".join(lines)
