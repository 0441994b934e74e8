"""L2P, learning to prompt (Wang et al. 2022), in the paper's fair task-free setting.

A pool of `l2p.pool_size` prompts of `l2p.prompt_length` tokens with one key each
(prompt_pool.py). Each image queries the pool with the frozen model's class token and takes the
`l2p.top_k` prompts of the nearest keys (1 - cos); they are inserted after the class token
(no position embedding) and the head reads the mean of the prompt tokens' outputs. Trained:
prompts, keys and head; the backbone is frozen. Each step minimises
    CE(head(f_avg(x_p)), y) + key_loss_weight * sum_{selected i} (1 - cos(q(x), k_i))
(L2P's Eq. 5: the key-matching, "surrogate", loss pulls the selected keys to their queries).
No task id reaches the selection and none of the original code's class masking is done (the
paper's fair setting, Online-LoRA sec. 2). At evaluation only keys that some training step
selected are candidates (`prompt_pool.trained_only`; the state counts the selections).
Paper: pool 10, length 10, 4 prompts, LR 3e-3.
"""

from __future__ import annotations

import jax
import jax.numpy as jnp

from olora_jax import config_keys
from olora_jax.config_keys import Key, authors, paper
from olora_jax.methods import base, common, prompt_pool

L2P = "google-research/l2p"  # the authors' released code (JAX)


def build(ctx: base.Context) -> base.Method:
  block = ctx.config.l2p
  tx, apply = common.optimizer_and_apply(ctx, block)

  def init(key, params):
    state = common.init_state(
        key, params, block.trainable, ctx.spec, ctx.config.learner.rank, tx,
        init_prompts=lambda k: prompt_pool.init(k, block.pool_size, block.prompt_length,
                                                ctx.spec.width))
    return {**state, "selection_count": jnp.zeros((block.pool_size,), jnp.float32)}

  def forward(frozen, params, images, queries, counts=None):
    """(logits (B, C), distances of the selected keys (B, N), their indices (B, N)); with
    `counts` (evaluation) only the keys selected in training are candidates."""
    distance = prompt_pool.key_distance(queries, params["prompt_pool"]["keys"])
    score = distance if counts is None else prompt_pool.trained_only(distance, counts)
    idx = prompt_pool.select(score, block.top_k)
    logits = apply(frozen, params, images, pool="prompts",
                   prompts=prompt_pool.prompt_tokens(params["prompt_pool"], idx))
    return logits, jnp.take_along_axis(distance, idx, axis=1), idx

  @common.train_step("l2p")
  def train_step(state, batch):
    queries = prompt_pool.query(apply, state["frozen"], batch["images"])

    def loss_fn(params):
      logits, selected, idx = forward(state["frozen"], params, batch["images"], queries)
      ce = common.masked_mean(common.per_example_ce(logits, batch["labels"]), batch["mask"])
      key_loss = common.masked_mean(jnp.sum(selected, axis=1), batch["mask"])
      return ce + block.key_loss_weight * key_loss, (dict(ce=ce, key_loss=key_loss), idx)

    (loss, (aux, idx)), grads = jax.value_and_grad(loss_fn, has_aux=True)(state["params"])
    state = common.apply_gradients(state, grads, tx)
    state["selection_count"] = prompt_pool.count_selected(state["selection_count"], idx,
                                                          batch["mask"])
    return state, {"loss": loss, **aux}, {"prompt_idx": idx}

  def predict(state, images):
    queries = prompt_pool.query(apply, state["frozen"], images)
    return forward(state["frozen"], state["params"], images, queries,
                   state["selection_count"])[0]

  return base.Method(name="l2p", init=init, train_step=train_step, predict=predict)


def config():
  """The `l2p` block: each key with its meaning (the paper's table: pool 10, length 10, 4
  prompts, LR 3e-3, no weight decay)."""
  return common.baseline_block(
      trainable=Key("prompts", "'prompts', the only value: the prompt pool with its keys, plus"
                    " the head, on the frozen backbone",
                    authors("prompts", f"{L2P}, configs/cifar100_l2p.py: the frozen backbone")),
      learning_rate=common.shared(3e-3, paper(3e-3, rate=True)),
      weight_decay=common.shared(0.0, authors(0.0, f"{L2P}, configs/cifar100_l2p.py:"
                                              " weight_decay")),
      pool_size=Key(10, "prompts in the pool, each with one key (>= 1)",
                    paper(10, config_keys.PAPER_TABLE + ": size of the prompt pool")),
      prompt_length=Key(10, "tokens per prompt (>= 1)",
                        paper(10, config_keys.PAPER_TABLE + ": length of a single prompt")),
      top_k=Key(4, "prompts an image takes: those whose keys are nearest its frozen class"
                " token, in [1, pool_size]",
                paper(4, config_keys.PAPER_TABLE + ": number of prepended prompts")),
      key_loss_weight=Key(0.1, "L2P's lambda on the key-matching loss sum (1 - cos(query, key))"
                          " (>= 0; *ours*: not in the paper's table)",
                          authors(1.0, f"{L2P}, configs/cifar100_l2p.py: pull_constraint_coeff",
                                  differs="0.1, the PyTorch port's (JH-LEE-KR/l2p-pytorch,"
                                  " configs/cifar100_l2p.py), which this row has always run;"
                                  " the official config's 1.0 is one override away")))


PAPER_RESULTS = {
    "table2": {
        "cifar100 si_blurry/5 vit_b16": ((43.01, 9.37), (39.86, 2.28)),
        "imagenet_r si_blurry/5 vit_b16": ((22.71, 1.86), (27.08, 2.49)),
        "imagenet_sketch si_blurry/5 vit_b16": ((10.02, 0.42), (13.58, 4.04)),
        "cifar100 si_blurry/5 vit_s16": ((37.82, 12.19), (30.88, 1.39)),
        "imagenet_r si_blurry/5 vit_s16": ((24.31, 1.83), (21.83, 2.13)),
        "imagenet_sketch si_blurry/5 vit_s16": ((2.0, 0.12), (3.61, 1.08)),
    },
}

METHODS = (base.MethodSpec(name="l2p", build=build, config=config, report_name="L2P",
                           table_row=11, paper_results=PAPER_RESULTS),)
