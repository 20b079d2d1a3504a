"""Training helpers built on the model modules: the packing collator (:mod:`.collator`), the ``Trainer`` subclass,
LoRA defaults and callbacks (:mod:`.trainer`), and FSDP2 setup with sharded checkpoints (:mod:`.distributed`).

Not part of the remote code a checkpoint carries; these modules import the flat modules, never the reverse.
"""
