"""LoRA fine-tuning (``--lora-rank``, ``--lora-adapter``): which modules a run adapts (:mod:`.spec`), the
adapters on megatron-core's tensor-parallel linear layers (:mod:`.layer`) and PEFT adapter folders
(:mod:`.peft_io`)."""
