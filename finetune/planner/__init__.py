"""The per-GPU memory model and the choice of technique; json and yaml only, no torch."""
