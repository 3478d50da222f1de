"""Recipes: runnable programs built on the library and its integrations, one folder per recipe.

``train`` is the example MoE trainer (``moe-ep-train``), ``megatron`` the Megatron-Core pretraining launcher
(``moe-ep-pretrain``), ``deepspeed`` the DeepSpeed MoE training example, and ``common`` the pieces they share
(learning-rate schedule, checkpoints, progress, token data, YAML sections). The integrations
(``moe_ep_plugin.megatron``, ``moe_ep_plugin.deepspeed``) never import a recipe.
"""
