"""olora-jax: Online-LoRA (Wei, Li, Marculescu, WACV 2025) in JAX/Flax, as a library.

The building blocks a researcher composes into their own loop (docs/extending.md walks through
one; `examples/custom_loop.py` is a runnable one). Shapes: B batch, K hard-buffer size, C
classes, D model width, r LoRA rank, (H, W) image size, T tasks. "Pure" means: no side effect,
the same inputs give the same outputs; the jitted learner functions also donate (consume) the
state they are given, as noted.

Model and LoRA
  ViTSpec, SwinSpec              static ViT / Swin sizes
  spec_from_config               the one of them a `model` config section names
  VisionTransformer              Flax ViT: (N, H, W, 3) float32 -> logits (N, C), `lora=` tree
  SwinTransformer                Flax Swin, the same call and LoRA tree layout (per stage width)
  init_lora, merge_into_backbone LoRA tree {block: {query|value: lora_a (D, r), lora_b (r, D)}}
                                 of either backbone; the exact merge W += A B (pure)
  load_pretrained                local timm safetensors / AugReg / big_vision file -> params
                                 (a Swin: timm or the authors' Online-LoRA file)
Learner (Online-LoRA's numerics, olora_jax.learner.online_lora)
  LearnerConfig, TrainState, Learner, make_learner, make_optimizer, split_params, init_frozen,
  init_train_state, init_buffer, lora_regulariser
  PlateauConfig, PlateauState, init_plateau, update_plateau   the loss window (host, pure)
  HardBuffer, BatchBuffer        the hard buffer (device arrays, static shapes)
Data
  Source, load_sources, split_arrays, domains_of   random-access splits (optional domain ids)
  Stream, EvaluationGroups, build_stream, disjoint_class_incremental, si_blurry,
  domain_incremental              task-free streams (ids per step; tasks for the evaluator only)
  make_batch, to_model_input     uint8 images -> padded float batches
Methods (one loop drives every method; docs/methods.md)
  Method, Context, StepReport    the interface: pure jitted init / train_step / predict over a
                                 state pytree, plus an optional host hook after each step
  methods                        the package; each method module declares a MethodSpec, and
                                 methods.resolve(name) finds the one a `method` key names
  MethodSpec                     what a method declares: name, build, config block, report name
Evaluation and metrics
  Evaluator, ClassCounts, group_accuracies          per-(domain, class) counts of `predict`
  metrics                        every metric as a pure function (a_final, forgetting, ...)
Whole runs
  train_and_evaluate(config, workdir)               what launch/run.py calls

The names load on first use (PEP 562): `import olora_jax.errors` or a launcher's flag check does
not pay for JAX, Flax and Orbax (about 1.4 s of imports), and `from olora_jax import
VisionTransformer` imports what that name needs.
"""

from __future__ import annotations

import importlib

# name -> (module, attribute in it; None: the module itself)
_EXPORTS = {
    "methods": ("olora_jax.methods", None),
    "metrics": ("olora_jax.metrics", None),
    "make_batch": ("olora_jax.data.preprocess", "make_batch"),
    "to_model_input": ("olora_jax.data.preprocess", "to_model_input"),
    **{name: ("olora_jax.data.sources", name)
       for name in ("Source", "domains_of", "load_sources", "split_arrays")},
    **{name: ("olora_jax.data.streams", name)
       for name in ("EvaluationGroups", "Stream", "build_stream", "disjoint_class_incremental",
                    "domain_incremental", "si_blurry")},
    **{name: ("olora_jax.evaluate", name)
       for name in ("ClassCounts", "Evaluator", "group_accuracies")},
    "BatchBuffer": ("olora_jax.learner.buffer", "BatchBuffer"),
    "HardBuffer": ("olora_jax.learner.buffer", "HardBuffer"),
    **{name: ("olora_jax.learner.online_lora", name)
       for name in ("Learner", "LearnerConfig", "TrainState", "init_buffer", "init_frozen",
                    "init_train_state", "lora_regulariser", "make_learner", "make_optimizer",
                    "split_params")},
    "PlateauConfig": ("olora_jax.learner.plateau", "PlateauConfig"),
    "PlateauState": ("olora_jax.learner.plateau", "PlateauState"),
    "init_plateau": ("olora_jax.learner.plateau", "init"),
    "update_plateau": ("olora_jax.learner.plateau", "update"),
    **{name: ("olora_jax.methods.base", name)
       for name in ("Context", "Method", "MethodSpec", "StepReport")},
    "spec_from_config": ("olora_jax.models", "spec_from_config"),
    "init_lora": ("olora_jax.models.lora", "init_lora"),
    "merge_into_backbone": ("olora_jax.models.lora", "merge_into_backbone"),
    "SwinSpec": ("olora_jax.models.swin", "SwinSpec"),
    "SwinTransformer": ("olora_jax.models.swin", "SwinTransformer"),
    "VisionTransformer": ("olora_jax.models.vit", "VisionTransformer"),
    "ViTSpec": ("olora_jax.models.vit", "ViTSpec"),
    "load_pretrained": ("olora_jax.pretrained", "load_pretrained"),
    "train_and_evaluate": ("olora_jax.trainer", "train_and_evaluate"),
}

__all__ = sorted(_EXPORTS)


def __getattr__(name: str):
  """Imports the module that defines `name` (one of __all__) the first time it is asked for."""
  if name not in _EXPORTS:
    raise AttributeError(f"module {__name__!r} has no attribute {name!r}")
  module, attribute = _EXPORTS[name]
  value = importlib.import_module(module)
  if attribute is not None:
    value = getattr(value, attribute)
  globals()[name] = value  # the next lookup is a plain one
  return value


def __dir__() -> list[str]:
  return sorted({*globals(), *_EXPORTS})
