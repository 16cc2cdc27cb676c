"""The SFT run with torch, transformers and TRL: arguments, model, trainer, saving, generation, evaluation, speed, tracking."""
