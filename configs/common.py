"""Shared defaults of every setting: Online-LoRA, paper fidelity (docs/method.md, docs/fidelity.md).

Settings import `get_config()` from here and override only what differs. The returned ConfigDict
is locked: a misspelt key given on the command line is an error, not a silently new key.

Keys that matter:
  seed                          root seed: LoRA inits and the stream order derive from it
  model.name                    'vit_ti16' | 'vit_s16' | 'vit_b16' | 'vit_l16' | 'vit_h14' |
                                'custom' (then width, depth,
                                num_heads, mlp_dim, patch_size apply) | a Swin: 'swin_t' |
                                'swin_s' | 'swin_b' | 'swin_custom' (then width = embedding
                                width, stage_depths, stage_heads, window_size, patch_size apply)
  model.image_size              input resolution; pretrained position embeddings are resampled
  model.compute_dtype           'float32' | 'bfloat16': the ViT's computation dtype (parameters,
                                optimizer state, Omega, losses and the window stay float32)
  sharding.fsdp                 devices over which each weight matrix of the state is split
                                (FSDP); 1 = replicated, plain data parallelism
  distributed.initialize, .coordinator_address, .num_processes, .process_id,
  .initialization_timeout       several processes on one run (jax.distributed): 'auto' | 'cluster'
                                | 'off'; seconds to wait for every process to join
                                (docs/performance.md, docs/cluster.md)
  pretrained.path, .format      local checkpoint ('' = random init, for tests only);
                                format 'auto' | 'timm' | 'augreg' | 'big_vision'
  data.dataset                  embedded 'mnist_5k' | 'sklearn_digits' | 'rotated_mnist_5k', TFDS
                                'cifar100' | 'imagenet_r' | 'imagenet_sketch' |
                                'caltech_birds2011' | 'core50', or a user dataset
                                'module:function' | 'path/to/file.py:function'
                                (docs/extending.md)
  data.class_order              'label' | 'seeded' | an explicit list of every class id
  data.data_dir                 TFDS data_dir holding the prepared array_record datasets, or
                                with data.source='folder' the dataset's folder of images
  data.source                   'tfds' | 'folder' (images on disk, docs/streams.md)
  data.scenario, data.n_tasks   'disjoint' | 'si_blurry' (data.si_blurry_n, .si_blurry_m, in %) |
                                'domain' (one task per domain of a dataset with domain ids,
                                so data.n_tasks is not used; CORe50: data.core50_order)
  data.augment                  training augmentation: 'none' | 'crop_flip' (random resized crop
                                + horizontal flip, as the released code)
  data.preprocess               where uint8 images become model inputs: 'host' (default: PIL
                                resize, crop/flip and scaling in host threads) | 'device' (the
                                host ships uint8 images at their stored size, plus the crop_flip
                                draws; JAX resizes, crops, flips and scales them on the device,
                                for the train batches and the evaluator; the same inputs as
                                'host', bit for bit, with Pillow 13). Needs training images of
                                one stored size (docs/performance.md)
  learner.batch_size (B), learner.buffer_size (K), learner.rank (r), learner.reg_lambda
  learner.learning_rate         Adam, constant
  learner.window, learner.mean_threshold, learner.var_threshold   the plateau rule
  learner.incremental_lora      merge + new LoRA + Omega at plateaus (False: a single LoRA)
  learner.hard_loss             add CE(hard buffer) to the objective
  learner.skip_nonfinite        on a NaN/Inf loss skip the step (else checkpoint and stop)
  learner.max_skipped_fraction  with skip_nonfinite: stop (exit 3) once more than this fraction of
                                the stream's steps has been skipped
  eval.eval_every               anytime evaluation period, in samples
  eval.batch_size               test images per evaluation batch (the last one padded, its
                                padding rows masked): one compiled program for every
                                evaluation; halved at the first evaluation while its program
                                does not fit the device's free memory (GPU/TPU). Predictions do
                                not depend on it
  eval.predict_chunk            the evaluator's forward passes take this many images per device
                                at a time (the pieces of a test batch run one after another in
                                one program); 0 = the whole batch in one pass (best on GPU/TPU);
                                -1 (default) = by the backend: 64 on a CPU (smaller passes stay
                                in the caches) when it divides a device's rows of a test batch,
                                else 0. Any value gives the same predictions up to float rounding
                                (docs/performance-internals.md); config.json records the value
                                that ran
  eval.mask_unseen_logits       evaluate with the logits of not-yet-seen classes masked (Si-Blurry)
  eval.write_plots              draw DIR/plots/*.png at the end of the run
  fidelity                      'paper' (default) | 'reference' (the authors' released code):
                                the default of every key below left unset (None); see
                                olora_jax/fidelity.py and docs/fidelity.md
  learner.buffer_unit, .window_value, .importance, .merge, .new_lora_init,
  learner.reset_opt_state_at_merge, .check_partial_window, .adam_bias_correction,
  data.input_scale, data.core50_order
                                one key per paper-vs-code difference, None = take it from fidelity
  learner.allow_dead_lora       run new_lora_init='zeros' with the optimizer state reset anyway
  learner.adam_bias_correction  (fidelity key) 'float32' = optax.adam | 'exact' = PyTorch's
  data.stream_manifest          replay the steps of a stream manifest (docs/replay.md)
  pretrained.keep_head, learner.initial_lora, export_online_lora
                                start from / end with given weights, the authors' layout
  trace.enabled                 WORKDIR/trace.npz: per-step buffer ids, window, Omega
  method                        'online_lora' (configured by `learner`) | 'finetune' | 'iid' |
                                'er' | 'der_pp' | 'ewc_pp' | 'agem' | 'mir' | 'gdumb' | 'pcr' |
                                'lode' | 'ema_der_pp' | 'ema_rar' | 'l2p' | 'mvp', each
                                configured by the block of its name, whose defaults its module
                                declares (olora_jax/methods, docs/methods.md); or your own
                                method, 'path/to/file.py:NAME' (docs/extending.md)
  boundaries.rule               'none' | 'oracle' | 'plateau': who tells a method with an
                                `at_boundary` hook of task boundaries (boundaries.window,
                                .mean_threshold, .var_threshold: the plateau rule on the
                                method's own loss; olora_jax/boundaries.py, docs/methods.md)
  checkpoint_every, max_to_keep full-state orbax checkpoints in WORKDIR/checkpoints; the same
                                --workdir resumes (a different config is refused)
"""

import ml_collections
from ml_collections import config_dict

from olora_jax import methods

# Methods outside the package ('path/to/file.py:NAME') whose config blocks every `get_config()`
# adds: launch/run.py puts here the one its --config.method names, so that --config.<block>.KEY
# overrides of that block are known keys when the command line is parsed.
OUTSIDE_METHODS: list[str] = []


def get_config(method: str = "online_lora") -> ml_collections.ConfigDict:
  """The shared defaults, running `method` (a packaged method's name, or a method of your own as
  'path/to/file.py:NAME', whose config block is added from its module)."""
  config = ml_collections.ConfigDict()
  config.seed = 0
  config.fidelity = "paper"
  # The continual-learning method (olora_jax/methods, docs/methods.md): 'online_lora' (the paper's
  # method, configured by the `learner` block), a baseline, configured by its own block below, or
  # a method outside the package, 'path/to/file.py:NAME' (docs/extending.md).
  config.method = method

  config.model = ml_collections.ConfigDict()
  config.model.name = "vit_b16"
  config.model.image_size = 224
  # Sizes of a 'custom' model (ignored by the presets).
  config.model.width = 64
  config.model.depth = 2
  config.model.num_heads = 4
  config.model.mlp_dim = 256
  config.model.patch_size = 4
  # Sizes of a 'swin_custom' Swin (with width and patch_size above; ignored otherwise).
  config.model.stage_depths = (2, 2)
  config.model.stage_heads = (2, 4)
  config.model.window_size = 4
  # The ViT's computation dtype: 'float32' or 'bfloat16' (mixed precision for GPU/TPU:
  # parameters, optimizer state, Omega, losses and the loss window stay float32).
  config.model.compute_dtype = "float32"

  # Where arrays live (olora_jax/sharding.py): fsdp > 1 splits every weight matrix of the state
  # (the frozen backbone, and whatever the method trains whole) over that many devices, FSDP
  # style; batches are split over every device. It must divide the device count.
  config.sharding = ml_collections.ConfigDict()
  config.sharding.fsdp = 1

  # Several processes, one run (olora_jax/distributed.py): 'auto' joins one when
  # coordinator_address or $JAX_COORDINATOR_ADDRESS is given, 'cluster' lets JAX find the
  # cluster (TPU pod, SLURM, Open MPI), 'off' never joins.
  config.distributed = ml_collections.ConfigDict()
  config.distributed.initialize = "auto"
  config.distributed.coordinator_address = ""  # 'host:port' of process 0
  config.distributed.num_processes = 0  # 0: from the environment
  config.distributed.process_id = -1  # -1: from the environment
  # Seconds each process waits for all to join: a cold restart after preemption can take longer
  # than JAX's default 300 s.
  config.distributed.initialization_timeout = 1800

  config.pretrained = ml_collections.ConfigDict()
  config.pretrained.path = ""
  config.pretrained.format = "auto"  # or 'timm' | 'augreg' | 'big_vision' | 'online_lora'
  # Keep the checkpoint's head (it must have the benchmark's classes) instead of a fresh one:
  # for replaying another codebase's run from its weights (docs/replay.md).
  config.pretrained.keep_head = False

  config.data = ml_collections.ConfigDict()
  config.data.dataset = "mnist_5k"
  config.data.scenario = "disjoint"
  config.data.n_tasks = 5
  # 'label', 'seeded' (a permutation from `seed`) or an explicit order listing every class once,
  # e.g. [3, 1, 0, 2] in a config file or --config.data.class_order=3,1,0,2 (any type accepted).
  config.data.class_order = config_dict.FieldReference("label", field_type=object)
  config.data.test_fraction = 0.2  # datasets without a test split: seeded per-class test split
  # > 0: hold out this fraction of the training split (seeded, per class) and evaluate on it
  # instead of the test set (launch/sweep.py --tune's validation runs); in-memory datasets
  config.data.validation_fraction = 0.0
  config.data.split_seed = 0
  config.data.data_dir = ""  # TFDS data_dir ('' = TFDS default, ~/tensorflow_datasets)
  # How a benchmark is read: 'tfds' (array_record datasets in data.data_dir) or 'folder' (the
  # images on disk in data.data_dir: ImageFolder trees, CUB, CORe50, CIFAR-100's pickles).
  config.data.source = "tfds"
  config.data.si_blurry_n = 50.0  # Si-Blurry N: % of classes that are disjoint
  config.data.si_blurry_m = 10.0  # Si-Blurry M: % of blurry-class samples moved to other tasks
  config.data.augment = "none"  # or 'crop_flip'
  config.data.preprocess = "host"  # or 'device': resize, crop/flip, scaling in JAX on the device
  config.data.num_workers = 8  # host threads decoding images
  config.data.prefetch = 4  # batches prepared ahead of the device
  config.data.cache_test_images = True  # TFDS: keep resized test images in host memory
  # '' = build the stream from the seed; a path = replay the steps that stream manifest lists
  # (a run's stream_manifest.json, or the same JSON from elsewhere: docs/replay.md)
  config.data.stream_manifest = ""
  # Fidelity keys (None = the default of `fidelity`).
  config.data.input_scale = config_dict.placeholder(str)  # 'unit' [0, 1] | 'signed' [-1, 1]
  config.data.core50_order = config_dict.placeholder(str)  # 'sequential' | 'shuffled' (i.i.d.)

  config.learner = ml_collections.ConfigDict()
  config.learner.batch_size = 64
  config.learner.buffer_size = 4
  config.learner.rank = 4
  config.learner.learning_rate = 2e-4
  config.learner.reg_lambda = 2000.0
  config.learner.window = 5
  config.learner.mean_threshold = 2.6
  config.learner.var_threshold = 0.03
  config.learner.incremental_lora = True
  config.learner.hard_loss = True
  # Fidelity keys (None = the default of `fidelity`; olora_jax/fidelity.py).
  config.learner.buffer_unit = config_dict.placeholder(str)  # 'sample' | 'batch'
  config.learner.window_value = config_dict.placeholder(str)  # 'mean' | 'sum'
  config.learner.importance = config_dict.placeholder(str)  # 'fisher' | 'flat_softmax'
  config.learner.merge = config_dict.placeholder(str)  # 'exact' | 'factor_sum'
  config.learner.new_lora_init = config_dict.placeholder(str)  # 'kaiming' | 'zeros'
  config.learner.reset_opt_state_at_merge = config_dict.placeholder(bool)
  config.learner.check_partial_window = config_dict.placeholder(bool)
  # 'float32' (optax.adam: 1 - b^t from the float32-rounded b) | 'exact' (PyTorch's, float64-exact)
  config.learner.adam_bias_correction = config_dict.placeholder(str)
  config.learner.allow_dead_lora = False
  # '' = the first LoRA is drawn from the seed; a path = a safetensors file in the authors' layout
  # (format 'online_lora'): its linear_new_* factors start the first LoRA and its linear_a/b_*
  # pair the frozen pair (factor_sum merge; merged into the backbone with the exact merge)
  config.learner.initial_lora = ""
  config.learner.skip_nonfinite = False  # NaN/Inf loss: False = checkpoint and stop; True = skip
  config.learner.max_skipped_fraction = 0.05  # skip_nonfinite: stop past this fraction of steps

  # One block per packaged baseline, `config.<name>`, read only when `method` names it: each
  # method module declares its block's defaults and documents every key there (olora_jax/methods,
  # docs/methods.md). A method outside the package brings its own block (`get_config(method=)`).
  for spec in methods.specs():
    if spec.config is not None:
      config[spec.name] = spec.config()

  # The boundary switch (olora_jax/boundaries.py, docs/methods.md): who tells a method with an
  # `at_boundary` hook that a task boundary was passed. 'none': nobody (task-free, the default);
  # 'oracle': the true task ends (not task-free: results.json and reports mark the run);
  # 'plateau': the loss-window rule on the method's own loss, with the window and thresholds
  # below (task-free). Online-LoRA finds its own boundaries (`learner`) and keeps 'none'.
  config.boundaries = ml_collections.ConfigDict()
  config.boundaries.rule = "none"
  config.boundaries.window = 5
  config.boundaries.mean_threshold = 2.6
  config.boundaries.var_threshold = 0.03

  config.eval = ml_collections.ConfigDict()
  config.eval.eval_every = 1000
  config.eval.batch_size = 1024  # lowered at the first evaluation when it does not fit
  config.eval.predict_chunk = -1  # by the backend: 64 on a CPU, 0 on GPUs/TPUs
  config.eval.mask_unseen_logits = False
  config.eval.write_plots = True

  config.trace = ml_collections.ConfigDict()
  # Write WORKDIR/trace.npz: per step the hard buffer's example ids and scores, the loss-window
  # value, mean and variance, the regulariser; per plateau Omega and the merged factors
  # (olora_jax/trace.py). Off: nothing extra is fetched from the device.
  config.trace.enabled = False

  # Write WORKDIR/online_lora.safetensors at the end: the final model (backbone with every merge,
  # head, current LoRA, factor_sum frozen pair) in the authors' checkpoint layout (docs/replay.md)
  config.export_online_lora = False

  config.log_every = 1  # write a `train` event every this many steps
  config.checkpoint_every = 200  # steps between full-state checkpoints (0: only end / signal)
  config.max_to_keep = 3  # checkpoints kept; older ones are a fallback if the newest is damaged
  for name in (*OUTSIDE_METHODS, method):  # methods outside the package: blocks from their files
    methods.add_config_block(config, name)
  config.lock()
  return config
