"""LoRA on megatron-core's parallel linears, written here (no Megatron-Bridge): an activation-path
branch ``y = base(x) + scale * B(A(dropout(x)))`` beside each adapted linear (`branch`), one
adapter per Hugging Face target also inside the fused ``linear_qkv`` / ``linear_fc1``
(`layout`), installed on a model's chunks with the base frozen (`install`; unirl's grouped
experts run their experts' adapters in grouped matmuls: `grouped`), gathered into PEFT's names,
loaded from a PEFT folder and merged into the exported weights (`state`)."""
