"""Requests queued together run as one backend call: the worker packs the datums of several
``forward_backward`` requests of one client into the backend's microbatches, and each request
gets what it gets when it runs alone. Which queued requests may be merged, as a table."""

from __future__ import annotations

import attrs
import numpy as np
import pytest
import torch

pytest.importorskip("tinker")
pytest.importorskip("peft")
from tinker.proto.response_conv import deserialize_forward_backward_output

from tests.serve_fixtures import BASE, free_port, serve_dict
from unirl.backends.process_group import destroy_process_group, init_process_group
from unirl.core.backend import AdamStepSettings
from unirl.core.config.sections.training import ParallelConfig
from unirl.serve.batching import TokenDatum
from unirl.serve.config import serve_config_from_dict
from unirl.serve.futures import FutureStore
from unirl.serve.jobs import FwdBwdJob, OptimJob
from unirl.serve.losses import sdk_loss
from unirl.serve.sessions import Sessions, TrainingSession, build_training_backend
from unirl.serve.worker import Worker, batch_rounds

pytestmark = pytest.mark.usefixtures("one_thread")

CE = sdk_loss("cross_entropy").settings({})
LORA = {"rank": 2, "target_modules": ["q_proj", "v_proj"], "init_seed": 0}


def _job(rid: str, model: str, *, loss: str = "cross_entropy", fwd: bool = False, n: int = 1):
    g = torch.Generator().manual_seed(int(rid[1:]))
    datums = tuple(
        TokenDatum(
            tokens=torch.randint(0, 64, (3 + i,), generator=g),
            targets=torch.randint(0, 64, (3 + i,), generator=g),
            mask=torch.rand(3 + i, generator=g),
        )
        for i in range(n)
    )
    settings = sdk_loss(loss).settings({})
    return FwdBwdJob(
        request_id=rid,
        model_id=model,
        loss_fn=loss,
        settings=settings,
        forward_only=fwd,
        datums=datums,
    )


def _optim(rid: str, model: str) -> OptimJob:
    s = AdamStepSettings(lr=1e-2, beta1=0.9, beta2=0.95, eps=1e-8, weight_decay=0.0, grad_clip=0)
    return OptimJob(request_id=rid, model_id=model, settings=s)


def test_batch_rounds_merge_only_what_may_run_together():
    a1, b1, a2, a3 = _job("r1", "A"), _job("r2", "B"), _job("r3", "A"), _job("r4", "A", fwd=True)
    opt, a5, a6 = _optim("r5", "A"), _job("r6", "A"), _job("r7", "A", loss="importance_sampling")
    units = batch_rounds([a1, b1, a2, a3, opt, a5, a6])
    ids = [[job.request_id for job in unit] for unit in units]
    # A's two forward_backward requests run together (B's in between is another client); a
    # forward-only one, the optimizer step and a request with another loss each start a unit
    assert ids == [["r1", "r3"], ["r2"], ["r4"], ["r5"], ["r6"], ["r7"]]


def test_queued_requests_run_as_one_backend_call_with_each_alone_result(tiny_folder, tmp_path):
    cfg = serve_config_from_dict(
        serve_dict(
            tiny_folder,
            tmp_path,
            free_port(),
            tokens_per_microbatch=8,  # the 6 datums (3 or 4 tokens) in 3 microbatches
            train={"backend": "fsdp2", "model": {"max_seq_len": 8}},
        )
    )
    group = init_process_group(ParallelConfig())
    sessions = Sessions()
    try:
        backend = build_training_backend(cfg, tiny_folder, LORA)
        sessions.add(TrainingSession("A", BASE, backend, LORA))
        jobs = [_job(f"r{i}", "A", fwd=True, n=2) for i in (1, 2, 3)]
        futures = FutureStore()
        worker = Worker(cfg, futures, sessions)
        ids = {}
        for job in jobs:  # queued before the worker starts: it finds all three at once
            ids[job.request_id] = futures.create()
            worker.submit(attrs.evolve(job, request_id=ids[job.request_id]))
        worker.start()
        together = [futures.wait(ids[j.request_id], 60) for j in jobs]
        assert worker.backend_calls == 1
        alone = []
        for job in jobs:
            rid = futures.create()
            worker.submit(attrs.evolve(job, request_id=rid))
            alone.append(futures.wait(rid, 60))
        worker.stop()
        assert worker.backend_calls == 4
        for got, want in zip(together, alone):
            got_out = deserialize_forward_backward_output(got.proto)
            want_out = deserialize_forward_backward_output(want.proto)
            assert got_out.metrics["loss:sum"] == pytest.approx(
                want_out.metrics["loss:sum"], rel=1e-6
            )
            for g, w in zip(got_out.loss_fn_outputs, want_out.loss_fn_outputs):
                np.testing.assert_allclose(
                    g["logprobs"].data, w["logprobs"].data, rtol=1e-6, atol=1e-6
                )
    finally:
        sessions.close()
        destroy_process_group(group)
