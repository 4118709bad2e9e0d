"""The Gemma 4 family (``model_type`` ``gemma4``): its architecture read from ``config.json`` (:mod:`.config`),
the attention masks of a packed bin (:mod:`.masks`), per-layer-type RoPE (:mod:`.rope`), the language model's
layers on megatron-core (:mod:`.language`), one pipeline stage (:mod:`.stage`), the vision tower (:mod:`.vision`),
the HF weight rules (:mod:`.hf_io`) and the family (:mod:`.family`)."""

from mmpack.trainer.models.gemma4.family import FAMILY, MOE_FAMILY

__all__ = ["FAMILY", "MOE_FAMILY"]
