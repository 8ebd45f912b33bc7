"""``sample`` and ``compute_logprobs`` on the built-in sampler (`unirl.rollouts.sampler`): a
Hugging Face model loaded from the sampler weights a training client saved (or the base
model), kept while the server runs. Each sampled token's log-prob is the sampler's (under the
temperature-scaled distribution); prompt log-probs come from one forward of the prompt through
core's `logprobs_from_logits`."""

from __future__ import annotations

import hashlib
import threading
import zlib
from collections import OrderedDict
from collections.abc import Mapping
from pathlib import Path
from typing import Any

import attrs
import numpy as np
import torch

from unirl.core.maths.logprobs import logprobs_from_logits
from unirl.rollouts.sampler import Sampler
from unirl.serve.errors import BadRequest
from unirl.serve.state import META
from unirl.serve.wire import WireSequence, encode_sample_response


@attrs.frozen(kw_only=True)
class SampleJob:
    # sampling: sampler: a Hugging Face folder; vllm: the saved sampler weights' folder (its
    # adapter and meta.json), or the base model's folder
    weights: Path
    base_model: str
    model_path: str | None  # the tinker:// sampler weights sampled from; None: the base model
    prompt: tuple[int, ...]
    num_samples: int
    max_tokens: int
    temperature: float
    top_p: float
    top_k: int  # -1: no top-k (vllm only)
    seed: int
    stop_tokens: tuple[int, ...] | None  # None: the model's EOS
    prompt_logprobs: bool
    prompt_logprobs_last_n: int | None = None  # only the last N prompt log-probs (None: all)


def _prompt_tokens(prompt: Any) -> tuple[int, ...]:
    chunks = prompt.get("chunks") if isinstance(prompt, Mapping) else None
    if not isinstance(chunks, list) or not chunks:
        raise BadRequest("prompt.chunks", "is missing or empty; send ModelInput.from_ints(...)")
    tokens: list[int] = []
    for c, chunk in enumerate(chunks):
        if chunk.get("type", "encoded_text") != "encoded_text":
            raise BadRequest(f"prompt.chunks[{c}]", "is not a token chunk; send token ids")
        tokens.extend(int(t) for t in chunk.get("tokens", []))
    return tuple(tokens)


def flag(body: Mapping[str, Any], field: str) -> bool:
    """A yes/no field: the SDK sends a JSON boolean (or nothing); anything else is refused, not
    read by truthiness (the string "false" is no yes)."""
    value = body.get(field)
    if value is None:
        return False
    if not isinstance(value, bool):
        raise BadRequest(field, f"is {value!r}; send true or false")
    return value


def _stop_tokens(stop: Any) -> tuple[int, ...] | None:
    if stop is None:
        return None
    if isinstance(stop, list) and all(isinstance(s, int) for s in stop):
        return tuple(stop)
    raise BadRequest(
        "sampling_params.stop",
        f"is {stop!r}; this server stops on token ids only (a list of ints), not strings",
    )


class SampleSeeds:
    """The seed of a sample request that sends none: random, or with ``serve.sample_seed`` one
    derived from it, the prompt and how many requests for that prompt came before (so a run
    samples the same tokens however its concurrent requests arrive: a loop script that sends no
    seeds is reproducible, and two servers on different backends sample alike)."""

    def __init__(self, base: int | None) -> None:
        self.base = base
        self._seen: dict[tuple[int, ...], int] = {}
        self._lock = threading.Lock()

    def draw(self, prompt: tuple[int, ...]) -> int:
        if self.base is None:
            return int(np.random.randint(0, 2**31))
        with self._lock:
            n = self._seen.get(prompt, 0)
            self._seen[prompt] = n + 1
        key = f"{self.base}:{n}:{','.join(map(str, prompt))}"
        return zlib.crc32(key.encode()) & 0x7FFFFFFF


def sample_job(
    body: Mapping[str, Any],
    weights: Path,
    *,
    base_model: str,
    model_path: str | None,
    max_sample_tokens: int,
    seeds: SampleSeeds,
    top_k: bool,
) -> SampleJob:
    """The checked request; ``top_k``: whether the engine samples with top-k (vLLM does)."""
    params = dict(body.get("sampling_params") or {})
    max_tokens = params.get("max_tokens") or 16
    if not 1 <= int(max_tokens) <= max_sample_tokens:
        raise BadRequest(
            "sampling_params.max_tokens",
            f"is {max_tokens}; use 1..{max_sample_tokens} (serve.max_sample_tokens)",
        )
    temperature = float(params.get("temperature", 1.0))
    if temperature <= 0:
        raise BadRequest("sampling_params.temperature", f"is {temperature}; it must be > 0")
    top_p = float(params.get("top_p", 1.0))
    if not 0 < top_p <= 1:
        raise BadRequest("sampling_params.top_p", f"is {top_p}; it must be in (0, 1]")
    top_k_value = int(params.get("top_k", -1))
    if top_k_value != -1 and not top_k:
        raise BadRequest(
            "sampling_params.top_k",
            "is set; the built-in sampler samples without top-k (serve.sampling: vllm has it)",
        )
    if top_k_value == 0 or top_k_value < -1:
        raise BadRequest("sampling_params.top_k", f"is {top_k_value}; use -1 (none) or >= 1")
    num_samples = int(body.get("num_samples", 1))
    if not 1 <= num_samples <= 64:
        raise BadRequest("num_samples", f"is {num_samples}; use 1..64")
    seed = params.get("seed")
    prompt = _prompt_tokens(body.get("prompt"))
    _refuse_unserved(body)
    return SampleJob(
        weights=weights,
        base_model=base_model,
        model_path=model_path,
        prompt=prompt,
        num_samples=num_samples,
        max_tokens=int(max_tokens),
        temperature=temperature,
        top_p=top_p,
        top_k=top_k_value,
        seed=int(seed) if seed is not None else seeds.draw(prompt),
        stop_tokens=_stop_tokens(params.get("stop")),
        prompt_logprobs=flag(body, "prompt_logprobs"),
        prompt_logprobs_last_n=_last_n(body, prompt),
    )


# What the SDK can ask of a sample beyond the prompt log-probs, and its value when it does not.
_UNSERVED = (
    ("topk_prompt_logprobs", 0),
    ("topk_sample_logprobs", 0),
    ("prompt_alt_tokens_k", 0),
    ("target_prompt_logprobs", None),
)


def _refuse_unserved(body: Mapping[str, Any]) -> None:
    """A request for what this server does not compute gets a 400, never an answer without it."""
    for field, default in _UNSERVED:
        if body.get(field, default) not in (default, None):
            raise BadRequest(field, "is set; this server returns no top-k, alternative or "
                             "target log-probs (prompt_logprobs and the sampled tokens' only)")  # fmt: skip


def _last_n(body: Mapping[str, Any], prompt: tuple[int, ...]) -> int | None:
    n = body.get("prompt_logprobs_last_n")
    if n is None:
        return None
    if not body.get("prompt_logprobs") or not 1 <= int(n) <= len(prompt) - 1:
        raise BadRequest(
            "prompt_logprobs_last_n",
            f"is {n}; use 1..{len(prompt) - 1} (len(prompt) - 1) with prompt_logprobs",
        )
    return int(n)


def keep_last(prompt_lp: np.ndarray, n: int | None) -> np.ndarray:
    """``prompt_lp`` with only its last ``n`` entries scored (the others NaN: the SDK's None)."""
    if n is not None:
        prompt_lp = prompt_lp.copy()
        prompt_lp[: len(prompt_lp) - n] = np.nan
    return prompt_lp


# Samplers kept loaded: an RL loop saves new sampler weights every step and samples the newest,
# so older ones are dropped (a later request for one loads it again from disk). On a GPU one: the
# samplers share the card with the training clients.
KEPT_SAMPLERS = 2
KEPT_SAMPLERS_GPU = 1


class SamplerPool:
    """The most recently used samplers, one per weights folder (a folder saved again is another);
    each request samples from a `Sampler.variant` of its folder's (the model is not copied)."""

    def __init__(self, model_dtype: str = "fp32") -> None:
        # on a GPU node the samplers run on the serving rank's GPU in the training model's
        # dtype (``train.model.dtype``; the device is read at the first load, after the rank
        # set its GPU); on a CPU in fp32, as the CPU backends train
        self.model_dtype = model_dtype
        self._samplers: OrderedDict[tuple[Path, str], Sampler] = OrderedDict()

    def _placement(self) -> tuple[torch.device | None, torch.dtype, int]:
        if not torch.cuda.is_available():
            return None, torch.float32, KEPT_SAMPLERS
        dtype = torch.bfloat16 if self.model_dtype == "bf16" else torch.float32
        return torch.device("cuda", torch.cuda.current_device()), dtype, KEPT_SAMPLERS_GPU

    def sampler(self, weights: Path, *, saved: bool) -> Sampler:
        """``saved``: weights a client saved (``weights`` inside a save's folder), else a base
        model's folder, which does not change."""
        # a save is known by its meta.json's content, which holds the save's own id (weights
        # saved again under one name are another sampler; an inode could be reused by a later save)
        meta = weights.parent / META
        key = (weights, hashlib.sha256(meta.read_bytes()).hexdigest() if saved else "")
        if key in self._samplers:
            self._samplers.move_to_end(key)
            return self._samplers[key]
        from transformers import AutoModelForCausalLM

        device, dtype, kept = self._placement()
        while len(self._samplers) >= kept:  # dropped before the new one loads
            self._samplers.popitem(last=False)
        model = AutoModelForCausalLM.from_pretrained(weights, dtype=dtype)
        eos = model.config.eos_token_id
        sampler = Sampler(
            model,
            device=device,
            temperature=1.0,
            top_p=1.0,
            max_new_tokens=1,
            seed=0,
            eos_id=eos if isinstance(eos, int) else -1,
        )
        self._samplers[key] = sampler
        return sampler

    def close(self) -> None:
        self._samplers.clear()

    def run(self, job: SampleJob) -> bytes:
        base = self.sampler(job.weights, saved=job.model_path is not None)
        vocab = int(base.model.config.vocab_size)
        bad = [t for t in job.prompt if not 0 <= t < vocab]
        if bad:
            raise BadRequest("prompt", f"holds token id {bad[0]}, outside [0, {vocab})")
        sampler = base.variant(
            temperature=job.temperature,
            max_new_tokens=job.max_tokens,
            seed=job.seed,
            top_p=job.top_p,
            # SamplingParams.stop: None keeps <eos>; a list of ids replaces it ([]: none)
            stop_ids=job.stop_tokens,
        )
        gens = sampler.generate([list(job.prompt)] * job.num_samples)
        sequences = [
            WireSequence(
                tokens=g.response_tokens.cpu().numpy(),
                logprobs=g.logprobs.float().cpu().numpy(),
                stopped=g.finished,
            )
            for g in gens
        ]
        prompt_lp = None
        if job.prompt_logprobs:
            prompt_lp = keep_last(
                _prompt_logprobs(base.model, job.prompt), job.prompt_logprobs_last_n
            )
        return encode_sample_response(sequences, prompt_lp)


# Prompt positions scored per head matmul: a long prompt's logits never exist all at once.
PROMPT_CHUNK = 2048


# Families whose logits are exactly the decoder's last hidden state through the output head
# (their ForCausalLM forwards, transformers 5), when `head_problem` finds no transform either.
_PLAIN_HEAD_FAMILIES = frozenset({"llama", "mistral", "qwen2", "qwen3", "qwen2_moe", "qwen3_moe"})


@torch.no_grad()
def _prompt_logprobs(model: torch.nn.Module, prompt: tuple[int, ...]) -> np.ndarray:
    """``[len(prompt)]``: NaN for the first token (no context), then log p(token | before); for
    the plain-head families the decoder's hidden states through the output head in chunks of
    `PROMPT_CHUNK` positions, else one forward."""
    from unirl.backends.hf.fused_head import head_problem

    first = np.full(1, np.nan, dtype=np.float32)
    if len(prompt) < 2:
        return first[: len(prompt)]
    ids = torch.tensor([prompt], dtype=torch.long, device=next(model.parameters()).device)
    targets = ids[0, 1:]
    plain = model.config.model_type in _PLAIN_HEAD_FAMILIES and head_problem(model) is None
    if not plain:
        logits = model(input_ids=ids, use_cache=False).logits[0, :-1].float()
        logp = logprobs_from_logits(logits, targets)
    else:
        hidden = model.get_decoder()(input_ids=ids, use_cache=False).last_hidden_state[0, :-1]
        head = model.get_output_embeddings()
        logp = torch.cat([
            logprobs_from_logits(head(hidden[a : a + PROMPT_CHUNK]).float(),
                                 targets[a : a + PROMPT_CHUNK])
            for a in range(0, hidden.shape[0], PROMPT_CHUNK)
        ])  # fmt: skip
    return np.concatenate([first, logp.cpu().numpy()]).astype(np.float32)
