"""What a run costs: the compute ledger of results.json, and JAX's persistent compilation cache.

The ledger (`results.json["compute"]`) sums over every process of a run (a resumed run adds
its part), so the cost of a published number is on record beside it:

  device               platform, device kind and count the run used (the last process's)
  step_seconds         host time spent in train steps, from dispatch until the step's scalars
                       are back on the host (the loop reads them every step): device time plus
                       dispatch; the first step of each process (it compiles) included
  eval_seconds         time spent in evaluations (test-set passes)
  host_wait_seconds    time the loop waited for its next batch: the host's input pipeline
                       (reading, decoding, augmenting, placing) falling behind the device
  checkpoint_seconds, n_checkpoints   time writing checkpoints and how many were written (a
                       checkpoint carries the totals from before its own save)
  steady_samples_per_second   stream samples trained per second of train step, leaving out
                       each process's first step (compilation)
  flops_per_step       XLA's estimate of the floating-point operations of one train step
  forward_flops_per_image     the same for the backbone's forward pass on one image
  passes_per_step      flops_per_step / forward_flops_per_image: the step's cost in image
                       forward passes (a backward pass costs about two)
  passes_per_sample    passes_per_step x train steps / stream samples trained: the image passes
                       one stream sample costs (the methods' budget, compared across batch
                       sizes and replay settings; work outside the train step, GDumb's training
                       at evaluations, is not in it)
  achieved_flops_per_second   flops_per_step x steady steps / their seconds
  compile_seconds, n_compilations   JAX tracing, lowering and backend compilation (persistent
                       cache loads included) and how many backend compilations
  peak_device_bytes    the device allocator's peak (None where the backend does not report it,
                       e.g. CPU); peak_host_rss_bytes: the process's peak resident memory

The ledger is a measurement, not a result: it differs between identical runs, and resumed runs
are compared without it (and without `wall_seconds`).
"""

from __future__ import annotations

import itertools
import os
import resource
import sys
import time

import jax

from olora_jax import allocator

# results.json keys that are measurements, not results: they differ between identical runs, and
# comparisons of runs (a resumed run against an uninterrupted one) leave them out.
MEASUREMENT_KEYS = ("wall_seconds", "compute")

# JAX's duration events of one compilation: tracing, lowering to MLIR, backend compile (or a
# persistent-cache load).
COMPILE_EVENTS = ("/jax/core/compile/jaxpr_trace_duration",
                  "/jax/core/compile/jaxpr_to_mlir_module_duration",
                  "/jax/core/compile/backend_compile_duration")
BACKEND_COMPILE = COMPILE_EVENTS[-1]


class _CompileClock:
  """Process-wide totals of JAX's compilation events (one listener, registered once)."""

  def __init__(self):
    self.seconds = 0.0
    self.count = 0
    self._registered = False

  def register(self) -> None:
    if not self._registered:
      jax.monitoring.register_event_duration_secs_listener(self._on_event)
      self._registered = True

  def _on_event(self, event: str, duration: float, **kwargs) -> None:
    if event in COMPILE_EVENTS:
      self.seconds += duration
      self.count += event == BACKEND_COMPILE


  def snapshot(self) -> tuple[float, int]:
    return self.seconds, self.count


COMPILE_CLOCK = _CompileClock()
COMPILE_CLOCK.register()  # at import: a run's compilations before its loop count too


def default_cache_dir() -> str:
  """Where launch/run.py keeps compiled programs unless told otherwise: $JAX_COMPILATION_CACHE_DIR
  when set, else $XDG_CACHE_HOME/olora_jax/jax (~/.cache/olora_jax/jax)."""
  if os.environ.get("JAX_COMPILATION_CACHE_DIR"):
    return os.environ["JAX_COMPILATION_CACHE_DIR"]
  base = os.environ.get("XDG_CACHE_HOME") or os.path.join(os.path.expanduser("~"), ".cache")
  return os.path.join(base, "olora_jax", "jax")


# The JAX settings `enable_compilation_cache` sets.
COMPILATION_CACHE_SETTINGS = ("jax_compilation_cache_dir",
                              "jax_persistent_cache_min_compile_time_secs",
                              "jax_persistent_cache_min_entry_size_bytes")


def enable_compilation_cache(directory: str) -> None:
  """JAX's persistent compilation cache in `directory`, for every program however fast it
  compiled (JAX's defaults skip programs under a second, which is all of a small model's): a
  later run of the same shapes loads them instead of compiling. The cached programs are the
  ones a fresh compile makes, so results do not change."""
  for setting, value in zip(COMPILATION_CACHE_SETTINGS, (directory, 0, 0), strict=True):
    jax.config.update(setting, value)


# glibc's malloc, set by launch/run.py before its first thread (olora_jax/allocator.py; kept
# here for the callers that name it from this module).
keep_host_memory = allocator.keep_host_memory
KEEP_HOST_MEMORY_ENV = allocator.KEEP_HOST_MEMORY_ENV


def flops(lowered) -> float | None:
  """XLA's floating-point operation estimate of a lowered program (None where unavailable).

  Backends behind PJRT's C API (JAX's CUDA plugin among them) estimate only compiled programs:
  there the program is compiled, which for one already run (a jitted train step) is JAX's
  in-memory cache and costs nothing, and for a new one (the one-image forward) is one compile."""
  try:
    try:
      cost = lowered.cost_analysis()
    except NotImplementedError:  # "use compile().cost_analysis()"
      cost = lowered.compile().cost_analysis()
  except Exception:  # the estimate is optional: some backends do not provide it
    return None
  if isinstance(cost, (list, tuple)):
    cost = cost[0] if cost else None
  value = (cost or {}).get("flops")
  return float(value) if value is not None and value >= 0 else None


# Kinds of a compiled program's ops for `op_time_shares`: matrix products (a dot or convolution,
# alone or in a fusion, or a library call such as cuBLAS's GEMM) and pure data movement (every op
# of it in LAYOUT_OPS); the rest is element-wise math and reductions. Control-flow ops are left
# out: their bodies' ops are timed.
MATMUL_OPS = frozenset({"dot", "convolution"})
MATMUL_CALL_TARGETS = ("gemm", "matmul", "conv", "dot")
LAYOUT_OPS = frozenset({"copy", "transpose", "broadcast", "concatenate", "pad", "slice", "reshape",
                        "bitcast", "dynamic-slice", "dynamic-update-slice", "reverse",
                        "parameter", "constant", "tuple", "get-tuple-element"})
CONTROL_OPS = frozenset({"while", "conditional", "call"})
OP_KINDS = ("matmul", "layout", "other")  # the keys of `op_time_shares`


def _hlo_ops(hlo_text: str) -> tuple[str, dict[str, tuple[str, str | None]], dict[str, set]]:
  """An HLO module's text -> (its name, {instruction: (op, the computation it calls or None)},
  {computation: the ops it holds})."""
  module, current, instructions, computations = "", None, {}, {}
  for line in hlo_text.splitlines():
    if line.startswith("HloModule "):
      module = line.split()[1].rstrip(",")
    elif line and not line[0].isspace() and line.rstrip().endswith("{"):
      current = line.split()[1 if line.startswith("ENTRY ") else 0].lstrip("%")
      computations[current] = set()
    elif " = " in line and current is not None:
      name, _, rest = line.strip().removeprefix("ROOT ").partition(" = ")
      if rest.startswith("("):  # a tuple type: the op follows its closing parenthesis
        depths = itertools.accumulate((c == "(") - (c == ")") for c in rest)
        rest = rest[next(i for i, depth in enumerate(depths) if depth == 0) + 1:]
      else:
        rest = rest.partition(" ")[2]
      op = rest.strip().partition("(")[0]
      if op == "custom-call" and any(t in rest.partition("custom_call_target=")[2].split(",")[0]
                                     .lower() for t in MATMUL_CALL_TARGETS):
        op = "dot"  # a library matrix product (cuBLAS, cuDNN, oneDNN)
      called = rest.partition("calls=")[2].split(",")[0].strip().lstrip("%") or None
      instructions[name.lstrip("%")] = (op, called)
      computations[current].add(op)
  return module, instructions, computations


def op_time_shares(profile: jax.profiler.ProfileData, hlo_text: str) -> dict[str, float] | None:
  """How the op time of one compiled program splits in a `jax.profiler` trace: the fractions
  `matmul`, `layout` (copies, transposes, materialised broadcasts, concatenations) and `other`
  (element-wise math, reductions) of the summed durations of its ops' events, `hlo_text` being
  the program's `compiled.as_text()`. Durations are summed over threads, so they exceed the
  wall time where ops overlap. None when the trace holds no op of the program (backends whose
  traces do not name HLO ops)."""
  module, instructions, computations = _hlo_ops(hlo_text)
  seconds = dict.fromkeys(OP_KINDS, 0.0)
  for plane in profile.planes:
    for line in plane.lines:
      for event in line.events:
        stats = dict(event.stats)
        if stats.get("hlo_module") != module or stats.get("hlo_op") not in instructions:
          continue
        op, called = instructions[stats["hlo_op"]]
        if op in CONTROL_OPS:
          continue
        inner = computations.get(called, set()) if called else {op}
        kind = ("matmul" if inner & MATMUL_OPS else "layout" if inner <= LAYOUT_OPS else "other")
        seconds[kind] += event.duration_ns / 1e9
  total = sum(seconds.values())
  return {kind: value / total for kind, value in seconds.items()} if total else None


def device_memory_bytes() -> int | None:
  """The memory of one local device: the allocator's limit on GPU/TPU, the machine's physical
  memory on CPU (None when unknown)."""
  limit = (jax.local_devices()[0].memory_stats() or {}).get("bytes_limit")
  return int(limit) if limit else host_memory_bytes()


def host_memory_bytes() -> int | None:
  """The machine's physical memory (None when unknown)."""
  try:
    return os.sysconf("SC_PAGE_SIZE") * os.sysconf("SC_PHYS_PAGES")
  except (ValueError, OSError, AttributeError):
    return None


def peak_device_bytes() -> int | None:
  """The largest peak among the local devices' allocators (None where not reported)."""
  peaks = [(d.memory_stats() or {}).get("peak_bytes_in_use") for d in jax.local_devices()]
  peaks = [p for p in peaks if p is not None]
  return max(peaks) if peaks else None


def peak_host_rss_bytes() -> int:
  """This process's peak resident memory: VmHWM of /proc/self/status where there is one (Linux).
  getrusage's ru_maxrss is the fallback only: Linux carries the parent's resident size at fork
  into a child's ru_maxrss across exec, so a run started by a large process (a test worker,
  bench.py's cases) would report at least that process's memory."""
  try:
    with open("/proc/self/status") as f:
      for line in f:
        if line.startswith("VmHWM:"):
          return int(line.split()[1]) * 1024  # kB
  except OSError:
    pass
  peak = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss
  return peak if sys.platform == "darwin" else peak * 1024  # bytes on macOS, KiB elsewhere


def device_description() -> str:
  devices = jax.devices()
  return f"{devices[0].platform}: {len(devices)} x {devices[0].device_kind}"


class Ledger:
  """Accumulates one process's part of a run's compute and merges it with the earlier
  processes' totals (`record`, carried in the checkpoint)."""

  def __init__(self, record: dict, compile_start: tuple[float, int] | None = None):
    """`record`: the earlier processes' totals; `compile_start`: COMPILE_CLOCK.snapshot() when
    this process's part began (default: now)."""
    self.record = dict(record)
    self._compile_start = compile_start or COMPILE_CLOCK.snapshot()
    self._steps = 0

  def timed_step(self, samples: int, seconds: float) -> None:
    """One train step of `samples` stream samples that took `seconds` (dispatch to scalars)."""
    r = self.record
    r["step_seconds"] = r.get("step_seconds", 0.0) + seconds
    r["steps"] = r.get("steps", 0) + 1
    r["samples"] = r.get("samples", 0) + samples
    if self._steps:  # the process's first step compiles: not steady state
      r["steady_steps"] = r.get("steady_steps", 0) + 1
      r["steady_seconds"] = r.get("steady_seconds", 0.0) + seconds
      r["steady_samples"] = r.get("steady_samples", 0) + samples
    self._steps += 1

  def timed_eval(self, seconds: float) -> None:
    self.record["eval_seconds"] = self.record.get("eval_seconds", 0.0) + seconds

  def timed_host_wait(self, seconds: float) -> None:
    """The loop waited `seconds` for its next batch (the host's input pipeline was behind)."""
    self.record["host_wait_seconds"] = self.record.get("host_wait_seconds", 0.0) + seconds

  def timed_checkpoint(self, seconds: float) -> None:
    """One checkpoint written in `seconds`."""
    r = self.record
    r["checkpoint_seconds"] = r.get("checkpoint_seconds", 0.0) + seconds
    r["n_checkpoints"] = r.get("n_checkpoints", 0) + 1

  @property
  def needs_flops(self) -> bool:
    """True until `set_flops` has run in this run (once, in its first process)."""
    return "flops_per_step" not in self.record

  def set_flops(self, flops_per_step: float | None, forward_flops_per_image: float | None
                ) -> None:
    self.record["flops_per_step"] = flops_per_step
    self.record["forward_flops_per_image"] = forward_flops_per_image

  def checkpoint_record(self) -> dict:
    """The totals so far, this process included: what a checkpoint stores."""
    r = dict(self.record)
    seconds, count = COMPILE_CLOCK.seconds, COMPILE_CLOCK.count
    r["compile_seconds"] = r.get("compile_seconds", 0.0) + seconds - self._compile_start[0]
    r["n_compilations"] = r.get("n_compilations", 0) + count - self._compile_start[1]
    device_peak = peak_device_bytes()
    r["peak_device_bytes"] = max((p for p in (r.get("peak_device_bytes"), device_peak)
                                  if p is not None), default=None)
    r["peak_host_rss_bytes"] = max(r.get("peak_host_rss_bytes", 0), peak_host_rss_bytes())
    r["device"] = device_description()
    return r

  def results(self) -> dict:
    """The ledger for results.json (derived rates included)."""
    r = self.checkpoint_record()
    steady_seconds = r.get("steady_seconds", 0.0)
    rate = r.get("steady_samples", 0) / steady_seconds if steady_seconds else None
    fps = r.get("flops_per_step")
    fwd = r.get("forward_flops_per_image")
    return {
        "device": r["device"],
        "step_seconds": r.get("step_seconds", 0.0),
        "eval_seconds": r.get("eval_seconds", 0.0),
        "host_wait_seconds": r.get("host_wait_seconds", 0.0),
        "checkpoint_seconds": r.get("checkpoint_seconds", 0.0),
        "n_checkpoints": r.get("n_checkpoints", 0),
        "steady_samples_per_second": rate,
        "flops_per_step": fps,
        "forward_flops_per_image": fwd,
        "passes_per_step": fps / fwd if fps and fwd else None,
        "passes_per_sample": (fps / fwd * r["steps"] / r["samples"]
                              if fps and fwd and r.get("samples") else None),
        "achieved_flops_per_second": (fps * r["steady_steps"] / steady_seconds
                                      if fps and steady_seconds else None),
        "compile_seconds": r["compile_seconds"],
        "n_compilations": r["n_compilations"],
        "peak_device_bytes": r["peak_device_bytes"],
        "peak_host_rss_bytes": r["peak_host_rss_bytes"],
    }


class Stopwatch:
  """`with Stopwatch() as t: ...; t.seconds`."""

  def __enter__(self) -> Stopwatch:
    self._start = time.perf_counter()
    return self

  def __exit__(self, *exc) -> None:
    self.seconds = time.perf_counter() - self._start
