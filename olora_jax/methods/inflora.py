"""InfLoRA, interference-free low-rank adaptation (Liang & Li, CVPR 2024), online and task-free.

The paper's method, task t (0-based) of T. Each branch is down_t (D, r), the paper's
dimensionality-reduction matrix B_t (designed, frozen), and up_t (r, D), its A_t (trained); a
projection computes x W + (x down_t) up_t in this project's (in, out) layout.
  1. Before training task t, design the new branch's down-projection of every adapted layer l
     from the task's inputs h (the inputs of the layer's attention, under the model as it is):
         C_t = mean over tokens of h h^T                                   (D x D)
         C^_t = (I - M M^T) C_t               M: an orthonormal basis of the earlier tasks'
                                              input (gradient) subspace; empty for t = 0
         down_t = (I - M M^T) U_r / sqrt(3)   U_r: the top-r left singular vectors of C^_t
     so every column of down_t lies in the new task's input subspace and orthogonal to the
     earlier tasks' (the paper's rows of B_t in N_t intersect M_t^perp). It is frozen from then
     on.
  2. Train only the up-projection (zero at first) and the head:
         W_l x + sum_{s<t} up_s^T down_s^T x + up_t^T down_t^T x
     The earlier branches are frozen; we merge each into the backbone when its task ends
     (`merge_into_backbone`: kernel += down @ up, the same function), so one branch slot is
     live at a time and the state has one static shape for any number of tasks.
  3. After task t, the DualGPM update of M with the task's input covariance C_t and the
     threshold eps_t = eps_start + (eps_end - eps_start) * t / T (the code's lamb -> lame):
         energy already in M:  e0 = 1 - ||(I - M M^T) C_t||^2 / ||C_t||^2
         add the top k left singular vectors of (I - M M^T) C_t, k the fewest with
         e0 + sum_{i<k} s_i^2 / ||C_t||^2 >= eps_t      (s_i its singular values; ||.||^2 the
                                                          sum of squared singular values)
The same function at every step (one trace): a boundary counter `task` (traced int32) feeds the
threshold schedule, `pending` marks a branch whose down-projection is still to be designed.

Online, task-free reading (ours; the paper trains each task for epochs with its boundaries):
  - Step 1 needs the new task's inputs before training on them. Online they arrive as a stream:
    the branch is designed in the FIRST STEP after a boundary, from that batch's input
    covariance (every valid item, every token), before that batch's update (a `lax.cond`
    inside the one jitted step; the other steps skip it). The paper (and code) use every
    training image of the task.
  - Step 3's C_t is the task's input covariance, which the code computes after training with
    a second pass over the task's data. Online there is no second pass: C_t is a running mean
    of h h^T over every token of every valid item of the task's stream, accumulated in the
    state (`cov`, `count`) while the task streams (under the model as it trains), and used and
    reset at the boundary.
  - Boundaries come from the run's switch (`boundaries.rule`). With 'none' nothing is ever
    merged or updated: one branch, designed from the stream's first batch, trains for the
    whole stream. With 'plateau' the boundaries are the loss-window rule's; past T of them
    eps stays at its last value eps_{T-1}.
  - T is `inflora.n_tasks` (0: data.n_tasks); it enters only the threshold schedule.
  - A full M (no free direction left) designs a zero branch: the layer stops adapting.
  - The cross-entropy is over every class on one shared head (the project's fair setting, as
    for L2P): the code's per-task classifiers and current-task logit masking are not used.

Where the paper and the released code differ (docs/methods/inflora.md; we follow the code
unless said):
  - adapted projections: the code adds the branch to k and v; we add it to q and v (the LoRA
    targets of this project, Online-LoRA's and SD-LoRA's). The design is the same for q, k and
    v (they share the input); only which output the up-projection writes to differs.
  - the energy criterion: GPM's measures the squared singular values of the representation
    matrix [h_1 ... h_n]; the code applies it to the D x D covariance C_t (squared singular
    values of C_t, so fourth powers of the representation's), and its eps schedule (0.98 -> 1
    on ImageNet-R) was set that way: we follow the code.
  - the first task: the code keeps one direction fewer than the criterion (the count of
    prefixes BELOW eps); we apply the same criterion (reach eps) at every boundary.
  - DualGPM stores M or its complement, whichever is smaller, to save memory; we store a D x D
    basis with a column count (the same subspace, static shapes).
  - the 1/sqrt(3) scale of the designed down-projection is the code's (the paper has none).
  - new optimizer per task: the Adam state (up-projection and head) is reset at each boundary,
    as the code builds a new optimizer for every task.

ViT-B/16 ImageNet-R (10 tasks) in the code's config: rank 10, Adam lr 5e-4 (cosine over 50
epochs per task; online: one pass, constant), weight decay 0, eps 0.98 -> 1.0, batch 128.
"""

from __future__ import annotations

import functools
import math

import jax
import jax.numpy as jnp

from olora_jax import config_keys
from olora_jax.config_keys import Constant, Key, authors, ours
from olora_jax.methods import base, common
from olora_jax.models import lora as lora_lib
from olora_jax.models.vit import LORA_TARGETS

INFLORA = "liangyanshuo/InfLoRA"  # the authors' released code, where the defaults come from

DESIGN_SCALE = 1.0 / math.sqrt(3.0)  # the released code's scale of a designed down-projection
CONSTANTS = {
    "DESIGN_SCALE": Constant("a designed down-projection is multiplied by it, 1/sqrt(3)",
                             authors(1.0 / math.sqrt(3.0), f"{INFLORA}: the designed"
                                     " down-projection divided by sqrt(3) (the paper has none)")),
}


def layer_inputs(module, method_name: str) -> bool:
  """The capture filter: the output of each block's first LayerNorm, the input of q, k and v."""
  return method_name == "__call__" and module.name == "LayerNorm_0"


def lora_tree(down: jax.Array, up: jax.Array) -> dict:
  """The ViT's LoRA tree from the stacked branch: down (L, D, r) shared by q and v (they see the
  same input), up (L, len(LORA_TARGETS), r, D)."""
  return {f"encoderblock_{i}": {t: {"lora_a": down[i], "lora_b": up[i, j]}
                                for j, t in enumerate(LORA_TARGETS)}
          for i in range(down.shape[0])}


def batch_moment(inputs: jax.Array, mask: jax.Array) -> tuple[jax.Array, jax.Array]:
  """(sum of h h^T over the valid items' tokens (L, D, D), their token count ()) of the captured
  layer inputs (L, B, N, D)."""
  inputs = inputs.astype(jnp.float32)
  weight = mask.astype(jnp.float32)
  moment = jnp.einsum("lbnd,lbne,b->lde", inputs, inputs, weight)
  return moment, jnp.sum(weight) * inputs.shape[2]


def masked_basis(basis: jax.Array, dim: jax.Array) -> jax.Array:
  """The first `dim` columns of a (D, D) basis, the others zeroed: M."""
  return basis * (jnp.arange(basis.shape[-1]) < dim)


def project_off(basis: jax.Array, dim: jax.Array, x: jax.Array) -> jax.Array:
  """(I - M M^T) x for M the first `dim` columns of `basis`."""
  m = masked_basis(basis, dim)
  return x - m @ (m.T @ x)


def design_down(cov: jax.Array, basis: jax.Array, dim: jax.Array, rank: int) -> jax.Array:
  """Step 1 for one layer: (I - M M^T) U_r / sqrt(3), U_r the top-r left singular vectors of
  (I - M M^T) C. The final projection keeps columns that C^ does not span (its rank below r)
  orthogonal to M too."""
  u = jnp.linalg.svd(project_off(basis, dim, cov))[0]
  return project_off(basis, dim, u[:, :rank]) * DESIGN_SCALE


def update_subspace(cov: jax.Array, basis: jax.Array, dim: jax.Array, threshold: jax.Array
                    ) -> tuple[jax.Array, jax.Array]:
  """Step 3 for one layer: (basis, dim) with the new directions of C appended as columns
  dim .. dim + k - 1 (module docstring); unchanged for a zero C (no input seen)."""
  d = cov.shape[-1]
  total = jnp.sum(jnp.linalg.svd(cov, compute_uv=False) ** 2)
  u, s, _ = jnp.linalg.svd(project_off(basis, dim, cov))
  safe_total = jnp.where(total > 0, total, 1.0)
  captured = 1.0 - jnp.sum(s ** 2) / safe_total  # energy of C already in M
  reach = captured + jnp.concatenate([jnp.zeros(1), jnp.cumsum(s ** 2 / safe_total)])
  enough = reach >= threshold
  k = jnp.where(jnp.any(enough), jnp.argmax(enough), d)
  k = jnp.where(total > 0, jnp.minimum(k, d - dim), 0)
  # Column j of u goes to column dim + j of the basis, for j < k.
  place = jax.nn.one_hot(dim + jnp.arange(d), d, dtype=u.dtype) * (jnp.arange(d) < k)[:, None]
  return masked_basis(basis, dim) + u @ place, dim + k


def threshold_at(block, task: jax.Array, n_tasks: int) -> jax.Array:
  """eps after task `task` (0-based): the code's linear schedule, held at its last value."""
  t = jnp.minimum(task, n_tasks - 1).astype(jnp.float32)
  return block.threshold_start + (block.threshold_end - block.threshold_start) * t / n_tasks


def build(ctx: base.Context) -> base.Method:
  block = ctx.config.inflora
  n_tasks, model, rank = common.task_slots(ctx, block), ctx.model, block.rank
  depth, width = ctx.spec.depth, ctx.spec.width
  tx = common.make_adam(block.learning_rate, block.weight_decay)

  def forward(frozen, params, down, images):
    """(logits (B, C), the adapted layers' inputs (L, B, N, D))."""
    logits, captured = model.apply(
        {"params": {**frozen, "head": params["head"]}}, images,
        lora=lora_tree(down, params["up"]), capture_intermediates=layer_inputs,
        mutable=["intermediates"])
    found = captured["intermediates"]
    return logits, jnp.stack([found[f"encoderblock_{i}"]["LayerNorm_0"]["__call__"][0]
                              for i in range(depth)])

  def init(key, params):
    params = jax.tree.map(jnp.array, params)
    trainable = {"up": jnp.zeros((depth, len(LORA_TARGETS), rank, width), jnp.float32),
                 "head": params["head"]}
    backbone = {k: v for k, v in params.items() if k != "head"}
    return {**common.state_of(trainable, backbone, tx, key),
            "down": jnp.zeros((depth, width, rank), jnp.float32),  # designed, frozen (step 1)
            "pending": jnp.ones((), bool),  # the live branch awaits its design
            "task": jnp.zeros((), jnp.int32),  # boundaries passed
            "cov": jnp.zeros((depth, width, width), jnp.float32),  # the task's running C_t
            "count": jnp.zeros((), jnp.float32),  # tokens in `cov`
            "basis": jnp.zeros((depth, width, width), jnp.float32),  # M, by columns
            "basis_dim": jnp.zeros((depth,), jnp.int32)}

  def designed(state, batch):
    """The live branch's down-projection, designed from this batch if it is pending."""

    def design(state):
      _, inputs = forward(state["frozen"], state["params"], state["down"], batch["images"])
      moment, n = batch_moment(inputs, batch["mask"])
      cov = moment / jnp.maximum(n, 1.0)
      return jax.vmap(functools.partial(design_down, rank=rank))(
          cov, state["basis"], state["basis_dim"])

    return jax.lax.cond(state["pending"], design, lambda state: state["down"], state)

  @common.train_step("inflora")
  def train_step(state, batch):
    down = designed(state, batch)

    def loss_fn(params):
      logits, inputs = forward(state["frozen"], params, down, batch["images"])
      loss = common.masked_mean(common.per_example_ce(logits, batch["labels"]), batch["mask"])
      return loss, inputs

    (loss, inputs), grads = jax.value_and_grad(loss_fn, has_aux=True)(state["params"])
    moment, n = batch_moment(jax.lax.stop_gradient(inputs), batch["mask"])
    total = state["count"] + n
    cov = state["cov"] + (moment - n * state["cov"]) / jnp.maximum(total, 1.0)
    state = {**state, "down": down, "pending": jnp.zeros((), bool), "cov": cov, "count": total}
    return common.apply_gradients(state, grads, tx), {"loss": loss}, {}

  def boundary(state):
    """Merge the live branch, update M with the task's C_t, open a pending branch."""
    common.TRACE_COUNTS["inflora.at_boundary"] += 1
    frozen = lora_lib.merge_into_backbone(state["frozen"],
                                          lora_tree(state["down"], state["params"]["up"]))
    threshold = threshold_at(block, state["task"], n_tasks)
    basis, dim = jax.vmap(update_subspace, in_axes=(0, 0, 0, None))(
        state["cov"], state["basis"], state["basis_dim"], threshold)
    params = {**state["params"], "up": jnp.zeros_like(state["params"]["up"])}
    return {**state, "frozen": frozen, "params": params, "opt_state": tx.init(params),
            "down": jnp.zeros_like(state["down"]), "pending": jnp.ones((), bool),
            "task": state["task"] + 1, "cov": jnp.zeros_like(state["cov"]),
            "count": jnp.zeros_like(state["count"]), "basis": basis, "basis_dim": dim}

  boundary_jit = jax.jit(boundary)

  def at_boundary(state, host):
    state = boundary_jit(state)
    # The subspace's size per layer after each boundary, for the run's record.
    dims = [int(d) for d in jax.device_get(state["basis_dim"])]
    return state, {**host, "subspace_dims": [*host.get("subspace_dims", []), dims]}

  def predict(state, images):
    return forward(state["frozen"], state["params"], state["down"], images)[0]

  return base.Method(name="inflora", init=init, train_step=train_step, predict=predict,
                     at_boundary=at_boundary)


def config():
  """The `inflora` block: the code's ViT-B/16 ImageNet-R settings (module docstring)."""
  return common.baseline_block(
      trainable=Key("lora", "'lora', the only value: the branches' up-projections, plus the"
                    " head",
                    authors("lora", f"{INFLORA}, methods/inflora.py: the branches' up-projections"
                                    " and the head")),
      learning_rate=Key(5e-4, "Adam's learning rate, constant online (> 0)",
                        authors(5e-4, f"{INFLORA}, configs/mimg10_inflora.json: lrate (Adam)",
                                batch=128, unscaled=config_keys.ADAM_UNSCALED)),
      weight_decay=common.shared(0.0, authors(0.0, f"{INFLORA}, configs/mimg10_inflora.json:"
                                                   " weight_decay")),
      rank=Key(10, "r of each task's branch, in [1, model width]",
               authors(10, f"{INFLORA}, configs/mimg10_inflora.json: rank")),
      threshold_start=Key(0.98, "the DualGPM energy threshold eps at the first task (the code's"
                          " lamb); 0 < threshold_start <= threshold_end <= 1",
                          authors(0.98, f"{INFLORA}, configs/mimg10_inflora.json: lamb"
                                        " (CIFAR-100's config: 0.95)")),
      threshold_end=Key(1.0, "eps after the last task (the code's lame), linear in between",
                        authors(1.0, f"{INFLORA}, configs/mimg10_inflora.json: lame")),
      n_tasks=Key(0, "T of that threshold schedule; 0 = data.n_tasks",
                  ours("read from the stream (data.n_tasks), as the authors' count of tasks is"
                       " read from their dataset split")))


METHODS = (base.MethodSpec(name="inflora", build=build, config=config, report_name="InfLoRA",
                           table_row=19),)
