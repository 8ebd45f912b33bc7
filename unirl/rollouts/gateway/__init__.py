"""The agent gateway (``rollout.source: agent``): an OpenAI-compatible HTTP endpoint in front of
the rollout engine, through which any agent program written against the OpenAI API generates
rollouts. unirl calls the user's agent function once per episode with a base URL, a task and a
per-episode key; every call the agent makes is recorded token in, token out, and an episode's
calls are assembled into training samples without re-tokenising.

    plugin.py     the ``rollout.agent`` section, its rules, what ``unirl check`` says, PLUGIN
    recording.py  one call as the engine saw it (`CallRecord`), one episode's calls and state
    assembly.py   an episode's calls as samples: a call that extends the last one joins it, else
                  the episode forks
    protocol.py   the OpenAI request and response bodies: chat rendering, tool calls, stops
    engines.py    the engine behind the gateway (the built-in sampler, vLLM) and the queue that
                  batches concurrent calls onto it
    routing.py    several engines: each episode's calls on one engine, new episodes to the least
                  loaded
    remote.py     an engine driven by another rank, served to the gateway on rank 0
    app.py        the FastAPI app (chat completions, completions, models) and its server thread
    runner.py     the agent functions of a rollout, concurrently, each within its timeout
    source.py     the rollout source over all of it (a `GeneratingSource`)

Importing this package imports nothing heavy.
"""
