"""Shared defaults of every setting: Online-LoRA, paper fidelity (docs/method.md, docs/fidelity.md).

Settings import `get_config()` from here and override only what differs. The returned ConfigDict
is locked: a misspelt key given on the command line is an error, not a silently new key.

Every key is declared below as `name=Key(default, meaning)`, one line saying what it does, its
units and allowed values (olora_jax/config_keys.py); a method's block is declared the same way in
its module (olora_jax/methods). docs/reference/config.md lists every key with its default and
meaning, generated from these declarations; the docs build and tests/test_config_keys.py refuse a
key declared without a meaning. The blocks, each with a one-line `about`: the top-level keys,
`model`, `sharding`, `distributed`, `pretrained`, `data`, `learner` (Online-LoRA), one block per
packaged method (`er`, `der_pp`, ...), `boundaries`, `eval`, `trace`.
"""

import inspect
from pathlib import Path

import ml_collections
from ml_collections import config_dict

from olora_jax import config_keys, methods
from olora_jax.config_keys import Key, block

# Methods outside the package ('path/to/file.py:NAME') whose config blocks every `get_config()`
# adds: launch/run.py puts here the one its --config.method names, so that --config.<block>.KEY
# overrides of that block are known keys when the command line is parsed.
OUTSIDE_METHODS: list[str] = []

# The values a fidelity key takes from `fidelity` when left unset (None): olora_jax/fidelity.py.
_FROM_FIDELITY = "unset (None): from `fidelity`"


def get_config(method: str = "online_lora") -> ml_collections.ConfigDict:
  """The shared defaults, running `method` (a packaged method's name, or a method of your own as
  'path/to/file.py:NAME', whose config block is added from its module)."""
  config = block(
      "the run as a whole",
      seed=Key(0, "root seed, an integer in [0, 2^32 - 1]: the stream order, the seeded class"
               " order, every initialisation and random draw of the run derive from it"),
      fidelity=Key("paper", "'paper' | 'reference' (the authors' released code): supplies every"
                   " fidelity key left unset (learner.buffer_unit ... data.core50_order,"
                   " model.matmul_precision; docs/fidelity.md)"),
      method=Key(method, "the continual-learning method: 'online_lora' (the paper's, configured"
                 " by `learner`), a packaged baseline (configured by the block of its name,"
                 " below) or your own, 'path/to/file.py:NAME' (docs/extending.md)"),

      model=block(
          "the backbone (docs/models.md)",
          name=Key("vit_b16", "'vit_ti16' | 'vit_s16' | 'vit_b16' | 'vit_l16' | 'vit_h14' |"
                   " 'custom' (a ViT of the sizes below) | 'swin_t' | 'swin_s' | 'swin_b' |"
                   " 'swin_custom' (a Swin of the sizes below) | 'resnet18_reduced' (online"
                   " CL's reduced ResNet-18, nf 20, trained from scratch by whole-model"
                   " methods); paper: ViT-B/16 and ViT-S/16"),
          image_size=Key(224, "input side in pixels (images are resized to it); pretrained"
                         " position embeddings are resampled to it; paper: 224"),
          width=Key(64, "'custom': the model width D; 'swin_custom': the first stage's"
                    " embedding width (doubled at each later stage); presets ignore it"),
          depth=Key(2, "'custom' only: the number of transformer blocks"),
          num_heads=Key(4, "'custom' only: attention heads per block (must divide width)"),
          mlp_dim=Key(256, "'custom' only: hidden width of each block's MLP"),
          patch_size=Key(4, "'custom' and 'swin_custom': patch side in pixels (must divide"
                         " image_size)"),
          stage_depths=Key((2, 2), "'swin_custom' only: Swin blocks per stage, one entry per"
                           " stage"),
          stage_heads=Key((2, 4), "'swin_custom' only: attention heads per stage, one entry per"
                          " stage"),
          window_size=Key(4, "'swin_custom' only: side of the attention windows, in patches"),
          compute_dtype=Key("float32", "'float32' | 'bfloat16': the backbone's computation dtype"
                            " (mixed precision for GPU/TPU: parameters, optimizer state, Omega,"
                            " losses and the loss window stay float32)"),
          # Fidelity key: docs/fidelity.md.
          matmul_precision=Key(config_dict.placeholder(str), "the precision of the model's"
                               " matmuls and convolutions, forward and backward: 'default'"
                               " (JAX's: TF32 for float32 on NVIDIA GPUs; paper) | 'highest'"
                               " (full float32, as PyTorch's CUDA matmuls; reference); the same"
                               " on a CPU; " + _FROM_FIDELITY),
          scan_blocks=Key(False, "run the ViT's encoder blocks as one jax.lax.scan (same"
                          " parameters and checkpoints, results equal up to float rounding;"
                          " not the Swin, not InfLoRA; off: measured slower to compile on a CPU,"
                          " docs/performance.md)"),
      ),

      sharding=block(
          "where arrays live (olora_jax/sharding.py); batches are split over every device",
          fsdp=Key(1, "devices over which every weight matrix of the state (the frozen backbone"
                   " and what the method trains whole) is split, FSDP style; 1 = replicated"
                   " (plain data parallelism); must divide the device count"),
      ),

      distributed=block(
          "several processes on one run (olora_jax/distributed.py, docs/cluster.md)",
          initialize=Key("auto", "'auto' (join a multi-process run when coordinator_address or"
                         " $JAX_COORDINATOR_ADDRESS is given) | 'cluster' (JAX finds the cluster:"
                         " TPU pod, SLURM, Open MPI) | 'off' (one process)"),
          coordinator_address=Key("", "'host:port' of process 0, reachable from every process;"
                                  " '' = $JAX_COORDINATOR_ADDRESS when set"),
          num_processes=Key(0, "how many processes join the run; 0 = from the environment"),
          process_id=Key(-1, "this process's index in [0, num_processes); -1 = from the"
                         " environment"),
          initialization_timeout=Key(1800, "seconds each process waits for all to join (a cold"
                                     " restart after preemption can take longer than JAX's"
                                     " default 300 s)"),
          heartbeat_timeout=Key(100, "seconds without a heartbeat after which JAX's"
                                " coordination service holds a process dead and stops the"
                                " others (JAX's default: 100)"),
      ),

      pretrained=block(
          "the checkpoint the backbone starts from (docs/models.md)",
          path=Key("", "local checkpoint file of the backbone; '' = random initialisation (for"
                   " tests only; 'resnet18_reduced' always: it is trained from scratch)"),
          format=Key("auto", "the checkpoint's layout: 'auto' (told from the file) | 'timm'"
                     " (safetensors) | 'augreg' | 'big_vision' (npz) | 'online_lora' (the"
                     " authors' safetensors)"),
          keep_head=Key(False, "keep the checkpoint's classifier head (it must have the"
                        " benchmark's classes) instead of a fresh one: for replaying another"
                        " codebase's run from its weights (docs/replay.md); needs path"),
      ),

      data=block(
          "the dataset, the stream and the input pipeline (docs/streams.md)",
          dataset=Key("mnist_5k", "embedded 'mnist_5k' | 'sklearn_digits' | 'rotated_mnist_5k',"
                      " TFDS 'cifar100' | 'imagenet_r' | 'imagenet_sketch' | 'caltech_birds2011'"
                      " | 'core50' | 'cifar10' | 'imagenet_a' | 'mnist' | 'fashion_mnist' |"
                      " 'svhn_cropped', with source='folder' 'tiny_imagenet' | 'vtab' |"
                      " 'omnibenchmark' or a name of your own, datasets in sequence"
                      " 'five_datasets' | 'domainnet', or your function 'module:function' |"
                      " 'path/to/file.py:function' (docs/extending.md)"),
          scenario=Key("disjoint", "the stream: 'disjoint' (class-incremental, n_tasks equal"
                       " groups of classes) | 'si_blurry' (si_blurry_n, si_blurry_m) | 'domain'"
                       " (one task per domain of a dataset with domain ids; n_tasks unused)"),
          n_tasks=Key(5, "tasks of a 'disjoint' or 'si_blurry' stream (>= 1; 'disjoint': must"
                      " divide the number of classes); paper: 10 (CUB-200 and Si-Blurry: 5;"
                      " ImageNet-S also 20)"),
          # Any type: a config file gives a list, the command line a string '3,1,0,2'.
          class_order=Key(config_dict.FieldReference("label", field_type=object),
                          "'label' (classes in label order) | 'seeded' (a permutation drawn"
                          " from `seed`) | an explicit order listing every class id once, e.g."
                          " [3, 1, 0, 2] or '3,1,0,2'"),
          test_fraction=Key(0.2, "datasets without a test split of their own (the embedded"
                            " ones, ImageNet-R, ImageNet-Sketch, yours): the fraction of each"
                            " class held out as the test set, in (0, 1), seeded by split_seed"),
          validation_fraction=Key(0.0, "in [0, 1); > 0: hold out this fraction of each training"
                                  " class (seeded) and evaluate on it instead of the test set"
                                  " (launch/sweep.py --tune's runs); in-memory datasets only"),
          split_seed=Key(0, "seed of that train/test split and of the validation split, an"
                         " integer in [0, 2^32 - 1] (independent of `seed`)"),
          data_dir=Key("", "source='tfds': the TFDS data_dir ('' = TFDS's default,"
                       " ~/tensorflow_datasets); source='folder': the dataset's folder"),
          source=Key("tfds", "how a named benchmark is read: 'tfds' (prepared array_record"
                     " datasets in data_dir) | 'folder' (the images on disk in data_dir:"
                     " ImageFolder trees, CUB, CORe50, CIFAR-100's pickles)"),
          si_blurry_n=Key(50.0, "Si-Blurry's N, in % [0, 100]: the share of classes that are"
                          " disjoint (all their samples in one task)"),
          si_blurry_m=Key(10.0, "Si-Blurry's M, in % [0, 100]: the share of the blurry classes'"
                          " samples moved to other tasks"),
          augment=Key("none", "training augmentation: 'none' | 'crop_flip' (random resized crop"
                      " + horizontal flip, as the released code)"),
          preprocess=Key("host", "where uint8 images become model inputs: 'host' (PIL resize,"
                         " crop/flip and scaling in host threads) | 'device' (JAX on the device,"
                         " the same inputs bit for bit; needs training images of one stored"
                         " size; docs/performance.md)"),
          num_workers=Key(8, "host threads decoding and resizing images (TFDS and folder"
                          " datasets; >= 1)"),
          prefetch=Key(4, "batches prepared ahead of the device by the input pipeline (>= 1)"),
          cache_test_images=Key(True, "TFDS: keep every resized test image in host memory after"
                                " its first decode (the test set is evaluated many times; about"
                                " 150 KB per image at 224 px)"),
          stream_manifest=Key("", "'' = build the stream from the seed; a path = replay the steps"
                              " that stream manifest lists (a run's stream_manifest.json;"
                              " docs/replay.md)"),
          replay_draws=Key("", "'' = a replay method draws from the run's seed; a path = each"
                           " step's reservoir decisions and replay draws from that file"
                           " (another codebase's; er, er_ace, der_pp, ema_der_pp, agem,"
                           " mir, pcr and lode; docs/replay.md)"),
          # Fidelity keys: docs/fidelity.md.
          input_scale=Key(config_dict.placeholder(str), "model input pixels: 'unit' [0, 1] |"
                          " 'signed' [-1, 1] (big_vision's AugReg); " + _FROM_FIDELITY
                          + " ('unit' in both)"),
          core50_order=Key(config_dict.placeholder(str), "CORe50's training sessions: 'sequential'"
                           " (one after another, paper) | 'shuffled' (together, i.i.d.,"
                           " reference); " + _FROM_FIDELITY),
      ),

      learner=block(
          "Online-LoRA (method='online_lora'; docs/method.md); batch_size is every method's batch",
          batch_size=Key(64, "B, stream samples per training step, for every method (>= 1);"
                         " paper: 64"),
          buffer_size=Key(4, "K, the hard buffer's size: K samples, or K whole batches with"
                          " buffer_unit='batch' (>= 0); paper: 4"),
          rank=Key(4, "r, the LoRA rank on q and v (scale 1, no dropout), in [1, model width];"
                   " also the rank of a baseline's trainable='lora'; paper: 4"),
          learning_rate=Key(2e-4, "Adam's learning rate, constant (> 0); paper: 2e-4 (ViT-B),"
                            " 5e-4 (ViT-S)"),
          reg_lambda=Key(2000.0, "lambda, the weight of the LoRA regulariser lambda/2 * sum Omega"
                         " * W^2 (>= 0); paper: 2000"),
          window=Key(5, "the plateau rule's loss window, in steps (>= 1); paper: 5"),
          mean_threshold=Key(2.6, "a plateau needs the window's mean below this (> 0; per dataset"
                             " in the paper)"),
          var_threshold=Key(0.03, "a plateau needs the window's variance below this (> 0; per"
                            " dataset in the paper)"),
          incremental_lora=Key(True, "at each plateau: measure importance (Omega), merge the LoRA"
                               " into the backbone and start a new one; False = one LoRA"
                               " throughout"),
          hard_loss=Key(True, "add CE(hard buffer) to the objective (paper eq. 6); the paper's"
                        " Si-Blurry row runs without it"),
          # Fidelity keys: one per difference between the paper and the released code.
          buffer_unit=Key(config_dict.placeholder(str), "the hard buffer holds K 'sample's"
                          " (paper) | K whole 'batch'es (reference); " + _FROM_FIDELITY),
          window_value=Key(config_dict.placeholder(str), "CE(hard buffer) in the window's value"
                           " as a 'mean' over its samples (paper) | a 'sum' over its K entries"
                           " (reference); " + _FROM_FIDELITY),
          importance=Key(config_dict.placeholder(str), "Omega from the per-sample empirical"
                         " 'fisher' (paper) | one squared gradient of a flattened softmax,"
                         " 'flat_softmax' (reference); " + _FROM_FIDELITY),
          merge=Key(config_dict.placeholder(str), "at a plateau: 'exact', W += B A (paper) |"
                    " 'factor_sum', A_old += A and B_old += B (reference); " + _FROM_FIDELITY),
          new_lora_init=Key(config_dict.placeholder(str), "the LoRA started at a merge:"
                            " 'kaiming' (A kaiming-uniform, B = 0; paper) | 'zeros' (A = B = 0;"
                            " reference); " + _FROM_FIDELITY),
          reset_opt_state_at_merge=Key(config_dict.placeholder(bool), "fresh Adam state for each"
                                       " new LoRA: True (paper) | False (reference); "
                                       + _FROM_FIDELITY),
          check_partial_window=Key(config_dict.placeholder(bool), "check for a plateau before"
                                   " the window is full: False (paper) | True (reference); "
                                   + _FROM_FIDELITY),
          adam_bias_correction=Key(config_dict.placeholder(str), "Adam's 1 - b^t: 'float32'"
                                   " (optax.adam, from the float32-rounded b; paper) | 'exact'"
                                   " (PyTorch's, float64; reference); " + _FROM_FIDELITY),
          allow_dead_lora=Key(False, "run new_lora_init='zeros' with the optimizer state reset"
                              " anyway (refused otherwise: every later LoRA never learns)"),
          initial_lora=Key("", "'' = the first LoRA is drawn from the seed; a path = a"
                           " safetensors file in the authors' layout whose linear_new_* factors"
                           " start the first LoRA (and linear_a/b_* the frozen pair)"),
          skip_nonfinite=Key(False, "on a NaN/Inf loss: False = checkpoint and stop (exit 3);"
                             " True = skip the step and go on"),
          max_skipped_fraction=Key(0.05, "with skip_nonfinite: stop (exit 3) once more than this"
                                   " fraction of the stream's steps was skipped, in [0, 1]"),
      ),

      # One block per packaged method, `config.<name>`, read only when `method` names it: each
      # method module declares its block's keys with their meanings (olora_jax/methods,
      # docs/methods.md). A method outside the package brings its own block (`get_config(method=)`).
      **{spec.name: spec.config() for spec in methods.specs() if spec.config is not None},

      # The boundary switch (olora_jax/boundaries.py, docs/methods.md). Online-LoRA finds its own
      # boundaries (`learner`) and keeps 'none'.
      boundaries=block(
          "who tells a method with an `at_boundary` hook that a task boundary was passed",
          rule=Key("none", "'none' (nobody: task-free) | 'oracle' (the true task ends: not"
                   " task-free, results.json and reports mark the run) | 'plateau' (the"
                   " loss-window rule below on the method's own loss: task-free)"),
          window=Key(5, "rule='plateau': the loss window, in steps (>= 1)"),
          mean_threshold=Key(2.6, "rule='plateau': a boundary needs the window's mean below"
                             " this (> 0)"),
          var_threshold=Key(0.03, "rule='plateau': a boundary needs the window's variance below"
                            " this (> 0)"),
      ),

      eval=block(
          "the evaluator (docs/metrics.md)",
          eval_every=Key(1000, "anytime-evaluation period, in training samples seen (>= 1);"
                         " paper: 1000 (Si-Blurry)"),
          batch_size=Key(1024, "test images per evaluation batch, over all devices (>= 1; a"
                         " multiple of the device count): one compiled program for every"
                         " evaluation, the last batch padded and its padding rows masked;"
                         " halved at the first evaluation while its program does not fit the"
                         " device's free memory (GPU/TPU); predictions do not depend on it"),
          predict_chunk=Key(-1, "test images per device in one forward pass: N > 0 (a divisor"
                            " of a device's rows of a test batch) | 0 = the whole batch in one"
                            " pass (best on GPU/TPU) | -1 = by the backend: 64 on a CPU when it"
                            " divides a device's rows, else 0; the same predictions up to float"
                            " rounding (docs/performance-internals.md)"),
          mask_unseen_logits=Key(False, "evaluate with the logits of not-yet-seen classes masked"
                                 " (the paper's Si-Blurry protocol)"),
          write_plots=Key(True, "draw WORKDIR/plots/*.png at the end of the run"),
          export=Key("none", "'none' | 'logits' | 'top_k': at each task end and at the stream's"
                     " end write WORKDIR/export/*.npz, every test example's logits (or its"
                     " export_top_k best classes) with its record id, and the method's trainable"
                     " parameters (docs/reference/outputs.md)"),
          export_top_k=Key(5, "eval.export='top_k': the classes kept per test example, in"
                           " 1..num_classes"),
      ),

      trace=block(
          "Online-LoRA's per-step record (olora_jax/trace.py)",
          enabled=Key(False, "Online-LoRA only: write WORKDIR/trace.npz, per step the hard"
                      " buffer's ids and scores, the window's value, mean and variance and the"
                      " regulariser, per plateau Omega and the merged factors (off: nothing"
                      " extra is fetched from the device)"),
      ),

      export_online_lora=Key(False, "Online-LoRA only: write WORKDIR/online_lora.safetensors at"
                             " the end, the final model (backbone with every merge, head, current"
                             " LoRA, factor_sum frozen pair) in the authors' checkpoint layout"
                             " (docs/replay.md)"),
      log_every=Key(1, "write a `train` line to metrics.jsonl every this many steps (>= 1)"),
      loggers=Key("tensorboard", "where metrics.jsonl's scalars are mirrored, comma separated:"
                  " 'tensorboard' (WORKDIR/tensorboard, with tensorboardX) | 'wandb' | 'mlflow'"
                  " (extras [wandb], [mlflow]; MLflow's store: MLFLOW_TRACKING_URI, else"
                  " WORKDIR/mlruns) | '' = metrics.jsonl alone (olora_jax/loggers.py)"),
      logger_project=Key("olora-jax", "the W&B project / MLflow experiment the runs are logged"
                         " into"),
      logger_group=Key("", "the W&B group (and MLflow tag `group`) that gathers the runs of one"
                       " comparison ('' = none; launch/sweep.py: the sweep's name)"),
      logger_dir=Key("", "where W&B's run files and MLflow's local file store go ('' = the"
                     " workdir; launch/sweep.py: its ROOT, one MLflow store for the sweep)"),
      checkpoint_every=Key(200, "steps between full-state checkpoints in WORKDIR/checkpoints (0:"
                           " only at the end and on SIGTERM/SIGINT); the same --workdir resumes"),
      max_to_keep=Key(3, "checkpoints kept (>= 1); older ones are the fallback if the newest is"
                      " damaged"),
  )

  for name in (*OUTSIDE_METHODS, method):  # methods outside the package: blocks from their files
    methods.add_config_block(config, name)
  config.lock()
  return config


def declared_in(block_name: str, config: ml_collections.ConfigDict | None = None) -> str:
  """The file that declares the keys of top-level block `block_name` ('' for the top level): the
  module of the method whose block it is (packaged, or `config`'s own method), else this file;
  relative to the repository when inside it."""
  specs = list(methods.specs())
  if config is not None and "method" in config:
    specs += [methods.resolve(name) for name in (*OUTSIDE_METHODS, config.method)]
  spec = next((s for s in specs if s.config is not None and s.name == block_name), None)
  path = Path(inspect.getsourcefile(spec.config) if spec else __file__).resolve()
  root = Path(__file__).resolve().parents[1]
  return str(path.relative_to(root)) if path.is_relative_to(root) else str(path)


def unexplained_keys(config: ml_collections.ConfigDict | None = None) -> list[str]:
  """One line for each key of `config` (default: `get_config()`) declared without a meaning, or
  with one that only restates its name, naming the key and where to give it one; [] when every
  key is explained. The docs build and tests/test_config_keys.py print these lines."""
  config = get_config() if config is None else config
  defaults, given = dict(config_keys.leaves(config)), config_keys.meanings(config)
  lines = []
  for key in config_keys.unexplained(config):
    block_name, _, name = key.rpartition(".")
    default = defaults[key]
    problem = (f"its meaning {given[key]!r} only restates its name" if key in given
               else "it has no meaning")
    lines.append(f"config key {key} (default {default!r}): {problem}; declare it as"
                 f" {name}=Key({default!r}, \"what it does, its units and allowed values\") in"
                 f" {declared_in(block_name.split('.')[0], config)}")
  return lines
