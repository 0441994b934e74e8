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
"""

from olora_jax import methods, metrics
from olora_jax.data.preprocess import make_batch, to_model_input
from olora_jax.data.sources import Source, domains_of, load_sources, split_arrays
from olora_jax.data.streams import (
    EvaluationGroups,
    Stream,
    build_stream,
    disjoint_class_incremental,
    domain_incremental,
    si_blurry,
)
from olora_jax.evaluate import ClassCounts, Evaluator, group_accuracies
from olora_jax.learner.buffer import BatchBuffer, HardBuffer
from olora_jax.learner.online_lora import (
    Learner,
    LearnerConfig,
    TrainState,
    init_buffer,
    init_frozen,
    init_train_state,
    lora_regulariser,
    make_learner,
    make_optimizer,
    split_params,
)
from olora_jax.learner.plateau import PlateauConfig, PlateauState
from olora_jax.learner.plateau import init as init_plateau
from olora_jax.learner.plateau import update as update_plateau
from olora_jax.methods.base import Context, Method, MethodSpec, StepReport
from olora_jax.models import spec_from_config
from olora_jax.models.lora import init_lora, merge_into_backbone
from olora_jax.models.swin import SwinSpec, SwinTransformer
from olora_jax.models.vit import VisionTransformer, ViTSpec
from olora_jax.pretrained import load_pretrained
from olora_jax.trainer import train_and_evaluate

__all__ = [
    "BatchBuffer", "ClassCounts", "Context", "EvaluationGroups", "Evaluator", "HardBuffer",
    "Learner", "LearnerConfig", "Method", "MethodSpec", "PlateauConfig", "PlateauState", "Source",
    "StepReport", "Stream", "SwinSpec", "SwinTransformer", "TrainState",
    "ViTSpec", "VisionTransformer", "build_stream", "disjoint_class_incremental",
    "domain_incremental", "domains_of", "group_accuracies", "init_buffer", "init_frozen",
    "init_lora", "init_plateau", "init_train_state", "load_pretrained", "load_sources",
    "lora_regulariser", "make_batch", "make_learner", "make_optimizer", "merge_into_backbone",
    "methods", "metrics", "si_blurry", "split_arrays", "split_params", "spec_from_config",
    "to_model_input", "train_and_evaluate", "update_plateau",
]
