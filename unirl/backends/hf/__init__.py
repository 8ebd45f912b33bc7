"""What the Hugging Face engines (DeepSpeed, FSDP2, the next one) share, written once: the
microbatch loop (forward-only and training) over a model the engine supplies, the frozen
`PackedModule` and the `TrainedModel` protocol each engine implements once for the policy and the
critic, `HFBackend` holding those models, packed attention, the fused head, the optimizer, the
export and checkpoint staging. No module here imports an engine, and no engine folder imports
another. The model build (`unirl.backends.causal_lm`) sits one level up: Megatron converts from it
too."""
