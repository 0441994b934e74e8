"""Refuse bad input before any compute: config values, config keys, and the data itself.

Every check raises `InputError` (a `ValueError`; the model/method check `models.ModelError`) with
one line that names the problem and the fix; `launch/run.py` turns it into exit code 2. The checks
run in `trainer.Setup`, before the workdir is created or touched, so a refused run writes and
damages nothing.

What is checked (issue 6):
  config keys      a key the reference config does not have (`check_known_keys`)
  config values    every float finite; seeds in [0, 2**32 - 1]; learning rate > 0,
                   1 <= rank <= model width, window >= 1, plateau thresholds > 0, batch >= 1,
                   buffer size >= 0, lambda >= 0, positive periods, the name of the scenario
                   and of data.preprocess,
                   the type of data.class_order, pretrained.keep_head only with a checkpoint
                   (fidelity names: olora_jax/fidelity.resolve; data.stream_manifest:
                   olora_jax/data/manifest.py; an explicit class order is checked against the
                   dataset's classes by olora_jax.data.streams), and the `method` name and its
                   config block (`check_method`)
  model and method a model that cannot run the method: the ResNet trained from scratch and a
                   method that does not train the whole model (`check_model_supports_method`)
  data             images uint8 (N, H, W, 1|3); integer labels in [0, num_classes)
                   (`check_source`)
Dataset names and "not prepared" datasets are refused by `olora_jax.data.sources.load_source`,
missing or malformed pretrained checkpoints by `olora_jax.pretrained`, both before any compute.
"""

from __future__ import annotations

import difflib
import importlib.util
import math
from collections.abc import Collection, Mapping, Sequence

import ml_collections
import numpy as np

from olora_jax import errors
from olora_jax.data.preprocess import PREPROCESS_MODES
from olora_jax.data.streams import SCENARIOS
from olora_jax.models import ModelError, resnet
from olora_jax.models.vit import COMPUTE_DTYPES, spec_from_config


class InputError(errors.BadInput):
  """A bad config value, config key or dataset, found before any compute."""


def flatten(tree: Mapping | ml_collections.ConfigDict, prefix: str = "") -> dict:
  """A nested config as one dict with dotted keys (`learner.rank`)."""
  if isinstance(tree, ml_collections.ConfigDict):
    tree = tree.to_dict()
  out = {}
  for k, v in tree.items():
    if isinstance(v, Mapping):
      out.update(flatten(v, f"{prefix}{k}."))
    else:
      out[f"{prefix}{k}"] = v
  return out


def flat_keys(tree: Mapping | ml_collections.ConfigDict) -> set[str]:
  """Every leaf key of a nested config, dotted (`learner.rank`)."""
  return set(flatten(tree))


# Keys that were renamed or replaced: old key -> what to give instead.
RENAMED_KEYS = {
    "mvp.query_before_norm": "mvp.query ('last_norm' for the old False, 'last' for True; the"
                             " default 'penultimate' is the authors' script's query)",
    "coda_prompt.n_blocks": "coda_prompt.n_tasks (the pool is split into that many blocks; 0:"
                            " data.n_tasks)",
}


def unknown_keys_message(unknown: list[str], known: Collection[str] = (), where: str = "") -> str:
  """The one line that refuses unknown keys, naming the replacement of a renamed one, else the
  nearest `known` keys (a misspelling's); `where` ('set at FILE:LINE') says where they were
  given."""
  given = ", ".join(unknown) + (f" {where}" if where else "")
  renamed = [f"{k} is now {RENAMED_KEYS[k]}" for k in unknown if k in RENAMED_KEYS]
  if renamed:
    return f"unknown config key(s) {given}: {'; '.join(renamed)}"
  nearest = list(dict.fromkeys(m for k in unknown for m in nearest_keys(k, known)))
  meant = f" (did you mean {' or '.join(nearest)}?)" if nearest else ""
  return (f"unknown config key(s) {given}: no code reads them; fix the spelling{meant} or"
          " remove them (the keys are listed in configs/common.py)")


def nearest_keys(key: str, known: Collection[str]) -> list[str]:
  """The `known` dotted key nearest to `key` (a misspelt key's likely intent): in its own block
  when that block exists, else by the whole path; for a bare name (its block not known), the
  nearest last name of a known key; [] when none is close."""
  block = key.rpartition(".")[0]
  if not block:
    return difflib.get_close_matches(key, sorted({k.rpartition(".")[2] for k in known}), n=1,
                                     cutoff=0.8)
  for pool in ([k for k in known if k.rpartition(".")[0] == block], known):
    nearest = difflib.get_close_matches(key, sorted(pool), n=1, cutoff=0.8)
    if nearest:
      return nearest
  return []


def check_known_keys(config: ml_collections.ConfigDict,
                     reference: ml_collections.ConfigDict) -> None:
  """Refuses keys that `reference` (configs/common.py) does not define: nothing reads them."""
  known = flat_keys(reference)
  unknown = sorted(flat_keys(config) - known)
  if unknown:
    raise InputError(unknown_keys_message(unknown, known))


def _require(ok: bool, message: str) -> None:
  if not ok:
    raise InputError(message)


# Seeds feed jax.random.key and NumPy's generators: non-negative and within 64 bits there, kept
# to 32 bits so every consumer (and a C `unsigned int` in other codebases) takes them as they are.
MAX_SEED = 2**32 - 1


def check_model_supports_method(config: ml_collections.ConfigDict) -> None:
  """Refuses (one line, before any compute) `model.name=resnet18_reduced` with what it cannot
  run: a pretrained checkpoint (it is trained from scratch), and any method that does not train
  the whole model (`<method block>.trainable='all'`): Online-LoRA, the LoRA, prompt and adapter
  methods, and those that read a pretrained backbone's features (SLDA, RanPAC, SimpleCIL).
  Raises `models.ModelError`. Here, where the model and the method registry meet: models/
  never imports the registry."""
  if config.model.name != resnet.NAME:
    return
  method = config.method
  block = config.get(method) if isinstance(method, str) and ":" not in method else None
  trainable = block.get("trainable") if block is not None else None
  if method == "online_lora" or trainable != "all":
    if method == "online_lora":
      why = "adds LoRA to a pretrained transformer's attention"
    elif trainable is None:
      why = "trains no whole model (it reads a pretrained backbone's features)"
    else:
      why = f"trains {trainable!r}, not the whole model"
    whole = trainable is not None and _default_trainable(method) == "all"
    fix = f"set {method}.trainable='all'" if whole else "use a ViT or Swin model.name for it"
    raise ModelError(
        f"method={method!r} {why}, and model.name={resnet.NAME!r} is trained from scratch by"
        f" the methods that train the whole model; {fix}, or run a whole-model method (er,"
        f" der_pp, finetune, ...) on the ResNet")
  if config.pretrained.path:
    raise ModelError(
        f"pretrained.path={config.pretrained.path!r}: model.name={resnet.NAME!r} is trained from"
        " scratch and reads no checkpoint; set pretrained.path='' (or use a ViT/Swin model.name)")


def _default_trainable(method: str):
  from olora_jax import methods  # here: the methods import the learner, not validation

  block = methods.resolve(method).config
  return block().get("trainable") if block is not None else None


def check_config(config: ml_collections.ConfigDict, width: int) -> None:
  """Checks every value the run depends on; `width` is the model width (bounds the rank)."""
  c, lr = config, config.learner
  check_model_supports_method(c)  # a model that cannot run the method: refused first
  for key, value in flatten(c).items():
    if isinstance(value, float) and not math.isfinite(value):
      raise InputError(f"{key}={value} must be a finite number; give a real value")
  for key in ("seed", "data.split_seed"):
    value = flatten(c)[key]
    _require(isinstance(value, int) and not isinstance(value, bool) and 0 <= value <= MAX_SEED,
             f"{key}={value!r} must be an integer in [0, {MAX_SEED}]; seeds are 0, 1, 2, ...")
  _require(0 <= lr.max_skipped_fraction <= 1,
           f"learner.max_skipped_fraction={lr.max_skipped_fraction} must be in [0, 1] (a"
           " fraction of the stream's steps)")
  _require(lr.learning_rate > 0,
           f"learner.learning_rate={lr.learning_rate} must be > 0 (the paper uses 2e-4)")
  _require(1 <= lr.rank <= width,
           f"learner.rank={lr.rank} must be in [1, width={width}]; the paper uses 4")
  _require(lr.window >= 1, f"learner.window={lr.window} must be >= 1 (the paper uses 5)")
  _require(lr.mean_threshold > 0, f"learner.mean_threshold={lr.mean_threshold} must be > 0")
  _require(lr.var_threshold > 0, f"learner.var_threshold={lr.var_threshold} must be > 0")
  _require(lr.batch_size >= 1, f"learner.batch_size={lr.batch_size} must be >= 1")
  _require(0 <= c.data.validation_fraction < 1,
           f"data.validation_fraction={c.data.validation_fraction} must be in [0, 1) (0: evaluate"
           " on the test set; launch/sweep.py --tune uses 0.1)")
  _require(lr.buffer_size >= 0, f"learner.buffer_size={lr.buffer_size} must be >= 0")
  _require(lr.reg_lambda >= 0, f"learner.reg_lambda={lr.reg_lambda} must be >= 0")
  _require(c.model.compute_dtype in COMPUTE_DTYPES,
           f"model.compute_dtype={c.model.compute_dtype!r} must be one of"
           f" {sorted(COMPUTE_DTYPES)}; bfloat16 pays off on GPUs and TPUs")
  _require(isinstance(c.sharding.fsdp, int) and c.sharding.fsdp >= 1,
           f"sharding.fsdp={c.sharding.fsdp!r} must be an integer >= 1 (1: no weight sharding)")
  _require(c.data.n_tasks >= 1, f"data.n_tasks={c.data.n_tasks} must be >= 1")
  _require(c.eval.eval_every >= 1, f"eval.eval_every={c.eval.eval_every} must be >= 1")
  _require(c.eval.batch_size >= 1, f"eval.batch_size={c.eval.batch_size} must be >= 1")
  _require(c.log_every >= 1, f"log_every={c.log_every} must be >= 1")
  problem = check_loggers(c.loggers)
  _require(problem is None, problem)
  _require(isinstance(c.logger_project, str) and c.logger_project.strip() != "",
           f"logger_project={c.logger_project!r} must name a W&B project / MLflow experiment,"
           " e.g. 'olora-jax'")
  for key in ("logger_group", "logger_dir"):
    _require(isinstance(c[key], str), f"{key}={c[key]!r} must be a string ('' = none)")
  _require(c.checkpoint_every >= 0,
           f"checkpoint_every={c.checkpoint_every} must be >= 0 (0: only at the end and on"
           " SIGTERM/SIGINT)")
  _require(c.max_to_keep >= 1,
           f"max_to_keep={c.max_to_keep} must be >= 1 (keep 2 or more to survive a damaged one)")
  _require(not c.pretrained.keep_head or bool(c.pretrained.path),
           "pretrained.keep_head=True needs a checkpoint: set pretrained.path (or keep_head=False)")
  _require(c.data.scenario in SCENARIOS,
           f"unknown data.scenario={c.data.scenario!r}; use one of {SCENARIOS}")
  order = c.data.class_order
  _require(isinstance(order, (str, list, tuple)),
           f"data.class_order={order!r} must be 'label', 'seeded' or a list of class ids")
  _require(c.data.preprocess in PREPROCESS_MODES,
           f"unknown data.preprocess={c.data.preprocess!r}; use one of {PREPROCESS_MODES}"
           " ('host': PIL on the host, as before; 'device': uint8 batches preprocessed by JAX)")
  _require(isinstance(c.data.dataset, str) and c.data.dataset != "",
           f"data.dataset={c.data.dataset!r} must name a dataset or a 'module:function'")
  check_method(c, width)


TRAINABLE = ("all", "head", "lora", "prompts")
# The methods that read data.replay_draws.
GIVEN_DRAWS_METHODS = ("er", "er_ace", "der_pp", "ema_der_pp", "ema_rar", "agem", "mir",
                       "pcr", "lode")
OPTIMIZERS = ("adam", "sgd")  # methods/common.py OPTIMIZERS
REPLAY_PASSES = ("joint", "separate")  # methods/er.py REPLAY_PASSES
ER_ACE_HEADS = ("cosine", "linear")  # methods/er_ace.py HEADS
LODE_NEW_CLASSES = ("batch", "unseen")  # methods/lode.py NEW_CLASSES
BOUNDARY_RULES = ("none", "oracle", "plateau")


def check_boundaries(b: ml_collections.ConfigDict, method: str) -> None:
  """The boundary switch's block (olora_jax/boundaries.py)."""
  _require(b.rule in BOUNDARY_RULES,
           f"unknown boundaries.rule={b.rule!r}; use one of {BOUNDARY_RULES}")
  _require(method != "online_lora" or b.rule == "none",
           f"boundaries.rule={b.rule!r}: Online-LoRA finds its own boundaries (its plateaus,"
           " set by learner.window, .mean_threshold, .var_threshold); keep boundaries.rule="
           "'none' with it")
  _require(isinstance(b.window, int) and b.window >= 1,
           f"boundaries.window={b.window!r} must be an integer >= 1 (Online-LoRA's: 5)")
  for key in ("mean_threshold", "var_threshold"):
    _require(b[key] > 0, f"boundaries.{key}={b[key]} must be > 0")


def check_method(config: ml_collections.ConfigDict, width: int | None = None) -> None:
  """The `method` name and the values of its config block (declared by its module); `width`,
  the model width, bounds a block's LoRA `rank` when given."""
  from olora_jax import methods  # here: the methods import the learner, not validation

  try:
    spec = methods.resolve(config.method)
  except ValueError as e:  # an unknown name, or a method file that cannot be used
    raise InputError(str(e)) from None
  check_boundaries(config.boundaries, spec.name)
  _require(not config.data.replay_draws or spec.name in GIVEN_DRAWS_METHODS,
           f"data.replay_draws is read by {', '.join(GIVEN_DRAWS_METHODS[:-1])} and"
           f" {GIVEN_DRAWS_METHODS[-1]} only; with"
           f" method={spec.name!r} leave it ''")
  if spec.name == "online_lora":  # its block is `learner`, checked above
    return
  name = spec.name
  if spec.config is None:  # a method outside the package without a block of its own
    return
  _require(name in config, f"method={config.method!r} reads the config block {name!r}, which"
           " the config lacks; build the config with configs.common.get_config(method=...)")
  for key in ("trace.enabled", "export_online_lora"):  # Online-LoRA's own outputs
    _require(not flatten(config)[key],
             f"{key}=True is Online-LoRA's; with method={name!r} set it to False")
  b, p = config[name], f"{name}."
  values = b.to_dict()
  _check_choices(p, name, values)
  _check_trainable_and_prompt_pool(config, b, p, name, values)
  _check_lora_branches(b, p, name, values, width)
  _check_learning_rate(b, p, values)
  _check_replay(config, b, p, values)
  _check_regularisers(b, p, name, values)
  _check_mvp_keys_and_query(config, b, p, values)
  _check_schedule(b, p, values)
  if "margin" in values:  # MVP's feature scale 1 - cos + m must stay positive
    _require(b.margin > 0, f"{p}margin={b.margin} must be > 0 (the paper: 0.5)")
  _check_slca(b, p, values)
  _check_hide_prompt(b, p, values)
  _check_simplecil_first_phase(b, p, values)
  _check_slda_and_ranpac(b, p, values)
  _check_lwf_and_onpro(b, p, values)
  _check_shared_bounds(p, values)


def _check_choices(p: str, name: str, values: dict) -> None:
  """The block's named choices: its optimizer, ER's replay pass, ER-ACE's head, LODE's new
  classes."""
  for key, allowed in (("optimizer", OPTIMIZERS), ("replay_pass", REPLAY_PASSES),
                       ("head", ER_ACE_HEADS), ("new_classes", LODE_NEW_CLASSES)):
    if key in values and (key != "head" or name == "er_ace"):
      _require(values[key] in allowed,
               f"unknown {p}{key}={values[key]!r}; use one of {allowed}")


def _check_trainable_and_prompt_pool(config: ml_collections.ConfigDict, b, p: str, name: str,
                                     values: dict) -> None:
  """What the block trains (`trainable`), and the prompt methods' pool: its sizes, `top_k` and
  the prefix methods' layers."""
  # L2P, MVP, DualPrompt, CODA-Prompt: they train a prompt pool and the head
  prompt_method = "pool_size" in values
  # A training-free method (simplecil, slda, ranpac) has no `trainable` nor `learning_rate`.
  if "trainable" in values:
    _require(b.trainable in TRAINABLE,
             f"unknown {p}trainable={b.trainable!r}; use one of {TRAINABLE}")
  trainable = values.get("trainable")
  _require(prompt_method == (trainable == "prompts"),
           f"{p}trainable={trainable!r}: 'prompts' (a prompt pool and the head on the frozen"
           f" backbone) is what the prompt methods train and only they; use"
           f" {'prompts' if prompt_method else 'all, head or lora'}")
  if prompt_method:
    _require(min(b.pool_size, b.prompt_length) >= 1,
             f"{p}pool_size={b.pool_size} and {p}prompt_length={b.prompt_length} must be >= 1"
             " (the paper: 10 and 10)")
    if "top_k" in values:  # CODA-Prompt weighs every component instead of selecting
      _require(1 <= b.top_k <= b.pool_size - (name == "mvp"),
               f"{p}top_k={b.top_k} must be in [1, {p}pool_size{' - 1' * (name == 'mvp')}]"
               " (MVP's key loss contrasts a selected key with the other keys)")
    _check_prefix_layers(config, b, p)


def _check_lora_branches(b, p: str, name: str, values: dict, width: int | None) -> None:
  """InfLoRA's, SD-LoRA's and EASE's own LoRA branches: their rank (at most `width`, when given),
  the number of tasks (CODA-Prompt's and SLCA's too) and InfLoRA's DualGPM threshold schedule."""
  if "rank" in values:  # InfLoRA, SD-LoRA: LoRA branches of their own rank, and the head
    _require(b.trainable == "lora", f"{p}trainable={b.trainable!r}: {name} trains its LoRA"
             " branches and the head; use 'lora'")
    _require(isinstance(b.rank, int) and 1 <= b.rank <= (width or b.rank),
             f"{p}rank={b.rank!r} must be an integer in [1, model width={width}] (the paper:"
             " 10)")
  if "n_tasks" in values:
    _require(isinstance(b.n_tasks, int) and b.n_tasks >= 0,
             f"{p}n_tasks={b.n_tasks!r} must be an integer >= 0 (0: data.n_tasks)")
  if "threshold_start" in values:  # InfLoRA's DualGPM threshold schedule
    _require(0 < b.threshold_start <= b.threshold_end <= 1,
             f"{p}threshold_start={b.threshold_start} and {p}threshold_end={b.threshold_end}"
             " must satisfy 0 < start <= end <= 1 (the paper's ImageNet-R: 0.98 and 1.0)")


def _check_learning_rate(b, p: str, values: dict) -> None:
  """The block's learning rate, its weight decay and GDumb's cosine floor."""
  if "learning_rate" in values:
    _require(b.learning_rate > 0, f"{p}learning_rate={b.learning_rate} must be > 0")
  if "weight_decay" in values:
    _require(b.weight_decay >= 0, f"{p}weight_decay={b.weight_decay} must be >= 0")
  if "min_learning_rate" in values:
    _require(0 < b.min_learning_rate <= b.learning_rate,
             f"{p}min_learning_rate={b.min_learning_rate} must be in (0, {p}learning_rate]")


def _check_replay(config: ml_collections.ConfigDict, b, p: str, values: dict) -> None:
  """The replay buffer: its size, the replayed batch and MIR's candidates."""
  if "buffer_size" in values:
    _require(b.buffer_size >= 1, f"{p}buffer_size={b.buffer_size} must be >= 1 (the paper"
             " uses 500)")
  if "replay_batch" in values:  # 0: the learner's batch size (methods/common.py replay_batch)
    replayed = b.replay_batch or config.learner.batch_size
    _require(b.replay_batch >= 0 and replayed <= b.buffer_size,
             f"{p}replay_batch={b.replay_batch} must be in [1, {p}buffer_size={b.buffer_size}],"
             f" or 0 for the learner's batch size (here {config.learner.batch_size}, which must"
             f" not exceed {p}buffer_size)")
  if "n_candidates" in values:
    _require((b.replay_batch or config.learner.batch_size) <= b.n_candidates <= b.buffer_size,
             f"{p}n_candidates={b.n_candidates} must be in [{p}replay_batch,"
             f" {p}buffer_size]; the paper uses 50")


def _check_regularisers(b, p: str, name: str, values: dict) -> None:
  """EWC++'s Fisher normalisation, the loss weights (>= 0) and `alpha` (DER++, EWC++, MVP, EASE)."""
  if "fisher_normalisation" in values:  # EWC++ (methods/ewc_pp.py NORMALISATIONS)
    _require(b.fisher_normalisation in ("min_max", "none"),
             f"unknown {p}fisher_normalisation={b.fisher_normalisation!r}; use 'min_max' (the"
             " source code's, default) or 'none' (the raw Fisher)")
  for key, allowed in (("consolidate", ("period", "boundary")), ("fisher_of", ("ce", "loss")),
                       ("fisher_window", ("stream", "task"))):  # EWC++'s (methods/ewc_pp.py)
    if key in values:
      _require(values[key] in allowed, f"unknown {p}{key}={values[key]!r}; use one of {allowed}"
               f" ({allowed[0]!r}, the default, or {allowed[1]!r}, the online-continual-"
               "learning code's)")
  for key in ("reg_lambda", "beta", "clip_norm", "key_loss_weight", "gamma", "ortho_weight"):
    if key in values:
      _require(values[key] >= 0, f"{p}{key}={values[key]} must be >= 0")
  if "alpha" in values:  # DER++'s logit weight, EWC++'s running-average weight in (0, 1], or
    # MVP's weight of the focal term in [0, 1]
    upper = 1.0 if name in ("ewc_pp", "mvp") else float("inf")
    _require(0 <= b.alpha <= upper, f"{p}alpha={b.alpha} must be in [0, {upper}]")


def _check_mvp_keys_and_query(config: ml_collections.ConfigDict, b, p: str, values: dict) -> None:
  """MVP's key initialisation and the query feature it reads (on a model deep enough for it)."""
  if "key_init" in values:  # MVP's keys (methods/prompt_pool.py KEY_INITS)
    _require(b.key_init in ("uniform", "normal"),
             f"unknown {p}key_init={b.key_init!r}; use 'uniform' (L2P's) or 'normal' (the"
             " authors' code)")
  if "query" in values:  # MVP's query (methods/prompt_pool.py QUERIES)
    _require(b.query in ("penultimate", "last", "last_norm"),
             f"unknown {p}query={b.query!r}; use 'penultimate' (the authors' script), 'last'"
             " (their use_last_layer) or 'last_norm' (L2P's)")
    _require(b.query != "penultimate" or config.model.name.startswith("swin")
             or spec_from_config(config.model).depth >= 2,
             f"{p}query='penultimate' reads the class token after block depth - 2 and needs"
             " model.depth >= 2; use 'last' on a one-block model")


def _check_schedule(b, p: str, values: dict) -> None:
  """The learning rate's scaling with the batch, MVP's updates per batch and the upper bound's
  schedule."""
  if "lr_reference_batch" in values:  # the linear learning-rate scaling (common.batch_scale)
    _require(isinstance(b.lr_reference_batch, int) and b.lr_reference_batch >= 0,
             f"{p}lr_reference_batch={b.lr_reference_batch!r} must be an integer >= 0 (the batch"
             " the authors set their rate at; 0: learning_rate unscaled)")
  if "updates_per_batch" in values:
    _require(isinstance(b.updates_per_batch, int) and b.updates_per_batch >= 1,
             f"{p}updates_per_batch={b.updates_per_batch!r} must be an integer >= 1 (the"
             " authors' script: 3)")
  if "schedule" in values:  # the upper bound's learning rate (methods/finetune.py)
    _require(b.schedule in ("constant", "cosine"),
             f"unknown {p}schedule={b.schedule!r}; use 'constant' or 'cosine'")


def _check_slca(b, p: str, values: dict) -> None:
  """SLCA's classifier alignment (methods/slca.py)."""
  if "alignment" in values:  # SLCA's classifier alignment (methods/slca.py)
    _require(b.alignment in ("every_evaluation", "after_boundary", "none"),
             f"unknown {p}alignment={b.alignment!r}; use 'every_evaluation' (ours),"
             " 'after_boundary' (the authors') or 'none' (the slow learner alone)")
    for key in ("alignment_epochs", "samples_per_class"):
      _require(isinstance(b[key], int) and b[key] >= 1,
               f"{p}{key}={b[key]!r} must be an integer >= 1 (the authors': 5 and 256)")
    _require(b.backbone_lr_scale >= 0 and b.logit_norm_temperature >= 0,
             f"{p}backbone_lr_scale={b.backbone_lr_scale} and {p}logit_norm_temperature="
             f"{b.logit_norm_temperature} must be >= 0 (the authors': 0.01 and 0.1)")
    _require(b.alignment_learning_rate > 0 and b.covariance_shrinkage > 0,
             f"{p}alignment_learning_rate={b.alignment_learning_rate} and"
             f" {p}covariance_shrinkage={b.covariance_shrinkage} must be > 0 (the authors': 0.01"
             " and 1e-4)")


def _check_hide_prompt(b, p: str, values: dict) -> None:
  """HiDe-Prompt's alignment, task-identity inference and prompt training
  (methods/hide_prompt.py)."""
  if "tii_hidden_ratio" in values:  # HiDe-Prompt (methods/hide_prompt.py)
    _require(b.align in ("every_evaluation", "none"),
             f"unknown {p}align={b.align!r}; use 'every_evaluation' (ours) or 'none'")
    _require(0 <= b.prompt_momentum < 1, f"{p}prompt_momentum={b.prompt_momentum} must be in"
             " [0, 1) (the authors': 0.01)")
    _require(isinstance(b.tii_hidden_ratio, int) and b.tii_hidden_ratio >= 0,
             f"{p}tii_hidden_ratio={b.tii_hidden_ratio!r} must be an integer >= 0 (the"
             " authors': 2; 0: a linear layer)")
    for key in ("tap_epochs", "tap_samples_per_class", "tii_alignment_epochs",
                "tii_samples_per_class"):
      _require(isinstance(b[key], int) and b[key] >= 1,
               f"{p}{key}={b[key]!r} must be an integer >= 1")
    for key in ("head_lr_scale", "tii_learning_rate", "tap_learning_rate",
                "tii_alignment_learning_rate", "contrastive_temperature",
                "covariance_shrinkage"):
      _require(b[key] > 0, f"{p}{key}={b[key]} must be > 0")
    for key in ("contrastive_weight", "alignment_weight_decay"):
      _require(b[key] >= 0, f"{p}{key}={b[key]} must be >= 0")


def _check_simplecil_first_phase(b, p: str, values: dict) -> None:
  """SimpleCIL's APER variant: what its first phase adapts and how (methods/simplecil.py)."""
  if "first_phase" in values:  # SimpleCIL's APER variant: what its first phase adapts
    _require(b.first_phase in ("none", "lora", "all"),
             f"unknown {p}first_phase={b.first_phase!r}; use 'none' (SimpleCIL), 'lora' or"
             " 'all' (APER: adapted until the first boundary)")
  if "first_phase_head" in values:  # APER's first phase (methods/simplecil.py)
    _require(b.first_phase_head in ("cosine", "linear"),
             f"unknown {p}first_phase_head={b.first_phase_head!r}; use 'cosine' (the authors')"
             " or 'linear'")
    _require(b.first_phase_optimizer in ("sgd", "adam"),
             f"unknown {p}first_phase_optimizer={b.first_phase_optimizer!r}; use 'sgd' (the"
             " authors', momentum 0.9) or 'adam'")
    steps = b.first_phase_cosine_steps
    _require(isinstance(steps, int) and steps >= 0,
             f"{p}first_phase_cosine_steps={steps!r} must be an integer >= 0 (0: a constant"
             " learning rate)")


def _check_slda_and_ranpac(b, p: str, values: dict) -> None:
  """SLDA's covariance shrinkage, RanPAC's ridge grid and held-out share."""
  if "shrinkage" in values:  # SLDA's epsilon: the shrunk covariance must stay invertible
    _require(0 < b.shrinkage <= 1, f"{p}shrinkage={b.shrinkage} must be in (0, 1] (the paper:"
             " 1e-4)")
  if "log10_ridge_min" in values:  # RanPAC's lambda grid 10^min .. 10^max
    lo, hi = b.log10_ridge_min, b.log10_ridge_max
    _require(all(isinstance(k, int) and not isinstance(k, bool) for k in (lo, hi)) and lo <= hi,
             f"{p}log10_ridge_min={lo!r} and {p}log10_ridge_max={hi!r} must be integers with"
             " min <= max (the released code: -8 and 8)")
  if "holdout_every" in values:
    _require(b.holdout_every >= 2, f"{p}holdout_every={b.holdout_every} must be >= 2 (5: every"
             " fifth sample held out, 20%)")


def _check_lwf_and_onpro(b, p: str, values: dict) -> None:
  """LwF's teacher period and distillation weight, OnPro's mixup rates."""
  if "refresh_every" in values:  # LwF's teacher period (methods/lwf.py)
    _require(isinstance(b.refresh_every, int) and b.refresh_every >= 0,
             f"{p}refresh_every={b.refresh_every!r} must be an integer >= 0 (0: refresh only at"
             " the boundaries of boundaries.rule)")
  for key in ("mixup_base_rate", "mixup_p", "mixup_upper"):  # OnPro's APF (methods/onpro.py)
    if key in values:
      _require(0 <= values[key] <= 1, f"{p}{key}={values[key]} must be in [0, 1]")
  if "kd_weight" in values:  # LwF's lambda_o (0: the codebase's 1/(n+1) weighting)
    _require(b.kd_weight >= 0, f"{p}kd_weight={b.kd_weight} must be >= 0")


def _check_shared_bounds(p: str, values: dict) -> None:
  """The keys several blocks share, by their bound: counts >= 1, temperatures > 0, warm-ups >= 0
  and EMA decays in [0, 1)."""
  for key in ("fisher_every", "epochs", "repeats", "projection_dim", "refit_every",
              "draw_per_class"):
    if key in values:
      _require(values[key] >= 1, f"{p}{key}={values[key]} must be >= 1")
  for key in ("temperature", "c", "proto_temperature", "instance_temperature", "mixup_alpha"):
    if key in values:
      _require(values[key] > 0, f"{p}{key}={values[key]} must be > 0")
  for key in ("warmup_batches", "rho", "ema_warmup_steps"):
    if key in values:
      _require(values[key] >= 0, f"{p}{key}={values[key]} must be >= 0")
  for key in ("ema_decay", "ema_warmup_decay"):
    if key in values:
      _require(0 <= values[key] < 1, f"{p}{key}={values[key]} must be in [0, 1); the paper uses"
               " 0.99 (0.9 during warm-up)")


def _check_prefix_layers(config: ml_collections.ConfigDict, b, p: str) -> None:
  """The prefix-tuning prompt methods' layer lists and sizes (DualPrompt, CODA-Prompt)."""
  if config.model.name.startswith("swin"):  # prompt methods are ViT-only: refused with the model
    return
  depth = spec_from_config(config.model).depth
  for key in ("layers", "g_layers", "e_layers"):
    if key in b:
      layers = list(b[key])
      _require(len(layers) >= 1 and len(set(layers)) == len(layers)
               and all(isinstance(i, int) and 0 <= i < depth for i in layers),
               f"{p}{key}={tuple(layers)} must be distinct block indices in [0, model.depth="
               f"{depth}); a shallower model takes fewer, e.g. {p}{key}=(0,)")
  if "train_mask" in b:
    _require(b.train_mask in ("none", "task"),
             f"{p}train_mask={b.train_mask!r} must be 'none' (every class) or 'task' (the"
             " classes seen since the last boundary)")
  if "g_prompt_length" in b:
    _require(b.g_prompt_length >= 1, f"{p}g_prompt_length={b.g_prompt_length} must be >= 1 (the"
             " paper: 5)")
  if "ortho_weight" in b:  # CODA-Prompt: one block of pool_size // n_tasks components per task
    n_tasks = b.n_tasks or config.data.n_tasks
    _require(b.pool_size >= n_tasks,
             f"{p}pool_size={b.pool_size} must be >= the number of tasks {n_tasks}"
             f" ({p}n_tasks, 0: data.n_tasks): each task takes pool_size // n_tasks components"
             " (the paper: 100 components, 10 tasks)")
    width = spec_from_config(config.model).width
    _require(b.pool_size <= width,
             f"{p}pool_size={b.pool_size} must be <= model.width={width}: the components' keys"
             " are initialised orthogonal in width dimensions; take a smaller pool")
    _require(b.prompt_length % 2 == 0,
             f"{p}prompt_length={b.prompt_length} must be even (half key, half value prefix;"
             " the paper: 8)")


def check_source(labels: np.ndarray, images: np.ndarray, num_classes: int, what: str) -> None:
  """Checks one split: all its labels are integers in [0, num_classes); `images` (a sample of the
  split, as `Source.get` returns it) are uint8 NHWC with 1 or 3 channels. A wrong shape is named
  as the split's (N = its number of labels), not the sample's."""
  images, labels = np.asarray(images), np.asarray(labels)
  _require(images.dtype == np.uint8,
           f"{what}: images must be uint8, got {images.dtype}; store 8-bit pixels (0..255)")
  shape = (len(labels), *images.shape[1:]) if images.ndim else images.shape
  _require(images.ndim == 4 and images.shape[-1] in (1, 3),
           f"{what}: images must be (N, H, W, 1|3), got shape {shape}; convert them to"
           " grey or RGB NHWC")
  _require(labels.ndim == 1, f"{what}: labels must be 1-d, got shape {labels.shape}")
  _require(np.issubdtype(labels.dtype, np.integer),
           f"{what}: labels must be integers, got {labels.dtype}; map class names to 0..C-1")
  if len(labels):
    lo, hi = int(labels.min()), int(labels.max())
    _require(0 <= lo and hi < num_classes,
             f"{what}: labels span [{lo}, {hi}] but must lie in [0, {num_classes}); relabel"
             " the classes as 0..C-1")


def check_class_count(num_classes: int, labels: Sequence[np.ndarray], what: str) -> None:
  """Refuses more classes than examples (`labels`: each split's): a dataset whose classes are
  1 + its largest label (a user dataset's) with a stray label far out (10^12) would size every
  per-class array of the stream, the head and the metrics by it."""
  n = sum(len(x) for x in labels)
  if num_classes <= n:
    return
  present = np.unique(np.concatenate([np.asarray(x).reshape(-1) for x in labels]))
  raise InputError(
      f"{what}: {num_classes} classes (0..{num_classes - 1}), more than its {n} examples"
      f" ({len(present)} distinct labels, the largest {int(present.max())}); relabel the classes"
      " as 0..C-1, e.g. classes, labels = np.unique(labels, return_inverse=True)")


# The `loggers` key (olora_jax/loggers.py writes what it names).
LOGGERS = ("tensorboard", "wandb", "mlflow")
# The package each logger needs (olora_jax/loggers.py), and the extra of olora-jax that installs it.
PACKAGES = {"tensorboard": "tensorboardX", "wandb": "wandb", "mlflow": "mlflow"}


def parse_loggers(value) -> tuple[str, ...]:
  """The `loggers` config value ('tensorboard,wandb', a list, or '' / 'none') as names."""
  if isinstance(value, str):
    names = [n.strip() for n in value.split(",")]
  else:
    names = [str(n).strip() for n in value]
  return tuple(dict.fromkeys(n for n in names if n and n != "none"))


def check_loggers(value) -> str | None:
  """None when every logger in `value` is known and, except TensorBoard (optional by default),
  installed; else the one line that says what is wrong and how to fix it."""
  try:
    names = parse_loggers(value)
  except TypeError:
    names = (value,)
  unknown = [n for n in names if n not in LOGGERS]
  if unknown:
    return (f"loggers={value!r} names unknown logger(s) {unknown}; use a comma-separated subset"
            f" of {','.join(LOGGERS)}, or '' for metrics.jsonl alone")
  for name in names:
    if name != "tensorboard" and importlib.util.find_spec(PACKAGES[name]) is None:
      return (f"loggers={value!r} names {name}, but {PACKAGES[name]} is not installed: pip"
              f" install 'olora-jax[{name}]' (or leave {name} out of --config.loggers)")
  return None
