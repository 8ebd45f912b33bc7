"""One vLLM engine: started from a Hugging Face folder, generating from token ids, reloading
weights in place, and shut down with every process it started.

    engine = VllmEngine.start(model_dir, options, dtype="fp32", max_model_len=64, seed=1)
    outs = engine.generate(requests)   # [EngineSample] in request order
    engine.reload_weights(model_dir)   # after the folder's safetensors were rewritten
    engine.close()

vLLM runs its engine core (and, on the CPU, a worker) in child processes. They are started with
``spawn``, never ``fork``: forking a trainer that holds a process group, DeepSpeed state and a
thread pool copies all of it half-alive. Spawn re-imports the launching script in each child, so
a script that builds an engine needs an ``if __name__ == "__main__":`` guard (the ``unirl``
command and ``python -m unirl.cli`` have one). `close` shuts the engine down and then kills any
of its processes that are still alive, so no engine outlives an error; should the process that
started it be killed instead (SIGKILL), a reaper process kills them (reaper.py).

The log-probs are those of vLLM's ``logprobs_mode="processed_logprobs"``: computed from the
logits after temperature (and top-k / top-p) were applied, the distribution each token was
drawn from (vllm/v1/sample/sampler.py). The default ``raw_logprobs`` is the temperature-1
distribution, which differs from the trainer's ``log_softmax(logits / T)`` at any T != 1.
"""

from __future__ import annotations

import contextlib
import logging
import os
import subprocess
from collections.abc import Iterator, Mapping, Sequence
from typing import Any

from unirl.core.errors import ConfigError, RunError
from unirl.rollouts.serving.engine import EngineRequest, EngineSample
from unirl.rollouts.vllm import reaper
from unirl.rollouts.vllm.health import EngineWatch
from unirl.rollouts.vllm.plugin import INSTALL_HINT, VllmOptions, engine_settings

logger = logging.getLogger(__name__)

_DTYPES = {"fp32": "float32", "bf16": "bfloat16"}


def vllm_available() -> bool:
    try:
        import vllm  # noqa: F401
    except ImportError:
        return False
    return True


def require_vllm() -> None:
    if not vllm_available():
        raise ConfigError(f"rollout.source: vllm needs vLLM: {INSTALL_HINT}")


def _engine_env() -> None:
    """Settings vLLM reads from the environment when the engine starts (its children inherit
    them). Spawn: see the module docstring. Its log level (``VLLM_LOGGING_LEVEL``, which the
    plug-in declares) is set by `unirl.log_setup` from ``logging.level``: ERROR unless DEBUG, which also hides the warning
    every in-place reload prints about the rotary embedding's cos/sin cache (a buffer that no
    checkpoint holds, rightly kept)."""
    os.environ["VLLM_WORKER_MULTIPROC_METHOD"] = "spawn"


@contextlib.contextmanager
def _environment(env: Mapping[str, str]) -> Iterator[None]:
    """``env`` set in ``os.environ`` inside the block, the previous values (or their absence)
    restored after it, also when the block raises."""
    saved = {k: os.environ.get(k) for k in env}
    try:
        os.environ.update(env)
        yield
    finally:
        for key, value in saved.items():
            if value is None:
                os.environ.pop(key, None)
            else:
                os.environ[key] = value


def _llm_arguments(
    model_dir: str,
    options: VllmOptions,
    *,
    dtype: str,
    max_model_len: int,
    seed: int,
    stop: Sequence[str],
    extra: Mapping[str, Any] | None,
) -> dict[str, Any]:
    """The `vllm.LLM` arguments of `VllmEngine.start` (its docstring)."""
    import torch  # loaded with vLLM anyway; this module's import stays light

    settings = engine_settings(options, cuda=torch.cuda.is_available())
    logger.info("vLLM engine: kv_cache_gb=%s, enforce_eager=%s (%s)",
                settings.kv_cache_gb, settings.enforce_eager, settings.reason)  # fmt: skip
    kv_cache = (
        {} if settings.kv_cache_gb is None
        else {"kv_cache_memory_bytes": int(settings.kv_cache_gb * (1 << 30))}
    )  # fmt: skip
    return dict(
        model=model_dir,
        # token ids in and out: the tasks tokenize (stop strings need vLLM's detokenizer)
        skip_tokenizer_init=not stop,
        dtype=_DTYPES[dtype],
        enforce_eager=settings.enforce_eager,
        max_model_len=max_model_len,
        **kv_cache,
        tensor_parallel_size=options.tensor_parallel_size,
        logprobs_mode="processed_logprobs",
        seed=seed,
        disable_log_stats=True,
        # A prompt split over scheduler steps (chunked prefill) discards the token sampled for
        # its first part and rewinds that request's seeded generator, which a CPU generator
        # cannot do (vLLM 0.32: "CPU Generator does not use offset"); per-sample seeds are what
        # makes rollouts reproducible, so prompts are never split.
        enable_chunked_prefill=False,
        # A multi-turn episode's next turn is prompted with every earlier turn: the cache keeps
        # their keys and values (reload_weights drops it).
        enable_prefix_caching=True,
        use_tqdm_on_load=False,
        **(extra or {}),
    )


class VllmEngine:
    """A `vllm.LLM` on token ids (no tokenizer: ``skip_tokenizer_init``), sampling with fixed
    settings and returning the sampled tokens' log-probs."""

    def __init__(self, llm: Any, *, temperature: float, top_p: float, max_new_tokens: int,
                 stop_token_ids: Sequence[int], max_model_len: int,
                 stop: Sequence[str] = ()) -> None:  # fmt: skip
        self.llm = llm
        self.temperature, self.top_p = temperature, top_p
        self.max_new_tokens = max_new_tokens
        self.stop_token_ids = list(stop_token_ids)
        self.stop = list(stop)
        self.max_model_len = max_model_len
        self._pids: set[int] = set()  # the engine's processes, set by `start`
        self._reaper: subprocess.Popen | None = None  # reaper.py, set by `start`
        # under model.lora: the adapter every generation carries (`use_adapter`); None: the base
        self.lora_request: Any = None
        self.watch: EngineWatch | None = None  # its health (health.py), set by `start`

    @classmethod
    def start(
        cls,
        model_dir: str,
        options: VllmOptions,
        *,
        dtype: str,
        max_model_len: int,
        seed: int,
        temperature: float,
        top_p: float,
        max_new_tokens: int,
        stop_token_ids: Sequence[int],
        stop: Sequence[str] = (),
        extra: Mapping[str, Any] | None = None,
        env: Mapping[str, str] | None = None,
    ) -> VllmEngine:
        """Start an engine on the Hugging Face folder ``model_dir`` (config.json + safetensors).
        Stop strings (``stop``) are matched by vLLM on the text it decodes, so with them the
        engine loads the tokenizer saved in ``model_dir``; without them it runs on ids alone.
        Any failure (vLLM refusing the model shape, too little memory for the KV cache) raises
        `RunError` naming the ``rollout.vllm`` settings, after every started process is gone.
        ``extra``: more `vllm.LLM` arguments (launch.py: GPU memory, sleep mode, the weight
        transfer); ``env``: environment variables the engine's processes start with (its GPUs)."""
        require_vllm()
        _engine_env()
        import vllm

        before = set(_child_pids())
        try:
            with _environment(env or {}):  # the engine's processes inherit it while it starts
                arguments = _llm_arguments(
                    model_dir,
                    options,
                    dtype=dtype,
                    max_model_len=max_model_len,
                    seed=seed,
                    stop=stop,
                    extra=extra,
                )
                llm = vllm.LLM(**arguments)
        except Exception as exc:
            _kill(set(_child_pids()) - before)
            raise RunError(
                f"the vLLM engine did not start ({type(exc).__name__}: {exc}). Check "
                f"rollout.vllm (dtype={dtype}, kv_cache_gb={options.kv_cache_gb}, "
                f"gpu_memory_utilization={options.gpu_memory_utilization} on a GPU, "
                f"max_model_len={max_model_len}, tensor_parallel_size="
                f"{options.tensor_parallel_size}) and the model (its architecture must be one "
                "vLLM supports); logging.level: DEBUG shows vLLM's own report"
            ) from exc
        engine = cls(
            llm,
            temperature=temperature,
            top_p=top_p,
            max_new_tokens=max_new_tokens,
            stop_token_ids=stop_token_ids,
            max_model_len=max_model_len,
            stop=stop,
        )
        engine._pids = set(_child_pids()) - before
        engine._reaper = reaper.watch(engine._pids)  # kills them should this process be killed
        engine.watch = EngineWatch(engine._pids, stall_timeout_s=options.stall_timeout_s)
        engine.watch.install(llm)
        return engine

    def generate(
        self,
        requests: Sequence[EngineRequest],
        *,
        temperature: float | None = None,
        max_new_tokens: int | None = None,
    ) -> list[EngineSample]:
        """The requests' samples with the engine's settings; ``temperature`` / ``max_new_tokens``
        given: those instead, for these requests only (an evaluation's)."""
        from vllm import SamplingParams

        temperature = self.temperature if temperature is None else temperature
        max_new_tokens = self.max_new_tokens if max_new_tokens is None else max_new_tokens
        prompts = [{"prompt_token_ids": list(r.prompt_tokens)} for r in requests]
        params = [
            SamplingParams(
                n=1,
                temperature=temperature,
                top_p=self.top_p,
                max_tokens=max_new_tokens,
                stop_token_ids=self.stop_token_ids,
                logprobs=0,  # the sampled token's own log-prob only
                seed=r.seed,
                # vLLM cuts the token ids after the one that completes a stop string; the text
                # keeps the stop string, as the sampler's decoded response does.
                stop=self.stop or None,
                include_stop_str_in_output=bool(self.stop),
                detokenize=bool(self.stop),
            )
            for r in requests
        ]
        outputs = self.llm.generate(prompts, params, use_tqdm=False, lora_request=self.lora_request)
        samples = []
        for out in outputs:
            completion = out.outputs[0]
            tokens = tuple(int(t) for t in completion.token_ids)
            logprobs = tuple(float(step[t].logprob) for step, t in zip(completion.logprobs, tokens))
            finished = completion.finish_reason == "stop"
            samples.append(
                EngineSample(response_tokens=tokens, logprobs=logprobs, finished=finished)
            )
        return samples

    def use_adapter(self, request: Any) -> None:
        """Load the LoRA adapter of ``request`` (a `vllm.lora.request.LoRARequest`) into every
        worker and generate with it from now on; the adapter used before is removed. The
        prefix cache needs no reset: vLLM keys its blocks by the LoRA request too."""
        if not self.llm.llm_engine.add_lora(request):
            raise RunError(f"the vLLM engine did not load the adapter {request.lora_path}")
        previous, self.lora_request = self.lora_request, request
        if previous is not None and previous.lora_int_id != request.lora_int_id:
            self.llm.llm_engine.remove_lora(previous.lora_int_id)

    def adapters(self) -> set[int]:
        """The LoRA ids the engine holds."""
        return set(self.llm.llm_engine.list_loras())

    def reload_weights(self, model_dir: str) -> None:
        """Load the safetensors in ``model_dir`` into the running engine, in place (vLLM's
        ``reload_weights`` worker method, called on every engine worker through the public
        ``LLM.collective_rpc``), then drop the prefix cache: its keys and values were computed
        with the old weights."""
        self.llm.collective_rpc("reload_weights", kwargs={"weights_path": model_dir})
        self.llm.reset_prefix_cache()

    def close(self) -> None:
        """Shut the engine down and kill whatever of its processes is left (a wedged engine
        core ignores the polite request), also when the shutdown raises; a failed engine
        (dead or hung) is killed first, as asking it to stop would wait on it."""
        llm, self.llm = self.llm, None
        pids, self._pids = self._pids, set()
        failed = self.watch is not None and self.watch.failed is not None
        try:
            if failed:
                _kill(pids)
            if llm is not None:
                try:
                    llm.llm_engine.engine_core.shutdown()
                except Exception as exc:  # the engine may already be dead; the kill remains
                    logger.debug("vLLM shutdown: %s", exc)
                del llm
        finally:
            _kill(pids)
            if self._reaper is not None:
                self._reaper.kill()
                self._reaper.wait()
                self._reaper = None


def _child_pids() -> list[int]:
    """Every live descendant of this process."""
    import psutil  # a vLLM dependency

    return [p.pid for p in psutil.Process().children(recursive=True)]


def _kill(pids: set[int]) -> None:
    """Kill ``pids`` and their descendants (also stopped ones: SIGKILL needs no answer)."""
    import psutil

    procs = []
    for pid in pids:
        try:
            proc = psutil.Process(pid)
            procs += [proc, *proc.children(recursive=True)]
        except psutil.NoSuchProcess:
            continue
    for proc in procs:
        try:
            proc.kill()
        except psutil.NoSuchProcess:
            continue
    psutil.wait_procs(procs, timeout=10)
