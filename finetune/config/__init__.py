"""What the user writes, read without torch: shipped files, recipes (ours, axolotl's and LLaMA-Factory's), the schema of run keys, number ranges, the launch request."""
