"""Pure packing rules and algorithms: bin packing, the length model (tokenizer, chat template, image and video
token rules), layout, M-RoPE, the formats, statistics, retry, ownership.

This package imports no torch and nothing of the other parts (`tests/test_architecture.py`). Import what you
need from the module that owns it (`mmpack.packing.binpack.pack_lengths`, `mmpack.packing.layout`, ...): this
file imports nothing, so that a loader worker importing `mmpack.packing.batch` does not load numba, which only
the bin-packing kernels (`binpack`, `stats`' bounds) need.
"""
