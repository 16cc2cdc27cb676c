"""Every refusal that needs no loaded model: the recipe, the launch files, the model folder, the relaunch."""
