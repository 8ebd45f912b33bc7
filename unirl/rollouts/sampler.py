"""Token-by-token sampling from a Hugging Face causal LM, reporting the log-prob of every token.

The built-in rollout engine for demos and tests: temperature, top-p, a budget of new tokens, a
KV cache, and a seeded `torch.Generator` so a seed fixes the samples. Each sampled token's
rollout log-prob is

    log softmax(logits / temperature)[token]

under the temperature-scaled but *unfiltered* distribution: the distribution the trainer
computes (`unirl.core.maths.logprobs.logprobs_from_logits` with the same temperature), so train-vs-
rollout mismatch metrics compare like with like. Top-p only decides which tokens may be drawn
(with top_p < 1 the reported log-prob is not that of the truncated distribution the token was
drawn from; keep top_p at 1.0, the default, for exact on-policy log-probs).

Prompts of equal length are generated together, so no padding or attention mask is needed and
every row computes what a forward of that sequence alone would (up to float rounding; the tests
compare with such a forward to 1e-5 in fp32). Generation ends at ``<eos>`` or another of
``stop_token_ids`` (kept as the last response token), after the first token with which the
decoded response contains one of ``stop_strings`` (that token is the last one), or after
``max_new_tokens``.

    sampler = Sampler(hf_model, temperature=1.0, top_p=1.0, max_new_tokens=8, eos_id=2, seed=0)
    gens = sampler.generate([[1, 5, 6, 3], [1, 7, 3]])
    gens[0].response_tokens, gens[0].logprobs
    sampler.sync_weights(policy_state_dict)  # after every optimizer step
"""

from __future__ import annotations

import copy
import inspect
import re
from collections.abc import Callable, Iterable, Mapping, Sequence
from typing import Any

import attrs
import torch

from unirl.core.errors import ConfigError, RunError
from unirl.core.progress.bars import GenerationProgress


@attrs.frozen(kw_only=True)
class Generation:
    """One response: its tokens (ending with ``<eos>`` or another stop when ``finished``), the
    rollout log-prob of each token, and whether it ended by a stop rather than by the token
    budget."""

    response_tokens: torch.Tensor  # [N] int64, CPU
    logprobs: torch.Tensor  # [N] float32, CPU
    finished: bool


def top_p_filter(probs: torch.Tensor, top_p: float) -> torch.Tensor:
    """Zero every token outside the smallest set of most likely tokens whose probability reaches
    ``top_p`` (nucleus sampling, Holtzman et al. 2020, "The Curious Case of Neural Text
    Degeneration"). The most likely token is always kept. Rows are not renormalised."""
    if top_p >= 1.0:
        return probs
    sorted_probs, order = probs.sort(dim=-1, descending=True)
    # A token is dropped when the tokens ranked above it already reach top_p.
    drop_sorted = sorted_probs.cumsum(-1) - sorted_probs >= top_p
    drop = torch.zeros_like(drop_sorted).scatter(-1, order, drop_sorted)
    return probs.masked_fill(drop, 0.0)


def _reserved_cache(num_layers: int, capacity: int) -> Any:
    """A KV cache that reserves room for ``capacity`` positions per layer at its first update and
    then writes each new position in place, handing attention a view of the filled part.

    transformers' `DynamicCache` concatenates the whole cache with each new token: O(L) copies
    per decoded token, which made up a third of sampling 256 tokens for 128 rows on the CPU.
    Attention reads the same values either way. None when this transformers has no cache layers
    to extend (the model then builds its own cache).
    """
    try:
        from transformers.cache_utils import Cache, DynamicCache, DynamicLayer
    except ImportError:
        return None

    class ReservedLayer(DynamicLayer):
        def lazy_initialization(self, key_states: torch.Tensor, value_states: torch.Tensor) -> None:
            super().lazy_initialization(key_states, value_states)
            rows, heads, _, dim = key_states.shape
            self._key_buffer = key_states.new_empty(rows, heads, capacity, dim)
            self._value_buffer = value_states.new_empty(rows, heads, capacity, dim)
            self._filled = 0

        def update(
            self, key_states: torch.Tensor, value_states: torch.Tensor, *args: Any, **kwargs: Any
        ) -> tuple[torch.Tensor, torch.Tensor]:
            if not self.is_initialized:
                self.lazy_initialization(key_states, value_states)
            start, end = self._filled, self._filled + key_states.shape[-2]
            self._key_buffer[:, :, start:end].copy_(key_states)
            self._value_buffer[:, :, start:end].copy_(value_states)
            self._filled = end
            self.keys = self._key_buffer[:, :, :end]
            self.values = self._value_buffer[:, :, :end]
            return self.keys, self.values

    class ReservedCache(DynamicCache):
        def __init__(self) -> None:
            Cache.__init__(self, layers=[ReservedLayer() for _ in range(num_layers)])

    return ReservedCache()


class Sampler:
    """Samples responses from its own eval-mode copy of ``model``; `sync_weights` loads the
    policy's latest weights into that copy."""

    def __init__(
        self,
        model: torch.nn.Module,
        *,
        temperature: float,
        top_p: float,
        max_new_tokens: int,
        eos_id: int,
        seed: int,
        device: torch.device | str | None = None,
        stop_token_ids: Sequence[int] = (),
        stop_strings: Sequence[str] = (),
        decode: Callable[[Sequence[int]], str] | None = None,
    ) -> None:
        """``stop_token_ids`` end a response besides ``eos_id``; ``stop_strings`` are looked
        for in ``decode(response tokens so far)`` after every token (the task's tokenizer)."""
        if not temperature > 0:
            raise ConfigError(f"rollout.temperature={temperature} must be > 0")
        if not 0 < top_p <= 1:
            raise ConfigError(f"rollout.top_p={top_p} must be in (0, 1]")
        if max_new_tokens < 1:
            raise ConfigError(f"rollout.max_new_tokens={max_new_tokens} must be >= 1")
        self.temperature = float(temperature)
        self.top_p = float(top_p)
        self.max_new_tokens = int(max_new_tokens)
        self.eos_id = int(eos_id)
        if stop_strings and decode is None:
            raise ConfigError("Sampler: stop_strings need decode (the tokenizer's decode)")
        self.stop_ids = sorted({self.eos_id, *map(int, stop_token_ids)})
        self.stop_strings = tuple(stop_strings)
        self.decode = decode
        if device is None:
            device = next(model.parameters()).device
        self.device = torch.device(device)
        self.model = copy.deepcopy(model).to(self.device).eval().requires_grad_(False)
        # transformers >= 5.x names the KV cache argument `cache`, earlier `past_key_values`.
        params = inspect.signature(self.model.forward).parameters
        self._cache_arg = "cache" if "cache" in params else "past_key_values"
        # only the last position's logits: a prompt's would be [rows, P, vocab]
        self._last_only = {"logits_to_keep": 1} if "logits_to_keep" in params else {}
        self.generator = torch.Generator(device=self.device)
        self.generator.manual_seed(seed)

    # -- weights and state ---------------------------------------------------------------

    def sync_weights(self, state_dict: Mapping[str, torch.Tensor]) -> None:
        """Copy the policy's weights (Hugging Face names) into the sampling model. A key left
        out is accepted only when its tensor is tied to one given (e.g. ``lm_head.weight`` to
        the embedding). Per-expert checkpoint names (``mlp.experts.E.gate_proj.weight``, what
        the Megatron backend and vLLM use) are fused into transformers 5's in-memory layout."""
        self.load_buckets([list(state_dict.items())])

    def load_buckets(self, buckets: Iterable[Sequence[tuple[str, torch.Tensor]]]) -> None:
        """`sync_weights` from a stream of buckets (`unirl.core.weights.stream`), loaded as they
        come: only one bucket (and the per-expert tensors of a layer not yet complete) is held
        beside the model."""
        own = self.model.state_dict()
        loaded: set[str] = set()
        unexpected: list[str] = []
        pending: dict[str, torch.Tensor] = {}  # per-expert tensors of layers not yet complete
        for bucket in buckets:
            part: dict[str, torch.Tensor] = {}
            for name, t in bucket:
                m = _EXPERT.match(name)
                if m and f"{m.group(1)}.down_proj" in own:
                    pending[name] = t.clone()  # a view would keep its whole bucket alive
                else:
                    part[name] = t
            for name in _complete_experts(pending, own):
                part[name] = pending.pop(name)
            self._load_part(part, own, loaded, unexpected)
            bucket = part = t = None  # loaded: freed before the stream makes the next bucket
        self._load_part(pending, own, loaded, unexpected)  # incomplete experts: refused there
        given = {own[k].data_ptr() for k in loaded}
        untied = [k for k in own if k not in loaded and own[k].data_ptr() not in given]
        if untied or unexpected:
            raise ConfigError(
                f"sync_weights: the state dict lacks {untied[:5]} and has unexpected keys "
                f"{unexpected[:5]}; the sampler's model and the policy must be built from "
                "the same model config (model.hf_config / model.path)"
            )

    def _load_part(
        self,
        part: Mapping[str, torch.Tensor],
        own: Mapping[str, torch.Tensor],
        loaded: set[str],
        unexpected: list[str],
    ) -> None:
        if not part:
            return
        fused = _fuse_experts(part, own)
        try:
            _, extra = self.model.load_state_dict(dict(fused), strict=False)
        except RuntimeError as err:  # a shape mismatch
            raise ConfigError(
                f"sync_weights: the policy's weights do not fit the sampler's model ({err}); "
                "build both from the same model config (model.hf_config / model.path)"
            ) from None
        unexpected.extend(extra)
        loaded.update(k for k in fused if k in own)

    def variant(
        self,
        *,
        temperature: float,
        max_new_tokens: int,
        seed: int,
        top_p: float | None = None,
        stop_ids: Sequence[int] | None = None,
    ) -> Sampler:
        """A sampler on this one's model (shared, not copied: it follows every weight sync) with
        its own temperature, budget and generator seeded ``seed``, e.g. for an evaluation that
        must leave this sampler's random stream where it was; ``top_p`` / ``stop_ids`` (every
        id that ends a response, ``<eos>`` included) replace this one's when given."""
        other = copy.copy(self)
        other.temperature, other.max_new_tokens = float(temperature), int(max_new_tokens)
        if top_p is not None:
            other.top_p = float(top_p)
        if stop_ids is not None:
            other.stop_ids = sorted(set(map(int, stop_ids)))
        other.generator = torch.Generator(device=self.device)
        other.generator.manual_seed(seed)
        return other

    def state_dict(self) -> dict[str, Any]:
        return {"generator": self.generator.get_state()}

    def load_state_dict(self, state: Mapping[str, Any]) -> None:
        self.generator.set_state(state["generator"])

    # -- generation ----------------------------------------------------------------------

    @torch.no_grad()
    def generate(
        self,
        prompts: Sequence[Sequence[int]],
        progress: GenerationProgress | None = None,
        *,
        seeds: Sequence[int] | None = None,
    ) -> list[Generation]:
        """One response per prompt, in the order given. `progress` (a generation bar) hears of
        every decode step: the tokens it generated and the samples it finished. ``seeds``: one
        per prompt, each row drawn from a generator of its own seeded so (the sampler's stream
        untouched), so that a row's tokens do not depend on the rows batched with it (the agent
        gateway's calls); None: every row from the sampler's one stream."""
        by_length: dict[int, list[int]] = {}
        for i, prompt in enumerate(prompts):
            if len(prompt) == 0:
                raise ValueError(f"Sampler.generate: prompt {i} is empty; give at least <bos>")
            by_length.setdefault(len(prompt), []).append(i)
        results: list[Generation | None] = [None] * len(prompts)
        # A fixed order of the length groups keeps the generator's draws reproducible.
        for length in sorted(by_length):
            indices = by_length[length]
            ids = torch.tensor([list(prompts[i]) for i in indices], dtype=torch.long)
            per_row = None if seeds is None else [self._row_generator(seeds[i]) for i in indices]
            gens = self._generate_equal_length(ids.to(self.device), progress, per_row)
            for i, gen in zip(indices, gens):
                results[i] = gen
        assert all(g is not None for g in results)
        return results  # type: ignore[return-value]

    def _forward(self, input_ids: torch.Tensor, cache: Any) -> tuple[torch.Tensor, Any]:
        kwargs = {self._cache_arg: cache} if cache is not None else {}
        out = self.model(input_ids=input_ids, use_cache=True, **kwargs, **self._last_only)
        new_cache = out.cache if self._cache_arg == "cache" else out.past_key_values
        return out.logits[:, -1, :], new_cache

    def _row_generator(self, seed: int) -> torch.Generator:
        generator = torch.Generator(device=self.device)
        generator.manual_seed(int(seed))
        return generator

    def _draw(
        self, logp_bv: torch.Tensor, per_row: Sequence[torch.Generator] | None = None
    ) -> torch.Tensor:
        probs = top_p_filter(logp_bv.exp(), self.top_p)
        if bool(torch.isnan(probs).any()):  # one sync per token; the loop syncs anyway
            raise RunError(
                "the policy's next-token distribution holds NaN: its weights diverged (see "
                "grad_norm and lr in metrics.jsonl); lower optimizer.lr or keep "
                "optimizer.grad_clip set, then --resume from the newest checkpoint"
            )
        if per_row is not None:  # one generator per row
            return torch.cat([torch.multinomial(p[None], 1, generator=g)[:, 0]
                              for p, g in zip(probs, per_row)])  # fmt: skip
        return torch.multinomial(probs, 1, generator=self.generator)[:, 0]

    def _stop_string_rows(
        self, token_b: torch.Tensor, done: torch.Tensor, row_tokens: list[list[int]]
    ) -> torch.Tensor:
        """The open rows whose response, with this step's token, first contains a stop string."""
        assert self.decode is not None
        hits = torch.zeros_like(done)
        for r, (token, closed) in enumerate(zip(token_b.tolist(), done.tolist())):
            if closed:
                continue
            row_tokens[r].append(int(token))
            text = self.decode(row_tokens[r])
            hits[r] = any(stop in text for stop in self.stop_strings)
        return hits

    def _generate_equal_length(
        self,
        ids_bp: torch.Tensor,
        progress: GenerationProgress | None,
        per_row: Sequence[torch.Generator] | None = None,
    ) -> list[Generation]:
        rows = ids_bp.shape[0]
        finished = 0  # rows done before this step (ended by <eos>)
        layers = getattr(self.model.config, "num_hidden_layers", None)
        cache = None
        if layers is not None:
            cache = _reserved_cache(int(layers), ids_bp.shape[1] + self.max_new_tokens)
        logits_bv, cache = self._forward(ids_bp, cache)
        tokens, logprobs = [], []
        done = torch.zeros(rows, dtype=torch.bool, device=self.device)
        lengths = torch.full((rows,), self.max_new_tokens, dtype=torch.long, device=self.device)
        stop_ids = torch.tensor(self.stop_ids, device=self.device)
        row_tokens: list[list[int]] = [[] for _ in range(rows)]  # kept only for stop strings
        for step in range(self.max_new_tokens):
            # The trainer's distribution: fp32 logits divided by the temperature, unfiltered.
            logp_bv = torch.log_softmax(logits_bv.float() / self.temperature, dim=-1)
            token_b = self._draw(logp_bv, per_row)
            tokens.append(token_b)
            logprobs.append(logp_bv.gather(1, token_b[:, None])[:, 0])
            if len(self.stop_ids) == 1:
                ended = ~done & (token_b == self.stop_ids[0])
            else:
                ended = ~done & torch.isin(token_b, stop_ids)
            if self.stop_strings:
                ended |= self._stop_string_rows(token_b, done, row_tokens)
            lengths[ended] = step + 1
            done |= ended
            now_finished = int(done.sum())  # the one host sync of this step
            last = now_finished == rows or step == self.max_new_tokens - 1
            if progress is not None:
                # every row unfinished before this step made one real token; at the last step
                # the rows still open end by the budget
                ended_now = (rows if last else now_finished) - finished
                progress.update(samples=ended_now, tokens=rows - finished)
            finished = now_finished
            if last:
                break
            # Finished rows keep decoding (batch shapes stay fixed); their extra tokens are cut.
            logits_bv, cache = self._forward(token_b[:, None], cache)
        tokens_bn = torch.stack(tokens, dim=1).cpu()
        logprobs_bn = torch.stack(logprobs, dim=1).cpu()
        lengths, done = lengths.cpu(), done.cpu()
        return [
            Generation(
                response_tokens=tokens_bn[r, : int(lengths[r])].clone(),
                logprobs=logprobs_bn[r, : int(lengths[r])].clone(),
                finished=bool(done[r]),
            )
            for r in range(rows)
        ]


_EXPERT = re.compile(r"^(.*\.mlp\.experts)\.(\d+)\.(gate_proj|up_proj|down_proj)\.weight$")


def _complete_experts(
    pending: Mapping[str, torch.Tensor], own: Mapping[str, torch.Tensor]
) -> list[str]:
    """The names in ``pending`` of the expert layers whose every expert's gate, up and down
    projections have arrived."""
    layers: dict[str, list[str]] = {}
    for name in pending:
        m = _EXPERT.match(name)
        assert m is not None
        layers.setdefault(m.group(1), []).append(name)
    done = []
    for prefix, names in layers.items():
        if len(names) == 3 * own[f"{prefix}.down_proj"].shape[0]:
            done += names
    return done


def _fuse_experts(
    state_dict: Mapping[str, torch.Tensor], own: Mapping[str, torch.Tensor]
) -> Mapping[str, torch.Tensor]:
    """Per-expert tensors stacked into the model's fused ``experts.gate_up_proj`` ``[E, 2F, H]``
    (gate rows, then up rows) and ``experts.down_proj`` ``[E, H, F]`` where the model has them;
    ``state_dict`` unchanged otherwise."""
    experts: dict[str, dict[str, dict[int, torch.Tensor]]] = {}
    out = {}
    for name, t in state_dict.items():
        m = _EXPERT.match(name)
        if m is None or f"{m.group(1)}.down_proj" not in own:
            out[name] = t
            continue
        experts.setdefault(m.group(1), {}).setdefault(m.group(3), {})[int(m.group(2))] = t
    for prefix, parts in experts.items():
        n = len(parts.get("down_proj", {}))
        if any(sorted(parts.get(p, {})) != list(range(n)) for p in ("gate_proj", "up_proj")):
            raise ConfigError(
                f"sync_weights: the experts of {prefix} are incomplete (gate, up and down "
                "projections of every expert are needed)"
            )
        gate, up, down = (parts[p] for p in ("gate_proj", "up_proj", "down_proj"))
        out[f"{prefix}.gate_up_proj"] = torch.stack([torch.cat([gate[e], up[e]]) for e in range(n)])
        out[f"{prefix}.down_proj"] = torch.stack([down[e] for e in range(n)])
    return out
