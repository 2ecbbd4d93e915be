"""HF <-> Megatron weights: layouts, HF safetensors, and Megatron checkpoints on disk.

* ``tables.py``: the HF <-> Megatron layout of every parameter at any TP (one mechanism for every use);
* ``hf_io.py``: HF safetensors reading (each rank its own slices) and side files;
* Megatron checkpoints, megatron-core ``torch_dist`` and legacy Megatron-LM ``torch`` files:
  ``ckpt_format.py`` (file names, which format a path holds), ``safe_load.py`` (no pickle executed
  unchecked), ``megatron_args.py`` (Megatron-LM's saved args <-> ModelArgs), ``shards.py`` and
  ``layer_cache.py`` (what readers and writers share), ``legacy.py`` and ``torch_dist.py`` (readers),
  ``ckpt_write.py`` (writers). Both readers expose ``HFReader``'s interface (``read(piece, dim)``,
  ``get``, ``keys``), so every consumer of HF tensors (model filling, HF export, legacy export) works
  on any source through the one layout mechanism of ``tables.py``.

Our own metadata (``megatron_rl.json``: the HF config, the role, the layout it was saved at) is
written beside every torch_dist checkpoint, so the architecture is known without guessing.
"""
