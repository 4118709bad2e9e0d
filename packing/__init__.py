"""Pure packing algorithms: bin packing, the length model, packed-sequence layout, statistics.

This package imports no torch.
"""
