"""`unirl serve`: the Tinker training API over a unirl `TrainingBackend`.

The unmodified ``tinker`` SDK, its base URL pointed here, creates training clients on a base
model the config names, runs ``forward`` / ``forward_backward`` (the SDK's built-in losses mapped
onto unirl's loss library, and its client-side custom losses), ``optim_step`` with its Adam
parameters, saves and loads state, saves weights for the sampler, samples and computes
log-probs. Requests are answered with a future id at once and run by one worker thread
(`unirl.serve.worker`); the SDK polls ``retrieve_future`` for the result.

    unirl serve serve.yaml          # see docs/guides/serve.md
"""
