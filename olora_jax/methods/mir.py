"""MIR, maximally interfered retrieval (Aljundi et al. 2019).

Each step: draw `mir.n_candidates` stored samples uniformly; take a virtual SGD step on CE(batch)
with the learning rate, theta_v = theta - lr * grad; retrieve the `mir.replay_batch` candidates
whose loss rises most, CE(theta_v) - CE(theta); take one Adam step on CE(batch) + CE(retrieved);
then offer the batch to the reservoir. Paper: buffer 500, 50 candidates, LR 1e-4, WD 1e-4; the
10 retrieved per batch follow the original code's memory batch.

`replay_pass` as ER's (er.py): 'separate' passes the batch and the retrieved samples apart, as
the online-continual-learning codebase's MIR does (a different function only on a model with
BatchNorm), and moves the running statistics by the candidates' scoring pass and then the
retrieved samples' pass, after the batch's, as its training-mode passes do. On such a model every
pass, the interference scores' included, normalises with its valid rows alone.

`data.replay_draws`: each step's reservoir decisions and its candidates (the file's
`replayed_slots`, at most n_candidates) are read from a file instead of drawn; the retrieval
among them is MIR's own.
"""

from __future__ import annotations

import jax
import jax.numpy as jnp

from olora_jax import config_keys
from olora_jax.config_keys import Key, authors, ours, paper
from olora_jax.methods import base, common, er, replay


def interference(apply, params, frozen, batch: dict, candidates: dict, learning_rate: float,
                 rows=lambda mask: {}):
  """Per candidate (N,): CE after the virtual SGD step on the batch minus CE before; -inf for an
  invalid candidate. `rows(mask)`: the model keywords of a pass over the rows `mask` keeps
  (`er.norm_rows`: on a BatchNorm model each pass normalises with its valid rows alone, as the
  authors' code passes only the samples it holds). Pure."""

  def ce(p, part):
    return common.per_example_ce(apply(frozen, p, part["images"], **rows(part["mask"])),
                                 part["labels"])

  grads = jax.grad(lambda p: common.masked_mean(ce(p, batch), batch["mask"]))(params)
  virtual = jax.tree.map(lambda p, g: p - learning_rate * g, params, grads)
  rise = ce(virtual, candidates) - ce(params, candidates)
  return jnp.where(candidates["mask"], rise, -jnp.inf)


def build(ctx: base.Context) -> base.Method:
  block, scale = ctx.config.mir, ctx.config.data.input_scale

  def retrieve(apply, state, batch, key):
    if "given_draws" in state:  # the candidates a file gives (data.replay_draws)
      candidates = replay.given_sample(
          state["buffer"], state["given_draws"]["replayed_slots"][state["step"]], scale)
    else:
      candidates = replay.sample(state["buffer"], key, block.n_candidates, scale)
    rise = interference(apply, state["params"], state["frozen"], batch, candidates,
                        block.learning_rate, lambda mask: er.norm_rows(ctx, mask))
    _, top = jax.lax.top_k(rise, common.replay_batch(ctx, block))
    # The candidates' scoring pass, in training mode, comes before the retrieved samples' pass.
    return {**jax.tree.map(lambda x: x[top], candidates), "passes_before": (candidates,)}

  return er.make(ctx, "mir", block, retrieve, draw_size=block.n_candidates)


def config():
  """The `mir` block: each key with its meaning (the paper's appendix values)."""
  return common.baseline_block(
      learning_rate=Key(1e-4, "Adam's learning rate, constant (> 0); also the step size of the"
                        " virtual SGD step that scores interference", paper(1e-4, rate=True)),
      weight_decay=common.shared(1e-4, paper(1e-4)),
      buffer_size=common.shared(500, common.PAPER_BUFFER),
      n_candidates=Key(50, "stored samples drawn uniformly each step as retrieval candidates"
                       " (the paper's \"number of subsample\"), in [replay_batch, buffer_size]",
                       paper(50, config_keys.PAPER_TABLE + ": number of subsample")),
      replay_pass=Key("joint", "'joint' (the batch and the retrieved samples in one forward"
                      " pass) | 'separate' (a pass each, as the online-continual-learning"
                      " codebase's MIR: on a model with BatchNorm each normalises with its own"
                      " statistics, and the candidates' scoring pass and then the retrieved"
                      " samples' pass move the running statistics too); the same function on a"
                      " model without BatchNorm", ours(er.ONE_PASS)),
      replay_batch=Key(10, "candidates replayed per step: those whose loss a virtual step on the"
                       " batch raises most, at most n_candidates; 0 = learner.batch_size",
                       authors(10, "RaptorMai/online-continual-learning, general_main.py:"
                               " --eps_mem_batch")))


PAPER_RESULTS = {
    "table1": {
        "cifar100 disjoint/10 vit_b16": ((48.36, 3.11), (43.41, 1.02)),
        "imagenet_r disjoint/10 vit_b16": ((41.51, 2.99), (31.32, 5.17)),
        "imagenet_sketch disjoint/10 vit_b16": ((30.33, 3.81), (35.92, 1.75)),
        "caltech_birds2011 disjoint/5 vit_b16": ((31.64, 2.97), (23.43, 0.05)),
        "cifar100 disjoint/10 vit_s16": ((29.08, 1.14), (39.42, 1.6)),
        "imagenet_r disjoint/10 vit_s16": ((34.73, 0.29), (48.66, 0.69)),
        "imagenet_sketch disjoint/10 vit_s16": ((13.96, 1.95), (42.61, 0.08)),
        "caltech_birds2011 disjoint/5 vit_s16": ((22.95, 1.12), (32.54, 0.88)),
    },
    "swin": {  # the appendix's Swin-T table
        "imagenet_sketch disjoint/10 swin_t": ((42.9, 0.19), (38.49, 0.15)),
        "core50 domain/8 swin_t": ((87.47, 0.65), (5.67, 0.14)),
    },
}

METHODS = (base.MethodSpec(name="mir", build=build, config=config, report_name="MIR",
                           table_row=4, paper_results=PAPER_RESULTS,
                           check=base.Check("step", er.OCL, "tests/test_parity_ocl.py",
                                            "with the paper's Adam at 1e-4 (weight decay 1e-4,"
                                            " 50 candidates, 10 retrieved), batch 10, a 100-slot"
                                            " buffer and their reservoir decisions and candidates:"
                                            " all 40 steps and 5 task ends of one seed, float32;"
                                            " the set retrieved, which float32 rounding moves in"
                                            " their own run, through its loss's median and maximum",
                                            settings={"model.name": "resnet18_reduced",
                                                      "mir.replay_pass": "separate",
                                                      "mir.trainable": "all"},
                                            code=er.OCL_CODE)),)
