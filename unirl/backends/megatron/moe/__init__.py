"""Mixture-of-experts on megatron-core: the MoE layer specs, experts on ``torch._grouped_mm`` (or
megatron's `SequentialMLP`), their dispatcher, the router's stages and losses, and routing
record / replay."""
