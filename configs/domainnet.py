"""DomainNet, domain-incremental: 6 tasks, one per domain (clipart, infograph, painting,
quickdraw, real, sketch, in that order, as S-Prompts runs it), each with all 345 classes, one
pass; evaluated on every domain's test split.

    .venv/bin/python launch/run.py --config configs/domainnet.py \
        --workdir runs/domainnet --config.data.data_dir=DIR

DIR holds TFDS's six `domainnet/<domain>` configs (`tfds build domainnet
--file_format=array_record --data_dir=DIR`, every config). The domain of each image is its task
(data.scenario='domain'; olora_jax/data/sequences.py). Online-LoRA: no paper thresholds; Split
ImageNet-R's 5.2 / 0.02. TFDS builds the cleaned DomainNet from the `<domain>_train.txt` /
`<domain>_test.txt` lists, the lists the papers below read.

Numbers reported for methods run here (%, after the last domain):
- RanPAC (NeurIPS 2023), its released table data (RanPAC's paper_tables/
  Table_data_main_domainnet.csv; timm 0.6.12's vit_base_patch16_224, the AugReg ImageNet-21k ->
  1k weights, not this config's augreg2 file; seed 1993; domains in the order real, quickdraw,
  painting, sketch, infograph, clipart): without its first phase (random projection M = 10,000
  and ridge head on the frozen features, as `ranpac` here) 64.7; "NCM only" (class means of the
  frozen features, cosine, as `simplecil`; the means at the end do not depend on the order) 46.4;
  RanPAC with its first-phase adapter (not implemented here) 66.6. Both rows train nothing, so
  one pass loses them nothing. Their metric is the accuracy over the pooled test images of all
  six domains, this run's A_last (A_final weighs the six domains equally); they choose the ridge
  lambda at each domain on its last 20% (`ranpac` here: on every 5th sample of the stream).
- S-Prompts (NeurIPS 2022), Table 3 ("task-agnostic test results on DomainNet for object DIL",
  as the authors' README shows it), Average Acc, no buffer: L2P 40.15, LwF 49.19 (`l2p`, `lwf`),
  in this config's domain order; trained for epochs per domain, not one pass; the table names no
  backbone.
"""

from configs.benchmark import benchmark_config


def get_config(backbone="vit_b16"):
  return benchmark_config(backbone, dataset="domainnet", scenario="domain", n_tasks=6,
                          mean_threshold=5.2, var_threshold=0.02)
