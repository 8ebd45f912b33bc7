"""The CPU-testable parts of getting weights to vLLM engines at scale: the placement rules
(leaders, prompt shares, which transport, the fit check), the bucket -> message conversion checked
against vLLM's own unpacking and message classes, and the sleep-mode call sequence against a fake
engine that records its calls. The GPU side (CUDA IPC to another process) is
tests/unit/test_ipc_transport_gpu.py."""

from __future__ import annotations

import base64
import pickle
from pathlib import Path

import attrs
import pytest
import torch

from unirl.core.config.run_config import load_config
from unirl.core.errors import ConfigError
from unirl.core.protocols.source_plugin import weight_receivers
from unirl.core.weights.stream import (
    HOST,
    FlatBucket,
    TensorSpec,
    as_buckets,
    flat_buffer,
    packed_layout,
)
from unirl.rollouts.serving import placement
from unirl.rollouts.serving.packing import pack_bucket
from unirl.rollouts.vllm import transport
from unirl.rollouts.vllm.launch import plan_launch
from unirl.rollouts.vllm.plugin import VllmOptions, describe
from unirl.rollouts.vllm.sleep import SleepCycle
from unirl.rollouts.vllm.transport import (
    FileTransport,
    IpcTransport,
    NcclTransport,
    bucket_device,
    ipc_update_info,
    nccl_update_info,
)

EXAMPLE = Path(__file__).parents[2] / "examples" / "tiny_grpo_vllm.yaml"
GIB = 1 << 30


# -- placement ---------------------------------------------------------------------------------


def test_leaders_shares_and_engine_of_rank():
    assert placement.leaders(1, 4) == (0,)
    assert placement.leaders(2, 4) == (0, 2)
    assert [placement.engine_of(r, 2, 4) for r in range(4)] == [0, None, 1, None]
    # 5 prompts over 2 engines: 3 + 2, in order
    assert placement.split_prompts(5, 2) == [range(0, 3), range(3, 5)]
    assert placement.split_prompts(4, 4) == [range(i, i + 1) for i in range(4)]
    with pytest.raises(ConfigError, match=r"rollout\.vllm\.engines=3 does not divide the 4"):
        placement.leaders(3, 4)
    with pytest.raises(ConfigError, match=r"prompts_per_rollout=1 is fewer than"):
        placement.split_prompts(1, 2)


@pytest.mark.parametrize(
    ("options", "cuda", "want"),
    [
        ({}, False, "file"),
        ({}, True, "ipc"),  # colocated, one GPU per engine
        ({"tensor_parallel_size": 2}, True, "file"),  # colocated over 2 GPUs: no IPC, no NCCL
        ({"devices": (4, 5)}, True, "nccl"),
        ({"weight_transfer": "file"}, True, "file"),
        ({"weight_transfer": "nccl", "devices": (4,)}, True, "nccl"),
    ],
)
def test_transport_choice(options, cuda, want):
    o = VllmOptions(**options)
    assert placement.choose_transport(o.weight_transfer, o, cuda=cuda).value == want


@pytest.mark.parametrize(
    ("options", "cuda", "needle"),
    [
        ({"weight_transfer": "ipc"}, False, r"weight_transfer=ipc needs CUDA GPUs"),
        ({"weight_transfer": "ipc", "devices": (2,)}, True, r"use nccl \(or auto\) there"),
        ({"weight_transfer": "ipc", "tensor_parallel_size": 2}, True, r"several GPUs"),
        ({"weight_transfer": "nccl"}, True, r"rollout\.vllm\.devices is null"),
    ],
)
def test_transport_rules_name_the_key(options, cuda, needle):
    with pytest.raises(ConfigError, match=needle):
        o = VllmOptions(**options)
        placement.choose_transport(o.weight_transfer, o, cuda=cuda)


def test_several_engines_have_every_rank_receive_the_weights():
    assert weight_receivers(load_config(EXAMPLE)) == "rank0"
    two = load_config(EXAMPLE, ["rollout.vllm.engines=2"], world_size=2)
    assert weight_receivers(two) == "every_rank"
    described = describe(two)
    assert "driven by global rank 0, 1" in described["engine"]


def test_config_refuses_a_transport_its_placement_cannot_carry():
    with pytest.raises(ConfigError, match=r"weight_transfer=nccl"):
        load_config(EXAMPLE, ["rollout.vllm.weight_transfer=nccl"])
    with pytest.raises(ConfigError, match=r"fewer than rollout\.vllm\.engines=32"):
        load_config(EXAMPLE, ["rollout.vllm.engines=32"])  # the example has 16 prompts
    with pytest.raises(ConfigError, match=r"rollout\.vllm\.gpu_memory_utilization"):
        load_config(EXAMPLE, ["rollout.vllm.gpu_memory_utilization=1.5"])
    with pytest.raises(ConfigError, match=r"rollout\.vllm\.devices"):
        load_config(EXAMPLE, ["rollout.vllm.devices=[1, 1]"])


@pytest.mark.parametrize(
    ("options", "cuda", "needle"),
    [
        ({"sleep": "offload"}, False, r"sleep=offload needs vLLM's sleep mode.*CUDA"),
        ({"devices": (1,)}, False, r"names GPUs, and this machine has none"),
        ({"devices": (0, 3)}, True, r"includes GPUs of trainer ranks"),
        ({"devices": (4,), "engines": 2}, True, r"need 2 GPUs"),
        ({"tensor_parallel_size": 4, "engines": 2}, True, r"> the 2 trainer GPUs"),
    ],
)
def test_startup_rules(options, cuda, needle):
    with pytest.raises(ConfigError, match=needle):
        placement.check_startup(VllmOptions(**options), cuda=cuda, local_world_size=4, world_size=4)


def test_engine_devices_and_visible_devices():
    colocated = VllmOptions(engines=2, tensor_parallel_size=2)
    assert placement.engine_devices(
        colocated, 1, leader_local_rank=2, world_size=4, local_world_size=4
    ) == (2, 3)
    reserved = VllmOptions(engines=2, tensor_parallel_size=2, devices=(4, 5, 6, 7))
    # two engines per node: the second takes the second pair
    assert placement.engine_devices(
        reserved, 1, leader_local_rank=2, world_size=4, local_world_size=4
    ) == (6, 7)
    # 2 nodes x 4 ranks, one engine per node: each takes the first pair of its node
    assert placement.engine_devices(
        reserved, 1, leader_local_rank=0, world_size=8, local_world_size=4
    ) == (4, 5)
    assert placement.visible_devices((1, 2), "3,5,7") == "5,7"
    assert placement.visible_devices((1, 2), None) == "1,2"


def test_fit_check_names_the_knobs():
    placement.check_fit(
        free_bytes=80 * GIB, total_bytes=140 * GIB, utilization=0.5, device="cuda:0", sleep="off"
    )
    with pytest.raises(ConfigError) as err:
        placement.check_fit(
            free_bytes=40 * GIB, total_bytes=140 * GIB, utilization=0.5, device="cuda:0",
            sleep="off",
        )  # fmt: skip
    msg = str(err.value)
    # 40 / 140 = 0.286, less a 0.02 margin
    assert "gpu_memory_utilization=0.5 asks for 70.0 GiB" in msg and "<= 0.27" in msg
    assert "rollout.vllm.sleep" in msg and "rollout.vllm.devices" in msg


def test_fit_check_covers_every_gpu_of_a_tensor_parallel_engine():
    """A colocated TP-2 engine takes its leader's GPU and the next rank's: the trainer on the
    second may leave less free than the leader's (only the leader's was checked)."""
    launch = plan_launch(
        VllmOptions(tensor_parallel_size=2), engine=0, cuda=True, local_rank=0, world_size=2,
        local_world_size=2,
    )  # fmt: skip
    assert launch.devices == (0, 1)
    free = {0: 100 * GIB, 1: 30 * GIB}  # the second trainer rank holds more
    with pytest.raises(ConfigError, match=r"cannot start on cuda:1: .* leaves 30.0 GiB free"):
        placement.check_engine_gpus_fit(
            launch.devices, lambda i: (free[i], 140 * GIB), utilization=0.5, sleep="off"
        )
    placement.check_engine_gpus_fit((0,), lambda i: (free[i], 140 * GIB), utilization=0.5,
                                    sleep="off")  # fmt: skip


def test_launch_on_the_cpu_is_the_file_reload():
    launch = plan_launch(
        VllmOptions(), engine=0, cuda=False, local_rank=0, world_size=2, local_world_size=2
    )
    assert launch.transport.value == "file" and launch.loads_from_folder
    assert launch.llm_kwargs() == {} and launch.env == {}


def test_launch_on_a_gpu_colocated_with_ipc():
    launch = plan_launch(
        VllmOptions(sleep="discard", gpu_memory_utilization=0.3),
        engine=1, cuda=True, local_rank=1, world_size=2, local_world_size=2,
    )  # fmt: skip
    assert launch.transport.value == "ipc" and not launch.loads_from_folder
    assert launch.env == {"CUDA_VISIBLE_DEVICES": "1", "VLLM_ALLOW_INSECURE_SERIALIZATION": "1"}
    pytest.importorskip("vllm", reason="the weight-transfer config class is vLLM's")
    kwargs = launch.llm_kwargs()
    assert kwargs["gpu_memory_utilization"] == 0.3 and kwargs["enable_sleep_mode"] is True
    assert kwargs["load_format"] == "dummy" and kwargs["weight_transfer_config"].backend == "ipc"


# -- messages ----------------------------------------------------------------------------------


def _bucket() -> list[tuple[str, torch.Tensor]]:
    g = torch.Generator().manual_seed(0)
    return [
        ("model.embed_tokens.weight", torch.randn(7, 3, generator=g).to(torch.bfloat16)),
        ("model.norm.weight", torch.randn(3, generator=g)),
        # not contiguous: packed row-major, as .contiguous() lays it out
        ("lm_head.weight", torch.randn(3, 5, generator=g).t()),
        ("model.layers.0.mlp.gate.e_score_correction_bias", torch.randn(2, generator=g).half()),
    ]


def _unpack_by_hand(buffer, info):
    """The receiver's reading of a packed bucket, written out: each tensor's bytes in order,
    viewed as its dtype and shape."""
    out, offset = {}, 0
    for name, shape, dtype, size in zip(
        info["names"], info["shapes"], info["dtype_names"], info["tensor_sizes"]
    ):
        raw = buffer[offset : offset + size]
        out[name] = raw.view(getattr(torch, dtype)).reshape(shape)
        offset += size
    return out


def test_packed_bucket_round_trips_bit_for_bit():
    bucket = _bucket()
    packed = pack_bucket(bucket, "cpu")
    info = ipc_update_info(packed, ("handle", 1), "GPU-uuid")
    assert packed.buffer.dtype == torch.uint8
    # widest elements first, so that every slice's offset suits its dtype: 0, 12, 72, 114
    assert info["names"] == [bucket[i][0] for i in (1, 2, 0, 3)]
    assert info["tensor_sizes"] == [3 * 4, 15 * 4, 7 * 3 * 2, 2 * 2]
    assert packed.buffer.numel() == sum(info["tensor_sizes"])
    assert info["dtype_names"] == ["float32", "float32", "bfloat16", "float16"]
    got = _unpack_by_hand(packed.buffer, info)
    for name, tensor in bucket:
        assert got[name].dtype == tensor.dtype and torch.equal(got[name], tensor)
    handles = pickle.loads(base64.b64decode(info["ipc_handles_pickled"]))
    assert handles == {"GPU-uuid": ("handle", 1)}
    assert nccl_update_info(packed) == {k: info[k] for k in ("names", "dtype_names", "shapes")}


def test_messages_are_what_vllm_reads():
    """vLLM's own message classes accept the dicts, and its unpacking (the IPC consumer's and
    the NCCL consumer's) gives back the bucket; its packer lays the bytes out as ours."""
    pytest.importorskip("vllm", reason="compares with vLLM's own weight-transfer code")
    from vllm.distributed.weight_transfer.ipc_engine import IPCWeightTransferUpdateInfo
    from vllm.distributed.weight_transfer.nccl_engine import NCCLWeightTransferUpdateInfo
    from vllm.distributed.weight_transfer.packed_tensor import pack_tensors, unpack_tensor

    bucket = _bucket()
    packed = pack_bucket(bucket, "cpu")
    info = ipc_update_info(packed, ("handle", 1), "GPU-uuid")
    with pytest.MonkeyPatch.context() as mp:
        mp.setenv("VLLM_ALLOW_INSECURE_SERIALIZATION", "1")
        typed = IPCWeightTransferUpdateInfo(**info)
    assert typed.ipc_handles == {"GPU-uuid": ("handle", 1)}
    NCCLWeightTransferUpdateInfo(**nccl_update_info(packed))
    dtypes = [getattr(torch, d) for d in info["dtype_names"]]
    unpacked = unpack_tensor(
        packed.buffer, info["names"], info["shapes"], dtypes, info["tensor_sizes"]
    )
    expected = dict(bucket)
    assert [n for n, _ in unpacked] == info["names"]
    for name, got in unpacked:
        assert torch.equal(got, expected[name])
    # NCCL: with the buffer of one bucket, vLLM packs the whole bucket (in our order) into one
    # broadcast, byte for byte ours
    ordered = [(n, expected[n]) for n in info["names"]]
    theirs = pack_tensors(iter(ordered), lambda item: item[1], packed.buffer.numel())
    assert theirs is not None and theirs.names == info["names"]
    assert torch.equal(theirs.packed_tensor, packed.buffer)


# -- a stream's bucket is the packed buffer ----------------------------------------------------

# Six tensors and, worked out by hand, where vLLM's packed layout puts them: widest element first
# (int64; then float32; then the 2-byte bf16 / fp16; then bool), otherwise in bucket order.
SPECS = [
    TensorSpec("a", (3,), torch.bfloat16),  # 6 bytes
    TensorSpec("b", (2, 2), torch.float32),  # 16
    TensorSpec("c", (), torch.int64),  # 8
    TensorSpec("d", (5,), torch.bool),  # 5
    TensorSpec("e", (1, 3), torch.float16),  # 6
    TensorSpec("f", (0, 4), torch.float32),  # 0
]
# c at 0 (8 B), b at 8 (16 B), f at 24 (0 B), a at 24 (6 B), e at 30 (6 B), d at 36 (5 B): 41 B
BUFFER_ORDER = ["c", "b", "f", "a", "e", "d"]
OFFSETS = {"a": 24, "b": 8, "c": 0, "d": 36, "e": 30, "f": 24}
SIZES = {"a": 6, "b": 16, "c": 8, "d": 5, "e": 6, "f": 0}
TOTAL = 41


def _values() -> dict[str, torch.Tensor]:
    return {
        "a": torch.tensor([1.5, -2.0, 3.25], dtype=torch.bfloat16),
        "b": torch.tensor([[1.0, 2.0], [3.0, 4.0]]),
        "c": torch.tensor(-12345678901, dtype=torch.int64),
        "d": torch.tensor([True, False, True, True, False]),
        "e": torch.tensor([[0.5, -1.0, 7.0]], dtype=torch.float16),
        "f": torch.zeros(0, 4),
    }


def _flat() -> FlatBucket:
    bucket = FlatBucket(SPECS)
    for slot, value in zip(bucket.slots, _values().values()):
        slot.copy_(value)
    return bucket


def _bytes(t: torch.Tensor) -> bytes:
    return bytes(t.contiguous().reshape(-1).view(torch.uint8).tolist())


def test_flat_bucket_and_pack_share_one_layout_the_hand_computed_one():
    layout = packed_layout(SPECS)
    assert [SPECS[i].name for i in layout.order] == BUFFER_ORDER
    assert dict(zip((s.name for s in SPECS), layout.offsets)) == OFFSETS
    assert layout.nbytes == TOTAL
    flat = _flat()
    assert flat.buffer.numel() == TOTAL
    for spec, slot in zip(SPECS, flat.slots):
        assert slot.storage_offset() * slot.element_size() == OFFSETS[spec.name], spec.name
        assert slot.untyped_storage().data_ptr() == flat.buffer.data_ptr()
    # separate tensors (a state dict's) are copied into a new buffer laid out the same way
    values = _values()
    packed = pack_bucket(list(values.items()), "cpu")
    assert packed.names == BUFFER_ORDER
    assert packed.tensor_sizes == [SIZES[n] for n in BUFFER_ORDER]
    assert packed.buffer.numel() == TOTAL
    for name, value in values.items():
        at = OFFSETS[name]
        assert _bytes(packed.buffer[at : at + SIZES[name]]) == _bytes(value), name
    assert torch.equal(packed.buffer, flat.buffer)  # byte for byte the flat bucket's


def test_a_flat_bucket_is_packed_as_it_is():
    flat = _flat()
    packed = pack_bucket(flat.tensors(), "cpu")
    assert packed.buffer.data_ptr() == flat.buffer.data_ptr()  # no new buffer...
    assert packed.buffer.untyped_storage().data_ptr() == flat.buffer.untyped_storage().data_ptr()
    flat.buffer[0] ^= 0xFF  # ... and no copy: the same memory
    assert packed.buffer[0] == flat.buffer[0]
    assert packed.names == BUFFER_ORDER and packed.tensor_sizes == [SIZES[n] for n in BUFFER_ORDER]


@pytest.mark.parametrize(
    "variant", ["reordered", "one-left-out", "one-replaced", "one-strided", "on-another-device"]
)
def test_a_bucket_not_laid_out_as_packed_is_copied(variant):
    """Views of one buffer that do not sit where the packed layout puts them are packed anew
    (sending the buffer as it is would cut it wrongly at the receiver)."""
    flat = _flat()
    bucket = flat.tensors()
    device = "cpu"
    if variant == "reordered":  # e now comes before a in the layout, not in the buffer
        bucket = [bucket[5], bucket[1], *bucket[2:5], bucket[0]]
    elif variant == "one-left-out":  # the buffer holds bytes no tensor names
        bucket = bucket[:3]
    elif variant == "one-replaced":
        bucket[1] = ("b", bucket[1][1].clone())
    elif variant == "one-strided":  # in its place in the buffer, but transposed
        bucket[1] = ("b", bucket[1][1].t())
    else:
        device = "meta"  # the transport's device is not the bucket's
    packed = pack_bucket(bucket, device)
    if device == "meta":
        assert flat_buffer(bucket) is not None and packed.buffer.device.type == "meta"
        return
    assert flat_buffer(bucket) is None
    assert packed.buffer.data_ptr() != flat.buffer.data_ptr()
    for name, t in bucket:  # each tensor's bytes, row-major, where the message says
        i = packed.names.index(name)
        at = sum(packed.tensor_sizes[:i])
        assert _bytes(packed.buffer[at : at + packed.tensor_sizes[i]]) == _bytes(t), name


class _RecordingClient:
    def __init__(self) -> None:
        self.calls: list[tuple[str, object]] = []

    def init_weight_transfer_engine(self, init_info):
        self.calls.append(("init", init_info))

    def start_weight_update(self):
        self.calls.append(("start", None))

    def update_weights(self, update_info):
        self.calls.append(("update", update_info))

    def finish_weight_update(self):
        self.calls.append(("finish", None))


class _NoCudaStream:
    def synchronize(self) -> None:
        pass


def _without_cuda(monkeypatch) -> None:
    """The transports' few CUDA calls, made harmless, so that they run on the CPU here."""
    monkeypatch.setattr(torch.cuda, "current_stream", lambda *a, **k: _NoCudaStream())
    monkeypatch.setattr(torch.cuda, "ipc_collect", lambda: None)
    monkeypatch.setattr(
        torch.cuda, "get_device_properties", lambda d: type("P", (), {"uuid": "GPU-x"})()
    )


def test_ipc_transport_shares_a_flat_buckets_own_buffer(monkeypatch):
    _without_cuda(monkeypatch)
    shared: list[int] = []
    monkeypatch.setattr(transport, "ipc_handle_args", lambda b: shared.append(b.data_ptr()) or ())
    flat = _flat()
    values = _values()
    client = _RecordingClient()
    ipc = IpcTransport(client, torch.device("cpu"))
    assert ipc.bucket_device == torch.device("cpu")
    ipc.send(iter([flat.tensors(), *as_buckets(values)]))
    assert shared[0] == flat.buffer.data_ptr()  # the stream's bucket: its own memory, shared
    assert shared[1] not in {t.data_ptr() for t in values.values()}  # a dict's: packed anew
    updates = [info for kind, info in client.calls if kind == "update"]
    assert [u["names"] for u in updates] == [BUFFER_ORDER, BUFFER_ORDER]
    assert [k for k, _ in client.calls] == ["init", "start", "update", "update", "finish"]


def test_nccl_transport_broadcasts_a_flat_buckets_own_buffer(monkeypatch):
    _without_cuda(monkeypatch)
    sent: list[int] = []

    class Group:
        def broadcast(self, buffer, *, src, stream):
            sent.append(buffer.data_ptr())

    nccl = object.__new__(NcclTransport)  # its __init__ opens vLLM's NCCL group
    nccl.client, nccl.device, nccl.group = _RecordingClient(), torch.device("cpu"), Group()
    nccl.buffer_bytes = 1 << 20
    flat = _flat()
    nccl.send(iter([flat.tensors()]))
    assert sent == [flat.buffer.data_ptr()]
    [(_, info)] = [c for c in nccl.client.calls if c[0] == "update"]
    assert info["names"] == BUFFER_ORDER


def test_nccl_cuts_a_bucket_larger_than_the_engines_buffer(monkeypatch):
    """vLLM's consumer closes a broadcast once its tensors pass the buffer size: a bucket of
    several tensors over it goes as several broadcasts of at most the buffer (a single larger
    tensor alone), each announced by its own update."""
    _without_cuda(monkeypatch)
    sent: list[int] = []

    class Group:
        def broadcast(self, buffer, *, src, stream):
            sent.append(buffer.numel())

    nccl = object.__new__(NcclTransport)
    nccl.client, nccl.device, nccl.group = _RecordingClient(), torch.device("cpu"), Group()
    nccl.buffer_bytes = 40
    # fp32: a, b (16 + 16 bytes) fit 40; c starts the next; d (64 bytes) alone; e fits after
    whole = {n: torch.zeros(k) for n, k in [("a", 4), ("b", 4), ("c", 4), ("d", 16), ("e", 2)]}
    nccl.send(as_buckets(whole))
    updates = [info["names"] for kind, info in nccl.client.calls if kind == "update"]
    assert updates == [["a", "b"], ["c"], ["d"], ["e"]]
    assert sent == [32, 16, 64, 8]


def test_each_transport_says_where_it_wants_the_buckets():
    gpu = torch.device("cuda", 3)
    assert bucket_device("file", gpu) == HOST == FileTransport.bucket_device
    assert bucket_device("ipc", gpu) == gpu and bucket_device("nccl", gpu) == gpu


@pytest.mark.parametrize(
    ("sets", "cuda", "want"),
    [
        ([], False, HOST),  # the CPU: file
        ([], True, torch.device("cuda", 3)),  # colocated, one GPU per engine: ipc
        (["rollout.vllm.weight_transfer=file"], True, HOST),
        (["rollout.vllm.tensor_parallel_size=2"], True, HOST),  # auto picks file
    ],
)
def test_the_vllm_source_asks_for_its_transports_device(monkeypatch, sets, cuda, want):
    """Before the engine starts (the first sync streams to it) the source already names the
    device its transport will want; afterwards the transport itself says."""
    from unirl.rollouts.build import build_task
    from unirl.rollouts.vllm import source as vllm_source

    cfg = load_config(EXAMPLE, sets, world_size=2)
    src = vllm_source.VllmRolloutSource(build_task(cfg), cfg, hf_config=None, vocab_size=32, seed=0)
    monkeypatch.setattr(torch.cuda, "is_available", lambda: cuda)
    monkeypatch.setattr(vllm_source, "_device", lambda: torch.device("cuda", 3))
    assert src.weights_device == want
    src._transport = FileTransport(None, None)
    assert src.weights_device == HOST


# -- sleep mode --------------------------------------------------------------------------------


@attrs.define
class FakeLlm:
    calls: list = attrs.field(factory=list)

    def sleep(self, level):
        self.calls.append(("sleep", level))

    def wake_up(self, tags):
        self.calls.append(("wake_up", tuple(tags)))

    def reset_prefix_cache(self):
        self.calls.append(("reset_prefix_cache",))


def _two_steps(cycle: SleepCycle, llm: FakeLlm) -> list:
    for _ in range(2):  # the RL loop: sync, generate, (the trainer trains)
        cycle.before_sync()
        llm.calls.append(("sync",))
        cycle.before_generate()
        llm.calls.append(("generate",))
        cycle.after_generate()
    return llm.calls


@pytest.mark.parametrize(("mode", "level"), [("offload", 1), ("discard", 2)])
def test_sleep_cycle_call_sequence(mode, level):
    llm = FakeLlm()
    calls = _two_steps(SleepCycle(llm, mode), llm)
    assert calls == [
        ("sync",), ("generate",), ("sleep", level),  # the engine starts awake
        ("wake_up", ("weights",)), ("sync",),  # weights back before the sync writes them
        ("wake_up", ("kv_cache",)), ("reset_prefix_cache",), ("generate",),
        ("sleep", level),
    ]  # fmt: skip


def test_sleep_off_makes_no_calls():
    llm = FakeLlm()
    assert _two_steps(SleepCycle(llm, "off"), llm) == [("sync",), ("generate",)] * 2


def test_fit_after_the_first_step_stops_with_sleep_and_warns_without():
    """After step 1 on an 80 GiB card, gpu_memory_utilization 0.5 (40 GiB for the engine): a
    trainer peak of 30 GiB fits (70 <= 0.98 x 80 = 78.4); 45 GiB does not (85): with sleep the
    engine's wake would not fit (stop), without sleep both held their memory through step 1
    (warn). The value that fits: (80 - 45) / 80 - 0.02 = 0.4175."""
    from unirl.rollouts.vllm.fit import verdict

    assert verdict(30 * GIB, 80 * GIB, utilization=0.5, sleep="offload", device="cuda:0") is None
    stop = verdict(45 * GIB, 80 * GIB, utilization=0.5, sleep="offload", device="cuda:0")
    warn = verdict(45 * GIB, 80 * GIB, utilization=0.5, sleep="off", device="cuda:0")
    assert stop is not None and stop.stop and warn is not None and not warn.stop
    for v in (stop, warn):
        assert "peak on cuda:0 is 45.0 GiB of the card's 80.0 GiB" in v.message
        assert "gpu_memory_utilization=0.5 gives the engine 40.0 GiB" in v.message
        assert "Set rollout.vllm.gpu_memory_utilization <= 0.42" in v.message
    assert "wake (rollout.vllm.sleep='offload')" in stop.message


def test_fit_after_the_first_step_probes_every_gpu_of_the_engine_and_stops_every_rank(
    monkeypatch, caplog
):
    """One TP-2 engine on 4 ranks takes the GPUs of ranks 0 and 1: only those are probed (the
    injected probe: rank 1's trainer peaked at 60 of 80 GiB), and the stop reaches every rank
    through the source's own gather; without sleep rank 0 logs the warning and none stops."""
    import types

    from unirl.rollouts.vllm import source as vllm_source
    from unirl.rollouts.vllm.fit import act_on, verdict_here

    peaks = {0: 20 * GIB, 1: 60 * GIB}
    probed: list[int] = []
    for sleep in ("discard", "off"):
        options = VllmOptions(tensor_parallel_size=2, gpu_memory_utilization=0.4, sleep=sleep)
        mine = []
        for rank in range(4):

            def probe(rank=rank):
                probed.append(rank)
                return peaks[rank], 80 * GIB

            mine.append(verdict_here(options, probe, rank=rank, world_size=4))
        assert mine[0] is None and mine[1] is not None and mine[2:] == [None, None]
        # the source's method, with the gathered verdicts of the 4 ranks
        monkeypatch.setattr(vllm_source.torch.cuda, "is_available", lambda: True)
        for rank in range(4):
            stub = types.SimpleNamespace(
                options=options,
                memory_probe=lambda: (0, 80 * GIB),
                _world=lambda rank=rank: (rank, 4, None),
                _exchange=types.SimpleNamespace(all_gather=lambda own, what, mine=mine: mine),
            )
            if sleep == "discard":
                with pytest.raises(ConfigError, match=r"GPU of rank 1 is 60.0 GiB.*<= 0.23"):
                    vllm_source.VllmRolloutSource.check_trainer_fit(stub)
            else:
                with caplog.at_level("WARNING", logger="unirl.rollouts.vllm.fit"):
                    caplog.clear()
                    vllm_source.VllmRolloutSource.check_trainer_fit(stub)
                assert len(caplog.records) == (1 if rank == 0 else 0)
        act_on([None] * 4, rank=0)  # all fit: nothing
    assert probed == [0, 1, 0, 1]
