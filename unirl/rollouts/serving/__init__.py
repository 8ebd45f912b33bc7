"""Engine-neutral serving code that a second engine (SGLang, ...) uses as is: where engines run and
which transport they take (placement), the ranks' bounded waits for the engines (exchange), and the
policy's weights as a folder an engine loads (weights). Nothing here imports an engine."""
