"""5-datasets: CIFAR-10, MNIST, SVHN, notMNIST and Fashion-MNIST in sequence, one task per dataset
(10 classes each, 50 in all), class-incremental across them, one pass.

    .venv/bin/python launch/run.py --config configs/five_datasets.py \
        --workdir runs/five_datasets --config.data.data_dir=DIR

DIR holds the TFDS datasets `cifar10`, `mnist`, `svhn_cropped` and `fashion_mnist` (`tfds build
NAME --file_format=array_record --data_dir=DIR`) and notMNIST's letter folders in
DIR/notMNIST_small/A..J (the archive notMNIST_small.tar.gz unpacked; it has no test split: 20% of
every letter is held out, seeded by data.split_seed; an unreadable file is named before any
compute: delete it). Each dataset's classes follow the previous one's (labels 0-9 CIFAR-10, 10-19
MNIST, ...), so 5 disjoint tasks in label order are the five datasets in this order (another
dataset order: an explicit data.class_order moving whole blocks of 10 labels); grey images are
repeated to 3 channels and every image is resized to model.image_size. Online-LoRA on a ViT: no
paper thresholds; Split CIFAR-100's 2.6 / 0.03.

Numbers reported for methods run here (%, after the last dataset):
- L2P (CVPR 2022), as its paper's result ("Paper Results") in the README of the PyTorch port
  JH-LEE-KR/l2p-pytorch (commit a7b8c7f; not checked against the paper's own table): average
  accuracy 81.14, forgetting 4.64 (`l2p`), no buffer, ViT-B/16 pretrained on ImageNet-21k. The
  port (datasets.py, configs/five_datasets_l2p.py; several later prompt codebases keep its order)
  orders the datasets SVHN, MNIST, CIFAR-10, notMNIST, Fashion-MNIST (here: data.class_order
  listing labels 20-29, 10-19, 0-9, 30-49) and trains 5 epochs per dataset (batch 16, lr 0.03),
  not one pass. The same port reproduces 79.68 / 3.71 with the official code.
- DualPrompt, HiDe-Prompt, CODA-Prompt, SLCA, EASE: no 5-datasets number from their own papers is
  verified (their released code ships scripts, no results).
"""

from configs.benchmark import benchmark_config


def get_config(backbone="vit_b16"):
  return benchmark_config(backbone, dataset="five_datasets", scenario="disjoint", n_tasks=5,
                          mean_threshold=2.6, var_threshold=0.03, native_size=32)
