"""SD-LoRA, scalable decoupled LoRA (Wu et al., ICLR 2025), online and task-free.

The paper's method: every task t adds a LoRA component to q and v of every block, and the
model after task t is
    W = W_0 + sum_{k<t} alpha_k * (B_k A_k) / ||B_k A_k||_F + alpha_t * B_t A_t
(B A in PyTorch's (out, in) convention; the paper writes the product A_k B_k.) The directions
B_k A_k / ||B_k A_k||_F of the earlier tasks are frozen; their magnitudes
alpha_k (one scalar per task, shared by every adapted projection, as the code's default) stay
trainable, together with the new task's factors A_t, B_t and its magnitude alpha_t. All of it
is trained end to end on the task's cross-entropy; at test time the final model is used as is.

In code (the project's (in, out) layout: a projection computes x W + (x A) B, A (D, r) `down`,
B (r, D) `up`):
    params      {"down", "up"}: the live component's A_t, B_t, (L, 2, D, r) and (L, 2, r, D)
                for q and v of each of the L blocks; "magnitudes" (T,): alpha_0 .. alpha_{T-1};
                "head"
    directions  the frozen components k < t: their factors "down" (T, L, 2, D, r), "up"
                (T, L, 2, r, D) and "norm" (T, L, 2) = ||A_k B_k||_F, computed once when frozen
                (from the r x r Gram matrices: ||A B||_F^2 = sum((A^T A) * (B B^T)))
    task        the live component's index t (traced int32: the step compiles once)
The forward runs every component as one adapter of rank (T + 1) r: x [A_0 .. A_{T-1} A_t]
[c_0 B_0; ...; c_{T-1} B_{T-1}; alpha_t B_t], with c_k = alpha_k / ||A_k B_k||_F for k < t and
0 for the slots not yet used.

At a boundary (`at_boundary`): the live component is frozen into slot t (its magnitude alpha_t
kept as trained), a fresh A_{t+1} (kaiming-uniform) and B_{t+1} = 0 open slot t + 1 with
alpha_{t+1} = `magnitude_init`, and the Adam state is reset (the code builds a new optimizer
per task).

Readings (ours; docs/methods/sd_lora.md says where paper and code differ):
  - The live component is alpha_t B_t A_t, not normalised: B_t starts at 0 (so opening a
    component leaves the model's function unchanged), where a norm is undefined. The code does
    the same. Freezing it normalises it, which changes the function at the boundary unless
    ||B_t A_t||_F = 1 (the paper's parametrisation; in the code the jump is larger, below).
  - Normalisation by ||B_k A_k||_F (the paper). The code divides by ||B_k||_F ||A_k||_F, which
    is >= ||B_k A_k||_F (its directions have norm <= 1); we follow the paper.
  - Magnitudes carry over: alpha_k keeps its trained value across boundaries. The code builds a
    new model per task whose earlier magnitudes all restart at 0.8; we follow the paper, where
    the alpha_k are trained across tasks.
  - Online: boundaries come from the run's switch (`boundaries.rule`). With 'none' there is
    one component, alpha_0 B_0 A_0, for the whole stream (a LoRA with one trainable scalar
    gain). Past T - 1 boundaries (possible with 'plateau') the last component stays live and
    keeps training (the state has T slots; the host record counts the boundaries ignored).
  - T is `sd_lora.n_tasks` (0: data.n_tasks).
  - The cross-entropy is over every class on one shared head (the project's fair setting, as
    for L2P): the code's growing classifier trained on the current task's logits is not used.
  - The paper's two variants for parameter efficiency, SD-LoRA-RR (smaller ranks for later
    tasks) and SD-LoRA-KD (a new direction expressed by the earlier ones is folded into their
    magnitudes), are not part of the main method and are omitted.

ViT-B/16 ImageNet-R (10 tasks): rank 10, magnitudes 0.8 at first (the code), Adam lr 8e-3
(the paper; the code's training loop runs SGD with momentum 0.9 at lr 1e-2 whatever its config
names), weight decay 0 (the code's optimizer takes none), batch 128, 30 epochs per task in the
paper (online: one pass).
"""

from __future__ import annotations

import jax
import jax.numpy as jnp

from olora_jax import config_keys
from olora_jax.config_keys import Key, authors, ours
from olora_jax.methods import base, common
from olora_jax.models.vit import LORA_TARGETS

SDLORA = "WuYichen-97/SD-Lora-CL"  # the authors' released code, where the defaults come from


def fresh_component(key: jax.Array, depth: int, width: int, rank: int) -> dict:
  """A new live component: kaiming-uniform down-projections (as `models.lora.init_lora`) and
  zero up-projections, for q and v of every block."""
  bound = 1.0 / jnp.sqrt(width)
  shape = (depth, len(LORA_TARGETS))
  return {"down": jax.random.uniform(key, (*shape, width, rank), jnp.float32, -bound, bound),
          "up": jnp.zeros((*shape, rank, width), jnp.float32)}


def frobenius_norm(down: jax.Array, up: jax.Array) -> jax.Array:
  """||down @ up||_F over the last two axes, from the r x r Gram matrices (no D x D product)."""
  gram_down = jnp.einsum("...dr,...ds->...rs", down, down)
  gram_up = jnp.einsum("...rd,...sd->...rs", up, up)
  return jnp.sqrt(jnp.maximum(jnp.sum(gram_down * gram_up, axis=(-2, -1)), 0.0))


def adapter(params: dict, directions: dict, task: jax.Array) -> dict:
  """Every component as one LoRA tree of rank (T + 1) r (module docstring)."""
  magnitudes = params["magnitudes"]
  n_slots, depth = directions["down"].shape[:2]
  frozen = jnp.arange(n_slots) < task
  norm = directions["norm"]  # (T, L, 2)
  scale = jnp.where(frozen[:, None, None] & (norm > 0),
                    magnitudes[:, None, None] / jnp.where(norm > 0, norm, 1.0), 0.0)
  live = magnitudes[jnp.minimum(task, n_slots - 1)]
  tree = {}
  for i in range(depth):
    block = {}
    for j, target in enumerate(LORA_TARGETS):
      down = directions["down"][:, i, j]  # (T, D, r)
      up = directions["up"][:, i, j] * scale[:, i, j, None, None]  # (T, r, D)
      rank = down.shape[-1]
      block[target] = {
          "lora_a": jnp.concatenate([jnp.moveaxis(down, 0, 1).reshape(down.shape[1], -1),
                                     params["down"][i, j]], axis=1),  # (D, (T + 1) r)
          "lora_b": jnp.concatenate([up.reshape(n_slots * rank, -1),
                                     live * params["up"][i, j]], axis=0)}  # ((T + 1) r, D)
    tree[f"encoderblock_{i}"] = block
  return tree


def build(ctx: base.Context) -> base.Method:
  block = ctx.config.sd_lora
  n_tasks, model, rank = common.task_slots(ctx, block), ctx.model, block.rank
  depth, width = ctx.spec.depth, ctx.spec.width
  tx = common.make_adam(block.learning_rate, block.weight_decay)

  def forward(state, params, images):
    return model.apply({"params": {**state["frozen"], "head": params["head"]}}, images,
                       lora=adapter(params, state["directions"], state["task"]))

  def init(key, params):
    component_key, key = jax.random.split(key)
    params = jax.tree.map(jnp.array, params)
    trainable = {**fresh_component(component_key, depth, width, rank),
                 "magnitudes": jnp.full((n_tasks,), block.magnitude_init, jnp.float32),
                 "head": params["head"]}
    shape = (n_tasks, depth, len(LORA_TARGETS))
    backbone = {k: v for k, v in params.items() if k != "head"}
    return {**common.state_of(trainable, backbone, tx, key),
            "directions": {"down": jnp.zeros((*shape, width, rank), jnp.float32),
                           "up": jnp.zeros((*shape, rank, width), jnp.float32),
                           "norm": jnp.zeros(shape, jnp.float32)},
            "task": jnp.zeros((), jnp.int32)}

  @common.train_step("sd_lora")
  def train_step(state, batch):

    def loss_fn(params):
      logits = forward(state, params, batch["images"])
      return common.masked_mean(common.per_example_ce(logits, batch["labels"]), batch["mask"])

    loss, grads = jax.value_and_grad(loss_fn)(state["params"])
    return common.apply_gradients(state, grads, tx), {"loss": loss}, {}

  def boundary(state):
    """Freeze the live component into its slot, open the next one, reset Adam."""
    common.TRACE_COUNTS["sd_lora.at_boundary"] += 1
    t, params, directions = state["task"], state["params"], state["directions"]
    directions = {
        "down": directions["down"].at[t].set(params["down"]),
        "up": directions["up"].at[t].set(params["up"]),
        "norm": directions["norm"].at[t].set(frobenius_norm(params["down"], params["up"]))}
    fresh = fresh_component(jax.random.fold_in(state["key"], t + 1), depth, width, rank)
    params = {**params, **fresh,
              "magnitudes": params["magnitudes"].at[t + 1].set(block.magnitude_init)}
    return {**state, "params": params, "opt_state": tx.init(params), "directions": directions,
            "task": t + 1}

  boundary_jit = jax.jit(boundary)

  def at_boundary(state, host):
    if int(jax.device_get(state["task"])) >= n_tasks - 1:  # no slot left: the live one stays
      return state, {**host, "boundaries_past_last_slot":
                     host.get("boundaries_past_last_slot", 0) + 1}
    return boundary_jit(state), host

  def predict(state, images):
    return forward(state, state["params"], images)

  return base.Method(name="sd_lora", init=init, train_step=train_step, predict=predict,
                     at_boundary=at_boundary)


def config():
  """The `sd_lora` block: the paper's ViT-B/16 ImageNet-R settings (module docstring)."""
  return common.baseline_block(
      trainable=Key("lora", "'lora', the only value: the components, their magnitudes, plus the"
                    " head",
                    authors("lora", f"{SDLORA}, models/sdlora.py: the components, their"
                                    " magnitudes and the head")),
      learning_rate=common.shared(8e-3, authors(
          8e-3, "the SD-LoRA paper (Wu et al., ICLR 2025): Adam at 8e-3; their code's loop runs"
          " SGD at 1e-2 (ImageNet-R) or 8e-3 (CIFAR-100, exps/sdlora_c100.json)", batch=128,
          unscaled=config_keys.ADAM_UNSCALED)),
      weight_decay=common.shared(0.0, authors(0.0, f"{SDLORA}, models/sdlora.py: no weight decay"
                                              " passed to the optimiser")),
      rank=Key(10, "r of each component, in [1, model width]",
               authors(10, f"{SDLORA}, models/sdlora.py: the rank")),
      magnitude_init=Key(0.8, "alpha, the magnitude a new component starts with (the code's"
                         " 0.8)",
                         authors(0.8, f"{SDLORA}, backbone/lora.py: a new magnitude's start")),
      n_tasks=Key(0, "T, the component slots (one per task); 0 = data.n_tasks",
                  ours("read from the stream (data.n_tasks), as the authors' count of tasks is"
                       " read from their dataset split")))


METHODS = (base.MethodSpec(name="sd_lora", build=build, config=config, report_name="SD-LoRA",
                           table_row=20),)
