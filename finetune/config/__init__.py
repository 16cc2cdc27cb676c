"""What the user writes, read without torch: shipped files, recipes (ours and axolotl's), the schema of run keys, number ranges, the launch request."""
