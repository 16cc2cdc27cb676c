"""What is done to a model's modules: attention, compilation, expert LoRA, FP8, MXFP4, the CPU's stand-ins, the tiny models."""
