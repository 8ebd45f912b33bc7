"""Hugging Face weights and megatron-core's layouts: the name and shard mapping for every TP / PP /
VPP / EP layout, reading and writing Hugging Face folders, and the weight stream (the policy's
weights as buckets of Hugging Face tensors, made on the stage that owns them)."""
