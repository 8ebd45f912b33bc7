"""What the Hugging Face engines (DeepSpeed, FSDP2, the next one) share, written once; no module
here imports an engine, and no engine folder imports another.

- `loop`: the microbatch loop, forward-only and training, over a model the engine supplies and a
  head (log-probs for the policy and the reference, values for the critic).
- `model`: `PackedModule` (a frozen model: the reference) and the `TrainedModel` protocol each
  engine implements once, for the policy and the critic alike.
- `backend`: `HFBackend`, the `TrainingBackend` holding those models; `critic`: `HFCritic`.
- `packed`: packed microbatches through varlen / bucketed attention (`forward_packed`).
- `fused_head`: ``model.fused_head`` for HF causal LMs.
- `optim`: AdamW param groups and `ScheduledLR`; `export`: the HF folder with the tokenizer
  files; `checkpoint`: staging, RNG states, the ``complete`` marker, the load checks.

The model build (`unirl.backends.hf_model`) sits one level up: Megatron converts from it too.
"""
