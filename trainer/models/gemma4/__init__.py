"""The Gemma 4 family (``model_type`` ``gemma4``), first stage: its architecture read from ``config.json``
(:mod:`.config`) and the attention masks of a packed bin (:mod:`.masks`). The megatron-core language model, the
vision tower and the HF weight rules are not built yet, so the family is not in the registry
(:data:`mmpack.trainer.models.FAMILIES`); docs/families.md says what is done and what is not.
"""
