"""The SFT run (torch, transformers, TRL): arguments, model, trainer, saving, generation, evaluation, merging, speed, tracking."""
