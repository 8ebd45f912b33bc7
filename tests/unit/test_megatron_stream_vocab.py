"""Megatron's weight stream at tensor-parallel size 1 hands the embedding / output layer to its
bucket as a view of the parameter: the conversion's cat of the one shard made a second 1 GiB
copy of it at 7B beside the bucket (measured on the H200: 2.03 GiB above the trainer's memory,
against FSDP2's 1.02 GiB)."""

from __future__ import annotations

import types

import pytest
import torch

pytest.importorskip("megatron.core")

from unirl.backends.megatron.weights.stream import _maker, _Unit


def test_vocab_rows_are_a_view_of_the_parameter_at_tp1():
    padded, vocab, hidden = 40, 37, 8
    param = torch.randn(padded, hidden)
    entry = types.SimpleNamespace(kind="vocab", expert=None, hf_names=["model.embed_tokens.weight"])
    topology = types.SimpleNamespace(tp_size=1)
    hf_config = types.SimpleNamespace(vocab_size=vocab)
    (made,) = _maker(topology, hf_config)(_Unit(entry, param), None)
    assert made.shape == (vocab, hidden)
    assert made.untyped_storage().data_ptr() == param.untyped_storage().data_ptr()
    assert torch.equal(made, param[:vocab])
