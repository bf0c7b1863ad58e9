"""Checkpointing: where a run's state goes, and how it comes back exactly.

- ``tiers``: ``Tier`` (a place a checkpoint can be: its store, durable, remote, cadence, keep),
  ``Roles`` (home, lease, mirror) and ``tier_table``, the run's tiers;
- ``stores``: ``DirStore`` and ``GcsStore`` behind one ``Store`` interface; ``gcs_streams``: a
  large object in parallel streams (sliced downloads, composite uploads); ``objects``: what both
  speak of (``ObjectInfo``, ``UploadAborted``); ``crc32c``: Cloud Storage's checksum, and of a
  concatenation from its parts';
- ``checkpointer``: the one ``Checkpointer``, the save policy the loop talks to (when and where to
  save, durability), and its parts: ``bookkeeping`` (each tier's schedule and health, the stats),
  ``disk_writer``, ``uploader`` (the upload queue, retention), ``survey`` (what the tiers hold,
  the restore) and ``emergency`` (the emergency save);
- ``layout``: what a checkpoint layout is to the checkpointer, and the ranks that save together;
  ``whole_model`` and ``sharded`` (FSDP2 through DCP) are the two, ``host_copy`` the sharded
  layout's host buffers;
- ``manifest``: the commit record every layout shares, and which checkpoints are quarantined;
  ``format``: files, atomic folders and listings; ``file_hash``: a file's digest (BLAKE3, or
  SHA-256 in older checkpoints) and hashing while reading and writing; ``state_codec``: the
  pickle-free codec of a state's structure;
- ``key``: the run's checkpoint key (HMAC of every manifest); ``lease``: one trainer per run dir
  and one writer per job; ``tier_wait``: start-up's rule for a tier it cannot read;
  ``interval``: the automatic cadence (Young/Daly); ``reader``: read-only, verified access to a
  run's checkpoint (``export``, ``init_from``).

It imports nothing from the observers, the data or the loop above it
(``tests/trainer/test_layering.py``).
"""
