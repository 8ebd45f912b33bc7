"""Engine-neutral serving code that a second engine (SGLang, ...) uses as is: what an engine is to
the code around it (requests on token ids, one seed each, and the samples that come back),
multi-turn episodes played on any such engine, where engines run and which transport they take,
the ranks' bounded waits for the engines, the policy's weights as a folder an engine loads, and a
weight bucket packed into one buffer for a transport. Nothing here imports an engine."""
