"""The data a run trains on: its order, its batches, token shards and staging onto the disk.

Besides the modules it holds the bundled default corpus (``corpus.txt``, made by
``make_corpus.py``; see ``README.txt``).
"""
