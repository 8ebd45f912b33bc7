"""Hugging Face weights and megatron-core's layouts: the name and shard mapping for every TP / PP /
VPP / EP layout, and reading and writing Hugging Face folders."""
