"""Maths: log-probs from (vocabulary-sharded) logits and their kernels, KL estimators, the policy
and value losses, and the advantage estimators. Pure tensor code, no engine."""
