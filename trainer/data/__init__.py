"""The data a run trains on.

- ``sampler``: the data order (a keyed permutation per epoch, one integer of position);
  ``batches``: micro-batches in that order, inline or from worker processes;
- ``token_shards``: nanoGPT-format token shards as a dataset; ``staging``: a ``gs://`` prefix
  copied onto the disk before training (``python -m trainer stage``);
- the bundled default corpus (``corpus.txt``, made by ``make_corpus.py``; see ``README.txt``).
"""
