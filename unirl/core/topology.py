"""The parallel layout of one process, as plain validated data.

A backend fills one `Topology` from its engine (Megatron's parallel state, DeepSpeed's groups);
core code asks it questions ("does this rank report?", "does this virtual stage count a
microbatch?") and never imports a backend. Process groups are named by what they are used for.

Rank order follows Megatron-core's default ``tp-cp-ep-dp-pp`` (tensor fastest, pipeline
slowest), so `Topology.from_rank` gives, without any engine, the ranks Megatron would give.

Expert parallel (mixture-of-experts layers) is a second view of the same ranks, as in
megatron-core: outside the experts a rank is (tp, cp, dp, pp); inside them it is (etp, ep, edp,
pp), expert tensor parallel fastest, with ``etp * ep * edp * pp = world``. Experts are split over
the ``ep`` group, each expert's weights over ``etp``, and expert gradients are averaged over
``edp`` (the expert data-parallel group) instead of ``dp``. The reporting rank and the microbatch
ticks are those of the dense view: one rank, one tick per microbatch, with or without experts.
"""

from __future__ import annotations

from typing import Any

import attrs

from unirl.core.errors import ConfigError


def data_parallel_size(world_size: int, *, tp: int, pp: int, cp: int) -> int:
    """``world / (tp * pp * cp)``; the one check that the model-parallel sizes divide the world
    (the config runs it at load, `Topology.from_rank` for the ranks it is given)."""
    model_parallel = tp * pp * cp
    if world_size % model_parallel:
        raise ConfigError(
            f"world size {world_size} is not divisible by parallel.tp x parallel.pp x parallel.cp "
            f"= {tp} x {pp} x {cp} = {model_parallel}; launch a multiple of {model_parallel} "
            "processes or change the parallel sizes"
        )
    return world_size // model_parallel


def expert_data_parallel_size(world_size: int, *, ep: int, etp: int, pp: int) -> int:
    """``world / (etp * ep * pp)``: the expert data-parallel size, checked like
    `data_parallel_size` (megatron-core builds the expert groups from the same ranks)."""
    expert_parallel = etp * ep * pp
    if world_size % expert_parallel:
        raise ConfigError(
            f"world size {world_size} is not divisible by parallel.etp x parallel.ep x "
            f"parallel.pp = {etp} x {ep} x {pp} = {expert_parallel}; launch a multiple of "
            f"{expert_parallel} processes or change the expert-parallel sizes"
        )
    return world_size // expert_parallel


def _positive(instance: Any, attribute: attrs.Attribute, value: int) -> None:
    if value < 1:
        raise ConfigError(f"topology.{attribute.name} must be >= 1, got {value}")


@attrs.frozen(kw_only=True)
class ProcessGroups:
    """Process groups by role; ``None`` means the group has one member (no communication)."""

    dp: Any = None  # data parallel, without CP: gradient all-reduce of non-CP state
    dp_cp: Any = None  # data parallel with CP: global token / sequence counts, metrics
    tp: Any = None  # vocabulary-parallel log-softmax
    pp: Any = None
    cp: Any = None  # per-sequence sums across the chunks of one sequence
    ep: Any = None  # expert parallel: the all-to-all token dispatch, expert weight export
    etp: Any = None  # expert tensor parallel: one expert's weight shards
    edp: Any = None  # expert data parallel: expert gradient averaging


@attrs.frozen(kw_only=True)
class Topology:
    """Ranks and sizes of every parallel dimension for this process."""

    world_size: int = attrs.field(default=1, validator=_positive)
    rank: int = 0
    tp_size: int = attrs.field(default=1, validator=_positive)
    pp_size: int = attrs.field(default=1, validator=_positive)
    cp_size: int = attrs.field(default=1, validator=_positive)
    dp_size: int = attrs.field(default=1, validator=_positive)
    vpp_size: int | None = None
    tp_rank: int = 0
    pp_rank: int = 0
    cp_rank: int = 0
    dp_rank: int = 0
    # The expert view (see the module docstring). Left out, it is the dense view with no expert
    # parallelism: etp = tp, ep = 1, edp = dp x cp; a backend with ep > 1 gives all six.
    ep_size: int = attrs.field(default=1, validator=_positive)
    etp_size: int = attrs.field(validator=_positive)
    edp_size: int = attrs.field(validator=_positive)
    ep_rank: int = 0
    etp_rank: int = attrs.field()
    edp_rank: int = attrs.field()
    groups: ProcessGroups = attrs.field(factory=ProcessGroups, eq=False, repr=False)

    @etp_size.default
    def _etp_size(self) -> int:
        return self.tp_size

    @edp_size.default
    def _edp_size(self) -> int:
        return max(1, self.world_size // (self.etp_size * self.ep_size * self.pp_size))

    @etp_rank.default
    def _etp_rank(self) -> int:
        return self.tp_rank

    @edp_rank.default
    def _edp_rank(self) -> int:
        no_expert_parallel = self.ep_size == 1 and self.etp_size == self.tp_size
        return self.dp_rank * self.cp_size + self.cp_rank if no_expert_parallel else 0

    def __attrs_post_init__(self) -> None:
        product = self.tp_size * self.pp_size * self.cp_size * self.dp_size
        if product != self.world_size:
            raise ConfigError(
                f"parallel layout tp={self.tp_size} x pp={self.pp_size} x cp={self.cp_size} x "
                f"dp={self.dp_size} = {product} does not equal the world size {self.world_size}"
            )
        expert_product = self.etp_size * self.ep_size * self.edp_size * self.pp_size
        if expert_product != self.world_size:
            raise ConfigError(
                f"expert layout etp={self.etp_size} x ep={self.ep_size} x edp={self.edp_size} x "
                f"pp={self.pp_size} = {expert_product} does not equal the world size "
                f"{self.world_size}"
            )
        for name in ("tp", "pp", "cp", "dp", "ep", "etp", "edp"):
            r, s = getattr(self, f"{name}_rank"), getattr(self, f"{name}_size")
            if not 0 <= r < s:
                raise ConfigError(f"topology.{name}_rank={r} outside [0, {s})")
        if not 0 <= self.rank < self.world_size:
            raise ConfigError(f"topology.rank={self.rank} outside [0, {self.world_size})")
        if self.vpp_size is not None and (
            self.vpp_size < 1 or (self.pp_size == 1 and self.vpp_size > 1)
        ):
            raise ConfigError(
                f"topology.vpp_size={self.vpp_size} needs pp_size > 1 (got pp_size={self.pp_size})"
            )

    # -- construction -------------------------------------------------------------------

    @classmethod
    def single_process(cls) -> Topology:
        return cls()

    @classmethod
    def from_rank(
        cls,
        rank: int,
        world_size: int,
        *,
        tp: int = 1,
        pp: int = 1,
        cp: int = 1,
        vpp: int | None = None,
        ep: int = 1,
        etp: int | None = None,
        groups: ProcessGroups | None = None,
    ) -> Topology:
        """Ranks in Megatron-core's default order ``tp-cp-ep-dp-pp`` (tp fastest); inside the
        experts ``etp-ep-edp-pp`` (``etp`` None: ``tp``, megatron-core's default)."""
        dp = data_parallel_size(world_size, tp=tp, pp=pp, cp=cp)
        etp = tp if etp is None else etp
        edp = expert_data_parallel_size(world_size, ep=ep, etp=etp, pp=pp)
        r = rank
        tp_rank, r = r % tp, r // tp
        cp_rank, r = r % cp, r // cp
        dp_rank, r = r % dp, r // dp
        pp_rank = r
        r = rank % (world_size // pp)  # the expert view shares the pipeline stage
        etp_rank, r = r % etp, r // etp
        ep_rank, edp_rank = r % ep, r // ep
        return cls(
            world_size=world_size,
            rank=rank,
            tp_size=tp,
            pp_size=pp,
            cp_size=cp,
            dp_size=dp,
            vpp_size=vpp,
            ep_size=ep,
            etp_size=etp,
            edp_size=edp,
            tp_rank=tp_rank,
            pp_rank=pp_rank,
            cp_rank=cp_rank,
            dp_rank=dp_rank,
            ep_rank=ep_rank,
            etp_rank=etp_rank,
            edp_rank=edp_rank,
            groups=groups or ProcessGroups(),
        )

    # -- derived sizes --------------------------------------------------------------------

    @property
    def dp_cp_size(self) -> int:
        return self.dp_size * self.cp_size

    @property
    def dp_cp_rank(self) -> int:
        # Megatron orders cp inside dp: the dp-with-cp group is contiguous in (cp, dp).
        return self.dp_rank * self.cp_size + self.cp_rank

    @property
    def virtual_stages(self) -> int:
        return self.vpp_size or 1

    # -- questions ------------------------------------------------------------------------

    def is_first_pipeline_stage(self, vp_stage: int | None = None) -> bool:
        if self.pp_rank != 0:
            return False
        return vp_stage is None or self.vpp_size is None or vp_stage == 0

    def is_last_pipeline_stage(self, vp_stage: int | None = None) -> bool:
        """Last physical stage; with a virtual stage given, also the last model chunk."""
        if self.pp_rank != self.pp_size - 1:
            return False
        return vp_stage is None or self.vpp_size is None or vp_stage == self.vpp_size - 1

    @property
    def is_reporting_rank(self) -> bool:
        """The one rank that draws progress bars and writes logs: dp-with-cp rank 0, tp rank 0,
        last pipeline stage (where the loss lives)."""
        return self.dp_cp_rank == 0 and self.tp_rank == 0 and self.is_last_pipeline_stage()

    def counts_microbatch(self, vp_stage: int | None = None) -> bool:
        """Whether a forward step on this rank (for this model chunk) completes a microbatch.

        Under VPP the step function runs once per model chunk; only the last chunk of the last
        stage finishes a microbatch, so counting there gives exactly one tick per microbatch.
        """
        if self.vpp_size is not None and self.vpp_size > 1 and vp_stage is None:
            raise ValueError("counts_microbatch needs vp_stage when vpp_size > 1")
        return self.is_last_pipeline_stage(vp_stage)
