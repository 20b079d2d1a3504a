"""Training helpers built on the flat modules (SFT examples, collator, Trainer, FSDP2 / EP); not remote code."""
