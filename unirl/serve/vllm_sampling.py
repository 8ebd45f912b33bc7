"""``sample`` and ``compute_logprobs`` on vLLM (``serve.sampling: vllm``): the request of
`unirl.serve.sampling.sample_job` run on the engine of its base model (`vllm_engine`), with
the sampler weights it names as a verified LoRA request, or none for the base model.

Why the engines start lazily, at the first sample request of their base model, and not with the
server: a server that only trains (or samples one of several base models) never pays an engine's
start (15-30 s on a CPU) or its memory (the KV cache, on a GPU beside the training clients), and
a model vLLM cannot serve fails its sample requests, naming ``serve.vllm``, not the whole server.
An engine that died or hung is closed and started again by the next request. `close` (the server
stopping) shuts every engine down with its processes (`VllmEngine.close`).
"""

from __future__ import annotations

import logging

from unirl.core.errors import RunError
from unirl.serve.config import ServeConfig
from unirl.serve.errors import BadRequest
from unirl.serve.sampling import SampleJob, keep_last
from unirl.serve.vllm_engine import ServeEngine
from unirl.serve.vllm_params import prompt_logprobs, sampling_kwargs, wire_sequences
from unirl.serve.wire import encode_sample_response

logger = logging.getLogger(__name__)


class VllmSampling:
    """The engines by base model; `run` answers one sample request (worker thread only)."""

    def __init__(self, cfg: ServeConfig) -> None:
        self.cfg = cfg
        self.engines: dict[str, ServeEngine] = {}

    def engine(self, base_model: str) -> ServeEngine:
        engine = self.engines.get(base_model)
        if engine is not None and engine.failed:
            logger.warning(
                "unirl serve: the vLLM engine of %r failed; starting it again", base_model
            )
            self.engines.pop(base_model).close()
            engine = None
        if engine is None:
            engine = self.engines[base_model] = ServeEngine(self.cfg, base_model)
        return engine

    def run(self, job: SampleJob) -> bytes:
        from vllm import SamplingParams

        engine = self.engine(job.base_model)
        _check_prompt(job, engine)
        params = SamplingParams(**sampling_kwargs(job, engine.eos_ids))
        prompt = {"prompt_token_ids": list(job.prompt)}
        try:  # the engine may die or hang loading the adapter as well as generating
            lora = None if job.model_path is None else engine.adapter(job.weights, job.model_path)
            (out,) = engine.engine.llm.generate([prompt], params, use_tqdm=False, lora_request=lora)
        except RunError as exc:
            if not engine.failed:
                raise
            self.engines.pop(job.base_model, None)
            engine.close()
            detail = str(exc).replace("rollout.vllm", "serve.vllm")  # the serve engine's keys
            raise RunError(
                f"{engine.receiver} failed ({detail}); the next sample request starts a new one"
            ) from exc
        prompt_lp = None
        if job.prompt_logprobs:
            lp = prompt_logprobs(job.prompt, out.prompt_logprobs)
            prompt_lp = keep_last(lp, job.prompt_logprobs_last_n)
        return encode_sample_response(wire_sequences(out.outputs), prompt_lp)

    def close(self) -> None:
        """Shut every engine down (no engine process left)."""
        engines, self.engines = list(self.engines.values()), {}
        for engine in engines:
            engine.close()


def _check_prompt(job: SampleJob, engine: ServeEngine) -> None:
    bad = [t for t in job.prompt if not 0 <= t < engine.vocab_size]
    if bad:
        raise BadRequest("prompt", f"holds token id {bad[0]}, outside [0, {engine.vocab_size})")
    total = len(job.prompt) + job.max_tokens
    if total > engine.max_model_len:
        raise BadRequest(
            "sampling_params.max_tokens",
            f"is {job.max_tokens}: with the prompt's {len(job.prompt)} tokens that is {total}, "
            f"over the engine's max_model_len={engine.max_model_len} (serve.vllm.max_model_len, "
            "else train.model.max_seq_len); ask for fewer tokens",
        )
