"""Megatron-Core pretraining launcher (``moe-ep-pretrain``): YAML config → GPTModel with MoE layers → training loop."""
