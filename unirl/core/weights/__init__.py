"""The policy's weights on their way to a rollout engine, engine-neutral: the stream (buckets of
Hugging Face-named tensors made by the ranks that own them, one flat buffer each) and the
fingerprint that proves an engine holds what the stream sent (per layer, float64, invariant to
an engine's fused layouts and shards)."""
