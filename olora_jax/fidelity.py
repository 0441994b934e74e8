"""The `fidelity` switch: the paper's method or the authors' released code (docs/fidelity.md).

The paper and the released PyTorch code disagree in ten places, and the released code runs its
matmuls at PyTorch's CUDA precision. Each of these is its own config key, so an ablation can flip
any one of them; the top-level `config.fidelity` ('paper' | 'reference') only supplies the
default of every key left unset (None):

    key                               'paper'        'reference'   what it decides
    learner.buffer_unit               'sample'       'batch'       K samples or K whole batches
    learner.window_value              'mean'         'sum'         CE(buffer) as a mean or a sum
    learner.importance                'fisher'       'flat_softmax' per-sample Fisher or one
                                                                   gradient of a flattened softmax
    learner.merge                     'exact'        'factor_sum'  W += BA, or A_old += A and
                                                                   B_old += B
    learner.new_lora_init             'kaiming'      'zeros'       the LoRA started at a merge
    learner.reset_opt_state_at_merge  True           False         fresh Adam state for a new LoRA
    learner.check_partial_window      False          True          plateau check before the window
                                                                   is full
    learner.adam_bias_correction      'float32'      'exact'       Adam's 1 - b^t as optax.adam
                                                                   (float32) or as PyTorch (exact,
                                                                   olora_jax/learner/optim.py)
    data.input_scale                  'unit'         'unit'        pixels in [0, 1] ('signed':
                                                                   [-1, 1], big_vision's AugReg)
    data.core50_order                 'sequential'   'shuffled'    CORe50 sessions in order or
                                                                   shuffled together (i.i.d.)
    model.matmul_precision            'default'      'highest'     the model's matmuls and
                                                                   convolutions at JAX's default
                                                                   precision (TF32 on NVIDIA GPUs)
                                                                   or in full float32, as
                                                                   PyTorch's CUDA matmuls by
                                                                   default (docs/fidelity.md)

Usage (any single key can be flipped on its own, e.g. the released code's merge alone):

    .venv/bin/python launch/run.py --config configs/demo.py --workdir runs/ref \
        --config.fidelity=reference
    .venv/bin/python launch/run.py --config configs/demo.py --workdir runs/fs \
        --config.learner.merge=factor_sum

Threshold scale: in `reference` mode the window value is CE(current) + the sum of the K buffer
entries' CEs; in `paper` mode it is CE(current) + the *mean* buffer CE. On the same state the ratio
is about (K + 1) / 2, not K + 1: measured on the demo stream (K = 4, `reference` run with
`trace.enabled=True`, steps with a full buffer), (ce_current + ce_buffer) / (ce_current +
ce_buffer / K) has median 2.53 (10-90%: 2.46-2.70). Between the two modes' own runs on the demo
stream the reference window values are 1.49x (median) and 1.96x (mean) the paper ones, lower still
because the paper's buffer keeps the K hardest samples rather than the K hardest batches. So
divide reference thresholds by at most ~(K + 1) / 2 for paper mode (docs/replay.md).

`resolve` is the one pure function that turns a config into its resolved copy, validates every
fidelity key and refuses combinations that cannot learn, all before any compute. The trainer
writes the resolved config to config.json and `fidelity_record` into results.json.
"""

from __future__ import annotations

import ml_collections

FIDELITIES = ("paper", "reference")

# (section, key) -> {fidelity: default}. Every key is read by the code.
FIDELITY_DEFAULTS: dict[tuple[str, str], dict[str, object]] = {
    ("learner", "buffer_unit"): {"paper": "sample", "reference": "batch"},
    ("learner", "window_value"): {"paper": "mean", "reference": "sum"},
    ("learner", "importance"): {"paper": "fisher", "reference": "flat_softmax"},
    ("learner", "merge"): {"paper": "exact", "reference": "factor_sum"},
    ("learner", "new_lora_init"): {"paper": "kaiming", "reference": "zeros"},
    ("learner", "reset_opt_state_at_merge"): {"paper": True, "reference": False},
    ("learner", "check_partial_window"): {"paper": False, "reference": True},
    ("learner", "adam_bias_correction"): {"paper": "float32", "reference": "exact"},
    ("data", "input_scale"): {"paper": "unit", "reference": "unit"},
    ("data", "core50_order"): {"paper": "sequential", "reference": "shuffled"},
    ("model", "matmul_precision"): {"paper": "default", "reference": "highest"},
}

# The values each key accepts (booleans accept True / False).
ALLOWED_VALUES: dict[tuple[str, str], tuple] = {
    ("learner", "buffer_unit"): ("sample", "batch"),
    ("learner", "window_value"): ("mean", "sum"),
    ("learner", "importance"): ("fisher", "flat_softmax"),
    ("learner", "merge"): ("exact", "factor_sum"),
    ("learner", "new_lora_init"): ("kaiming", "zeros"),
    ("learner", "reset_opt_state_at_merge"): (True, False),
    ("learner", "check_partial_window"): (True, False),
    ("learner", "adam_bias_correction"): ("float32", "exact"),
    ("data", "input_scale"): ("unit", "signed"),
    ("data", "core50_order"): ("sequential", "shuffled"),
    ("model", "matmul_precision"): ("default", "highest"),
}


def fidelity_keys() -> tuple[str, ...]:
  """Dotted names of every key the fidelity switch sets, in docs/fidelity.md's row order."""
  return tuple(f"{section}.{key}" for section, key in FIDELITY_DEFAULTS)


def resolve(config: ml_collections.ConfigDict) -> ml_collections.ConfigDict:
  """A copy of `config` with every unset fidelity key filled from `config.fidelity`.

  Idempotent; raises ValueError on an unknown fidelity, a bad value, or a combination that
  cannot learn. The input is not modified.
  """
  if config.fidelity not in FIDELITIES:
    raise ValueError(f"unknown fidelity={config.fidelity!r}; use one of {FIDELITIES}")
  resolved = config.copy_and_resolve_references()
  for (section, key), defaults in FIDELITY_DEFAULTS.items():
    sub = resolved[section]
    if sub[key] is None:
      sub[key] = defaults[config.fidelity]
    allowed = ALLOWED_VALUES[(section, key)]
    value = sub[key]
    if isinstance(allowed[0], bool):
      if not isinstance(value, bool):
        raise ValueError(f"{section}.{key}={value!r} must be True or False")
    elif value not in allowed:
      raise ValueError(f"unknown {section}.{key}={value!r}; use one of {allowed}")
  _refuse_dead_lora(resolved.learner)
  return resolved


def _refuse_dead_lora(learner: ml_collections.ConfigDict) -> None:
  """A new LoRA with A = B = 0 has exactly zero gradients (dL/dA needs B, dL/dB needs A, and
  the regulariser's gradient Omega * W is 0 too); only Adam state carried over from the
  previous LoRA can move it. Resetting that state at a merge kills learning for good."""
  dead = (learner.incremental_lora and learner.new_lora_init == "zeros"
          and learner.reset_opt_state_at_merge)
  if dead and not learner.allow_dead_lora:
    raise ValueError(
        "learner.new_lora_init='zeros' with learner.reset_opt_state_at_merge=True: every LoRA"
        " after the first plateau has zero gradients forever and never learns; keep the"
        " optimizer state (reset_opt_state_at_merge=False), use new_lora_init='kaiming', or set"
        " learner.allow_dead_lora=True to run it anyway")


def fidelity_record(config: ml_collections.ConfigDict) -> dict:
  """{'fidelity': ..., 'learner.buffer_unit': ..., ...}: every resolved key, for results.json."""
  resolved = resolve(config)
  record = {"fidelity": resolved.fidelity}
  for section, key in FIDELITY_DEFAULTS:
    record[f"{section}.{key}"] = resolved[section][key]
  record["learner.allow_dead_lora"] = resolved.learner.allow_dead_lora
  return record
