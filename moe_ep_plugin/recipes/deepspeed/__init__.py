"""DeepSpeed MoE training example: YAML config → model on the plugin's ``MoE`` layer → training loop."""
