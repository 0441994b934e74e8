"""The method interface: what the one loop of `olora_jax.trainer` needs from a learner.

A method is a `Method` record of pure functions over ONE state pytree (device arrays only: the
trainable weights, the frozen weights, optimizer state, replay buffers, PRNG key, ...). The
trainer never looks inside the state: it checkpoints it whole (`olora_jax.checkpointing`),
replicates it over the mesh, and hands it to these functions:

    init(key, params) -> state                         the state before the first batch; `params`
                                                       is the full ViT tree with its fresh C-way
                                                       head (pretrained or random backbone)
    train_step(state, batch) -> (state, scalars, extras)   [jitted, donates state] one step on
                                                       a batch {"images" (B, H, W, 3) float32,
                                                       "labels" (B,) int32, "mask" (B,) bool};
                                                       `scalars` are () arrays written to
                                                       metrics.jsonl ("loss" is required: the
                                                       NaN guard reads it); `extras` any device
                                                       pytree for `after_step`
    predict(state, images) -> logits (N, C)            [pure] what the evaluator calls
    after_step(state, host, step, batch, scalars, extras, finite, trace)
        -> (state, host, StepReport)                   optional host hook after every step
                                                       (Online-LoRA's plateau rule,
                                                       consolidation and hard-buffer update);
                                                       `finite` False: the step was skipped for
                                                       a non-finite loss (the state is the old
                                                       one); `host` is a JSON-able dict the
                                                       trainer checkpoints with the run's
                                                       progress; `trace` the run's per-step
                                                       recorder (olora_jax/trace.py)
    eval_state(state) -> state                         optional: the state the evaluator
                                                       reads (GDumb trains its model from the
                                                       buffer here); never written back; it
                                                       must hold no NaN/Inf (the loop checks:
                                                       exit 3 naming `eval_state_keys`, the
                                                       config keys that set what it computes)
    init_host() -> dict                                the host hook's initial record
    finish(state, workdir)                             optional, after the last step (Online-
                                                       LoRA: export_online_lora)
    trainable(state) -> pytree                         optional: what the method trains (its
                                                       LoRA, head, prompts, ...) in the state the
                                                       evaluator reads, written by eval.export
                                                       (olora_jax/export.py); None: the state's
                                                       `params` entry
    at_boundary(state, host) -> (state, host)          optional: told that a task boundary was
                                                       passed, by the run's boundary switch
                                                       (`boundaries.rule`: 'oracle' at each true
                                                       task end, 'plateau' when the loss-window
                                                       rule fires on the method's own loss;
                                                       'none', the default, never calls it),
                                                       after that step's evaluations (a task
                                                       end is evaluated before the change)

The learner is task-free: a batch carries no task id, and no method hears of task boundaries
unless the run's boundary switch is set (then results.json marks the run;
docs/methods/boundaries.md).
`anytime_eval=False` makes the loop evaluate at task ends only (GDumb, as the paper reports it).
"""

from __future__ import annotations

import dataclasses
import inspect
import os
from collections.abc import Callable, Mapping
from typing import Any, NamedTuple

from olora_jax import errors

BATCH_KEYS = frozenset({"images", "labels", "mask"})
# What every metrics.jsonl line sets itself (olora_jax/runlog.py): no event value, `train` value
# or scalar may use these names.
RESERVED_LOG_KEYS = frozenset({"step", "samples_seen", "event"})


class StepReport(NamedTuple):
  """What a host hook tells the loop about one step."""

  events: tuple[tuple[str, dict], ...] = ()  # (event name, values) lines for metrics.jsonl,
  # written before the step's `train` line; an event named "plateau" is also recorded in
  # results.json (plateau_steps, plateau detection)
  train_values: dict = {}  # extra values for the step's `train` line (e.g. window mean/var)


@dataclasses.dataclass(frozen=True)
class Method:
  """One continual-learning method; see the module docstring for each function's contract."""

  name: str
  init: Callable[[Any, dict], Any]
  train_step: Callable[[Any, dict], tuple[Any, dict, Any]]
  predict: Callable[[Any, Any], Any]
  after_step: Callable | None = None
  eval_state: Callable[[Any], Any] | None = None
  eval_state_keys: tuple[str, ...] = ()
  init_host: Callable[[], dict] = dict
  finish: Callable[[Any, str], None] | None = None
  at_boundary: Callable[[Any, dict], tuple[Any, dict]] | None = None
  anytime_eval: bool = True
  trainable: Callable[[Any], Any] | None = None
  # The method trains on an i.i.d. shuffle of the stream's samples (the upper bound).
  iid_stream: bool = False


# How the loop calls each function of a `Method` (the module docstring's contracts).
CALLS = {"init": ("key", "params"), "train_step": ("state", "batch"),
         "predict": ("state", "images"),
         "after_step": ("state", "host", "step", "batch", "scalars", "extras", "finite", "trace"),
         "eval_state": ("state",), "init_host": (), "finish": ("state", "workdir"),
         "at_boundary": ("state", "host"), "trainable": ("state",)}


def check_signatures(method: Method) -> None:
  """Refuses (ValueError: exit 2, before any compute) a function of `method` that cannot take
  the loop's call, naming it and the call: a hook of the wrong signature would otherwise fail
  steps later inside the loop, as if the loop were at fault."""
  for name, args in CALLS.items():
    fn = getattr(method, name)
    if fn is None:
      continue
    try:
      signature = inspect.signature(fn)
    except (TypeError, ValueError):  # a builtin or extension without a signature: not checked
      continue
    try:
      signature.bind(*args)
    except TypeError as e:
      raise ValueError(
          f"method={method.name!r}: its {name}{signature} cannot take the loop's call"
          f" {name}({', '.join(args)}) ({e}); give {name} that signature (the method interface:"
          " docs/methods/interface.md)") from e


class MethodError(errors.BadInput):
  """A method's hook returned what the loop cannot take (exit 2): the line names the hook's file
  and line. Every process runs the same hook on the same values, so each raises it at the same
  point."""

  every_process = True


_PACKAGE_DIR = os.path.dirname(os.path.dirname(os.path.realpath(__file__))) + os.sep


def source_of(fn: Callable) -> str:
  """'file:line' where `fn` (a method's hook) is defined, through functools.partial and
  decorators; '' when it has no Python source (a builtin)."""
  fn = inspect.unwrap(getattr(fn, "func", fn))
  if not inspect.isfunction(fn) and not inspect.ismethod(fn):  # a callable object: its __call__
    fn = vars(type(fn)).get("__call__", fn)
  code = getattr(fn, "__code__", None)
  return f"{code.co_filename}:{code.co_firstlineno}" if code is not None else ""


def hook_error(method: Method, hook: str, problem: str, fix: str) -> errors.RunError:
  """The one line of a hook's bad return: `method`'s `hook` (at its file and line) `problem`;
  `fix`. A hook in the user's own file is theirs to fix (exit 2); one inside olora_jax is a bug
  to report (exit 1)."""
  where = source_of(getattr(method, hook))
  at = f" ({where})" if where else ""
  line = f"method={method.name!r}: its {hook}{at} {problem}"
  if where and os.path.realpath(where.rpartition(":")[0]).startswith(_PACKAGE_DIR):
    return errors.InternalError(f"unexpected: {line}; please report it with the error log")
  return MethodError(f"{line}; {fix} (the method interface: docs/methods/interface.md), then run"
                     " the same command: it resumes from the newest checkpoint, if there is one")


def json_problem(value: Any, path: str = "host") -> str:
  """'' when `value` goes through a JSON checkpoint and back unchanged in kind (dicts with str
  keys, lists, tuples, str, int, float, bool, None), else the first place that does not, as
  `host['x'] is a numpy.ndarray`."""
  if value is None or isinstance(value, (str, bool, int, float)):
    return ""
  if isinstance(value, dict):
    for key, item in value.items():
      if not isinstance(key, str):
        return (f"{path} has the key {key!r} of type {type(key).__name__} (a JSON checkpoint"
                " turns it into a string)")
      found = json_problem(item, f"{path}[{key!r}]")
      if found:
        return found
    return ""
  if isinstance(value, (list, tuple)):
    for i, item in enumerate(value):
      found = json_problem(item, f"{path}[{i}]")
      if found:
        return found
    return ""
  kind = type(value)
  return f"{path} is a {kind.__module__}.{kind.__qualname__}"


HOST_FIX = ("keep arrays in the state, and give the host record only dicts with string keys,"
            " lists, strings and Python numbers (e.g. float(x) or x.tolist())")


def check_host(method: Method, hook: str, host: Any) -> None:
  """Refuses (`MethodError`) a host record `hook` returned that a checkpoint cannot store as
  JSON and give back: not a dict, or holding an array, a NumPy scalar, a non-string key, ..."""
  if not isinstance(host, dict):
    raise hook_error(method, hook, f"returned a host record of type {type(host).__name__}",
                     "return the host record as a dict")
  problem = json_problem(host)
  if problem:
    raise hook_error(method, hook, f"returned a host record that a checkpoint cannot store:"
                     f" {problem}", HOST_FIX)


class HookCheck:
  """Checks what a method's hooks return before the loop uses it. `after_step`'s first return
  is checked in full (its host record through JSON too); later ones by their shape and names
  alone (a few set operations per step): a later host record that a checkpoint cannot store is
  named when the checkpoint finds it (`host_failed`)."""

  def __init__(self, method: Method):
    self.method = method
    self.first = True

  def init_host(self) -> dict:
    """`init_host()`, checked: the record before the first step (before any compute)."""
    host = self.method.init_host()
    check_host(self.method, "init_host", host)
    return host

  def scalars(self, scalars: dict) -> None:
    """The train step's scalars (the same names every step: checked at the first)."""
    clash = sorted(RESERVED_LOG_KEYS.intersection(scalars))
    if clash:
      raise hook_error(self.method, "train_step", f"returned the scalar(s) {_names(clash)},"
                       " which every metrics.jsonl line sets itself (step, samples_seen, event)",
                       "rename them in the scalars it returns")

  def after_step(self, result: Any, scalars: dict) -> tuple[Any, dict, StepReport]:
    """`after_step`'s return as (state, host, StepReport), or `MethodError` naming the hook."""
    if type(result) is not tuple or len(result) != 3:
      got = (f"{len(result)} values" if isinstance(result, (tuple, list)) else
             f"a {type(result).__name__}")
      raise hook_error(self.method, "after_step", f"returned {got}",
                       "return three values: state, host, StepReport(...)")
    _, host, report = result
    if not isinstance(report, StepReport):
      raise hook_error(self.method, "after_step", "returned a third value of type"
                       f" {type(report).__name__}", "return StepReport(events=...,"
                       " train_values=...) (olora_jax.methods.base.StepReport) as the third value")
    for event in report.events:
      if (type(event) is not tuple or len(event) != 2 or not isinstance(event[0], str)
          or not isinstance(event[1], dict)):
        raise hook_error(self.method, "after_step", f"returned the event {event!r}",
                         "give each event as a pair (name: str, values: dict)")
      clash = RESERVED_LOG_KEYS.intersection(event[1])
      if clash:
        raise hook_error(self.method, "after_step", f"returned the event {event[0]!r} with the"
                         f" value(s) {_names(clash)}, which every metrics.jsonl line sets itself"
                         " (step, samples_seen, event)", "rename them in that event's values")
    values = report.train_values
    if not isinstance(values, dict):
      raise hook_error(self.method, "after_step", "returned train_values of type"
                       f" {type(values).__name__}", "give train_values as a dict")
    if values and not (RESERVED_LOG_KEYS.isdisjoint(values) and scalars.keys().isdisjoint(values)):
      clash = RESERVED_LOG_KEYS.union(scalars).intersection(values)
      raise hook_error(self.method, "after_step", f"returned the train value(s) {_names(clash)},"
                       " which the step's train line already has (step, samples_seen, event and"
                       f" the train step's scalars {_names(scalars)})",
                       "rename them in StepReport(train_values=...)")
    if self.first:
      check_host(self.method, "after_step", host)
      self.first = False
    elif type(host) is not dict:
      check_host(self.method, "after_step", host)
    return result

  def at_boundary(self, result: Any) -> tuple[Any, dict]:
    """`at_boundary`'s return as (state, host), checked in full (it runs once per boundary)."""
    if type(result) is not tuple or len(result) != 2:
      got = (f"{len(result)} values" if isinstance(result, (tuple, list)) else
             f"a {type(result).__name__}")
      raise hook_error(self.method, "at_boundary", f"returned {got}",
                       "return two values: state, host")
    check_host(self.method, "at_boundary", result[1])
    return result

  def host_failed(self, host: Any) -> None:
    """Called when a checkpoint could not store the run's host record: `MethodError` naming
    `after_step` when the method's record is the cause (else the caller's error stands)."""
    if self.method.after_step is not None:
      check_host(self.method, "after_step", host)


def _names(keys) -> str:
  return ", ".join(repr(k) for k in sorted(keys))


@dataclasses.dataclass(frozen=True)
class Context:
  """What every method builder may read: the resolved config and the run's static facts."""

  config: Any  # the resolved ml_collections config (fidelity keys filled in)
  model: Any  # olora_jax.models.vit.VisionTransformer with the benchmark's C-way head
  spec: Any  # olora_jax.models.vit.ViTSpec
  num_classes: int
  batch_size: int
  image_shape: tuple[int, int, int]  # (H, W, 3) of a model input
  stream_samples: int = 0  # training samples in the run's stream (0: not known, e.g. in tests)
  stream_steps: int = 0  # training steps of the run's stream (0: not known)
  # The items of each stream step's batch (a short step is padded and masked); () not known.
  stream_step_items: tuple[int, ...] = ()


def check_batch(batch: dict) -> None:
  """Refuses a batch that carries anything but images, labels and mask (task-free)."""
  if set(batch) != BATCH_KEYS:
    raise ValueError(
        f"a learner batch has exactly the keys {sorted(BATCH_KEYS)}, got {sorted(batch)}; the"
        " learner is task-free and must not receive task ids or boundaries")


AUTHORS_CODE = "its authors' code"  # whose code a check ran, unless its `Check.code` says
CHECK_KINDS = {
    "step": "matches its authors' code step for step on a shared stream",
    "seeds": "matches its authors' code over seeds on a shared stream (task-end mean"
             " accuracies; our side run live, theirs recorded)",
    "none": "not checked against its authors' code",
}


# What a check's settings are (`Check.settings`), as the record, the report and the docs say it.
CHECKED_SETTINGS_RULE = (
    "the config keys that choose what the method computes, at the values the check ran: the"
    " boundary rule, the backbone's architecture, the fidelity, and the method block's switches"
    " (its optimiser, mask, what it trains, its passes, phases and alignment, a loss term"
    " switched off by a weight of 0); not the numbers the check set for its short stream or"
    " tight floats (learning rates, buffer and batch sizes, stream lengths), nor the data, the"
    " input scaling, the initial weights, the seed or the outputs")
# `Check.record`'s status of a run: its method's check holds in the run's settings, they differ
# from the checked ones in `differing`, its method has no check, or the check declares no settings.
CHECK_STATUSES = ("checked", "differs", "unchecked", "undeclared")


def same_setting(a: Any, b: Any) -> bool:
  """Whether a run's value of a setting is the checked one (tuples and lists alike, as config.json
  writes a tuple; True is not the number 1; numbers by value)."""
  if isinstance(a, (tuple, list)) and isinstance(b, (tuple, list)):
    return len(a) == len(b) and all(same_setting(x, y) for x, y in zip(a, b, strict=True))
  if isinstance(a, bool) or isinstance(b, bool):
    return a is b
  return a == b


def _json_value(value: Any) -> Any:
  return [_json_value(v) for v in value] if isinstance(value, (tuple, list)) else value


def settings_phrase(settings: Mapping[str, Any]) -> str:
  """`settings` as a sentence names them: "`boundaries.rule='oracle'`, `model.name='x'`"."""
  return ", ".join(f"`{key}={value!r}`" for key, value in settings.items())


@dataclasses.dataclass(frozen=True)
class Variant:
  """A variant of a method that the same check also covers, in settings of its own (SimpleCIL's
  check also runs APER: `simplecil.first_phase='all'` with oracle boundaries).

  name      how the card names it ("APER")
  settings  its checked settings, as `Check.settings`; the first is the key that selects the
            variant: a run whose value of it is not the method's own checked one is compared
            with the variant's settings
  scope     what the check of the variant covers beyond them ("except for ...")
  """

  name: str
  settings: Mapping[str, Any]
  scope: str = ""


@dataclasses.dataclass(frozen=True)
class Check:
  """How a method's implementation is checked against its authors' released code.

  kind      'step' (every decision identical and the floats within a stated tolerance, replayed
            from a committed recording of their run), 'seeds' (their randomness cannot be
            shared: task-end means over seeds, ours run live, theirs recorded; the scope says
            how many), or 'none' (not checked)
  against   the authors' code the check ran ("owner/repository"), '' for 'none'
  test      the test that replays it ("tests/test_....py"), '' for 'none'
  scope     what the check covers that is not a setting ("40 steps over 5 tasks, float32", "the
            slow learner, not its alignment"), '' for nothing more
  settings  the settings the check ran in: {dotted config key: value} (`CHECKED_SETTINGS_RULE`
            says which keys count), from the parity driver's overrides over configs/demo.py
            (tests/test_checked_settings.py ties the two); the card names those that are not the
            block's defaults, and each run's results.json says which of its own differ
            (`record`). None: not declared (every run is then 'undeclared'); {} for 'none'
  variants  other settings of the method the same check covers (`Variant`)
  code      whose code `against` is, where it is not the method's authors' ("the code the
            Online-LoRA paper took its numbers from": A-GEM, MIR and EWC++ against the
            online-continual-learning codebase); '' for its authors' code
  """

  kind: str
  against: str = ""
  test: str = ""
  scope: str = ""
  settings: Mapping[str, Any] | None = None
  variants: tuple[Variant, ...] = ()
  code: str = ""

  @property
  def whose(self) -> str:
    """Whose code the check ran: "its authors' code", or `code`."""
    return self.code or AUTHORS_CODE

  def sentence(self, defaults: Mapping[str, Any] | None = None) -> str:
    """The line a method's page opens with: the kind, the checked settings (those that are not
    `defaults`' values, {dotted key: default}: the method block's), the scope, the code and the
    test."""
    if self.kind == "none":
      return f"Check: {CHECK_KINDS['none']}; its defaults' sources are listed on its page."
    defaults = defaults or {}

    def named(settings):
      return {k: v for k, v in (settings or {}).items()
              if k not in defaults or not same_setting(defaults[k], v)}

    parts = []
    if named(self.settings):
      parts.append("with " + settings_phrase(named(self.settings)))
    if self.scope:
      parts.append(self.scope)
    for variant in self.variants:
      parts.append(f"and so does {variant.name} with {settings_phrase(named(variant.settings))}"
                   + (f" {variant.scope}" if variant.scope else ""))
    scope = "".join(f", {p}" for p in parts)
    kind = CHECK_KINDS[self.kind].replace(AUTHORS_CODE, self.whose)
    return f"Check: {kind}{scope} ({self.against}; {self.test})."

  def record(self, config: Mapping[str, Any]) -> dict:
    """results.json's `check` for a run of the method whose flattened config (dotted keys) is
    `config`: {kind, against, code (whose code: `whose`), test, scope, variant (the `Variant`
    whose settings the run is nearest, '' for the method's own), settings (the checked ones),
    differing ({key: {run, checked}}, each checked setting the run does not have; a key the
    config lacks runs as None), status (`CHECK_STATUSES`)}."""
    out = {"kind": self.kind, "against": self.against, "code": self.whose, "test": self.test,
           "scope": self.scope, "variant": "", "settings": {}, "differing": {}}
    if self.kind == "none":
      return {**out, "status": "unchecked"}
    if self.settings is None:
      return {**out, "settings": None, "differing": None, "status": "undeclared"}
    # A variant is the run's when the run leaves the method's own value of the key that selects
    # it (its first setting); of several, the one it differs from in fewest settings.
    regimes = [("", self.settings)]
    for v in self.variants:
      selector = next(iter(v.settings))
      if (selector not in self.settings
          or not same_setting(config.get(selector), self.settings[selector])):
        regimes.append((v.name, v.settings))
    found = []
    for name, settings in regimes:
      differing = {key: {"run": _json_value(config.get(key)), "checked": _json_value(value)}
                   for key, value in settings.items() if not same_setting(config.get(key), value)}
      found.append((len(differing), name, settings, differing))
    if len(found) > 1:
      found = found[1:]  # the run left the method's own setting for a variant's
    _, name, settings, differing = min(found, key=lambda item: item[0])  # the first of a tie
    return {**out, "variant": name, "settings": {k: _json_value(v) for k, v in settings.items()},
            "differing": differing, "status": "differs" if differing else "checked"}


@dataclasses.dataclass(frozen=True)
class MethodSpec:
  """What a method module declares about itself (as `METHODS = (MethodSpec(...), ...)`), so that
  the registry, the config and the report tables read it from the module instead of lists kept
  elsewhere (`olora_jax.methods.registry`). A method outside the package declares one the same
  way and is run as `method="path/to/file.py:NAME"` (docs/extending.md).

  name         the `method` config key of a packaged method, and the name of the method's config
               block `config.<name>` (for a method outside the package, the block's name)
  build        `build(ctx: Context) -> Method`, reading its block as `ctx.config[name]`
  config       `() -> ConfigDict`: the block's defaults, each key declared with its meaning,
               `name=Key(default, meaning)` (olora_jax/config_keys.py; the config reference is
               generated from them); None: no block of its own (Online-LoRA reads `learner`)
  report_name  the method's name in report tables (the paper's, for the paper's methods)
  table_row    where its row sits in a report table: the paper's Table 1 order (baselines from
               1, Online-LoRA 90, the upper bound 100); a method outside the package sorts by it
  paper_results  the paper's own numbers for this method: {layout: {setting: (metric, ...)}},
               each metric (mean, std) in % or None, in the layout's metric order
               (`olora_jax.reporting.LAYOUTS`, which gathers them into `PAPER_RESULTS`)
  paper_row_names  {layout: row label} where the paper's row in that layout is a variant of the
               method (Online-LoRA's Si-Blurry row runs without the hard loss); else report_name
  check        how the method's numbers are backed against its authors' code (`Check`): what
               its page opens with (`check_sentence`), and what each run's results.json says of
               its settings against the checked ones (`check_record`)
  """

  name: str
  build: Callable[[Context], Method]
  config: Callable[[], Any] | None
  report_name: str
  table_row: float = 50.0
  paper_results: dict = dataclasses.field(default_factory=dict)
  paper_row_names: dict = dataclasses.field(default_factory=dict)
  check: Check = Check("none")

  def paper_row(self, layout: str) -> str:
    """The label of this method's row in one of the paper's tables."""
    return self.paper_row_names.get(layout, self.report_name)

  def block_defaults(self) -> dict[str, Any]:
    """The defaults of the method's own block as dotted keys ({"coda_prompt.train_mask":
    'none', ...}); {} without a block."""
    if self.config is None:
      return {}
    return {f"{self.name}.{key}": value for key, value in _leaves(self.config().to_dict())}

  def check_sentence(self) -> str:
    """The card's check line: `Check.sentence`, naming the checked settings that are not the
    block's defaults."""
    return self.check.sentence(self.block_defaults())

  def check_record(self, config: Any) -> dict:
    """results.json's `check` of a run of this method (`Check.record`); `config` the run's
    resolved config (a ConfigDict or a nested dict) or its flattened form."""
    return self.check.record(dict(_leaves(config.to_dict() if hasattr(config, "to_dict")
                                          else config)))

  @property
  def block(self) -> str:
    """The config block the method reads: `config.<name>`, or `learner` for a method without a
    block of its own (Online-LoRA)."""
    return self.name if self.config is not None else "learner"


def _leaves(tree: Mapping, prefix: str = ""):
  """(dotted key, value) of every leaf of a nested config dict."""
  for key, value in tree.items():
    if isinstance(value, Mapping):
      yield from _leaves(value, f"{prefix}{key}.")
    else:
      yield f"{prefix}{key}", value
