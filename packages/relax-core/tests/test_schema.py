"""Sample validation and the padded / packed conversions."""

from __future__ import annotations

import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st

import relax_core as rc


def _samples() -> list[rc.Sample]:
    return [
        rc.Sample(
            uid="a",
            group_id="p0",
            prompt_ids=[1, 2, 3],
            response_ids=[4, 5, 6],
            loss_mask=[1, 0, 1],  # token 5 came from the environment
            behaviour_logprobs=[-0.5, 0.0, -0.25],
            policy_versions=[3, 3, 4],
            reward=1.0,
            media=[rc.MediaRef("image", "img/0.png", num_tokens=4)],
            metadata={"answer": "6"},
        ),
        rc.Sample(uid="b", group_id="p0", prompt_ids=[7], response_ids=[8, 9, 10, 11], policy_versions=[2, 2, 2, 2]),
        rc.Sample(uid="c", group_id="p1", prompt_ids=[12, 13], response_ids=[], reward=0.0, reward_error="timeout"),
    ]


def test_sample_defaults_and_versions() -> None:
    s = rc.Sample(uid="x", group_id="g", prompt_ids=[1], response_ids=[2, 3])
    assert s.loss_mask == [1, 1] and s.behaviour_logprobs == [0.0, 0.0] and s.policy_versions == [0, 0]
    a = _samples()[0]
    assert a.version_range == (3, 4)
    assert a.staleness(current_version=6) == 3


def test_version_range_ignores_environment_tokens() -> None:
    s = rc.Sample("x", "g", [1], [2, 3], loss_mask=[0, 1], policy_versions=[1, 5])
    assert s.version_range == (5, 5)
    with pytest.raises(ValueError, match="empty response"):
        _ = _samples()[2].version_range


@pytest.mark.parametrize(
    ("kwargs", "message"),
    [
        ({"loss_mask": [1]}, "loss_mask has 1 entries; response_ids has 2"),
        ({"behaviour_logprobs": [0.0, 0.0, 0.0]}, "behaviour_logprobs has 3"),
        ({"policy_versions": [1]}, "policy_versions has 1"),
        ({"loss_mask": [1, 2]}, "loss_mask entries must be 0 or 1"),
        ({"policy_versions": [0, -1]}, "policy_versions must be >= 0"),
    ],
)
def test_sample_validation(kwargs: dict[str, list[float]], message: str) -> None:
    with pytest.raises(ValueError, match=message):
        rc.Sample("bad", "g", [1], [2, 3], **kwargs)  # type: ignore[arg-type]


def test_media_ref_validation() -> None:
    with pytest.raises(ValueError, match="image, audio, video"):
        rc.MediaRef("smell", "x")  # type: ignore[arg-type]


def test_dict_round_trip() -> None:
    for s in _samples():
        assert rc.Sample.from_dict(s.to_dict()) == s


def test_padded_layout() -> None:
    batch = rc.PaddedBatch.from_samples(_samples(), pad_token_id=0)
    assert batch.prompt_ids.tolist() == [[1, 2, 3], [0, 0, 7], [0, 12, 13]]
    assert batch.response_ids.tolist() == [[4, 5, 6, 0], [8, 9, 10, 11], [0, 0, 0, 0]]
    assert batch.response_mask.tolist() == [[1, 1, 1, 0], [1, 1, 1, 1], [0, 0, 0, 0]]
    assert batch.loss_mask.tolist() == [[1, 0, 1, 0], [1, 1, 1, 1], [0, 0, 0, 0]]
    assert batch.policy_versions.tolist() == [[3, 3, 4, -1], [2, 2, 2, 2], [-1, -1, -1, -1]]
    torch.testing.assert_close(batch.behaviour_logprobs[0], torch.tensor([-0.5, 0.0, -0.25, 0.0]))
    assert batch.input_ids.shape == (3, 7)
    assert batch.position_ids.tolist()[1] == [0, 0, 0, 1, 2, 3, 4]
    assert batch.rewards[0] == 1.0 and torch.isnan(batch.rewards[1])
    assert batch.group_ids == ["p0", "p0", "p1"] and batch.reward_errors == [None, None, "timeout"]


def test_padded_round_trip() -> None:
    samples = _samples()
    assert rc.PaddedBatch.from_samples(samples).to_samples() == samples


def test_packed_layout() -> None:
    packed = rc.PackedBatch.from_samples(_samples())
    assert packed.input_ids.tolist() == [1, 2, 3, 4, 5, 6, 7, 8, 9, 10, 11, 12, 13]
    assert packed.cu_seqlens.tolist() == [0, 6, 11, 13] and packed.cu_seqlens.dtype == torch.int32
    assert packed.position_ids.tolist() == [0, 1, 2, 3, 4, 5, 0, 1, 2, 3, 4, 0, 1]
    assert packed.loss_mask.tolist() == [0, 0, 0, 1, 0, 1, 0, 1, 1, 1, 1, 0, 0]
    assert packed.policy_versions.tolist()[:6] == [-1, -1, -1, 3, 3, 4]
    assert packed.max_seqlen == 6 and packed.prompt_lens.tolist() == [3, 1, 2]


def test_packed_round_trip() -> None:
    samples = _samples()
    assert rc.PackedBatch.from_samples(samples).to_samples() == samples


def test_packed_response_values_match_padded_layout() -> None:
    samples = _samples()
    packed = rc.PackedBatch.from_samples(samples)
    padded = rc.PaddedBatch.from_samples(samples)
    assert torch.equal(packed.to_response_padded(packed.input_ids), padded.response_ids)
    assert torch.equal(packed.to_response_padded(packed.loss_mask), padded.loss_mask)
    torch.testing.assert_close(packed.to_response_padded(packed.behaviour_logprobs), padded.behaviour_logprobs)
    # Extra trailing dims ([N, V] → [B, T, V]) are carried along.
    wide = packed.input_ids[:, None].expand(-1, 2).float()
    assert packed.to_response_padded(wide, fill=-1.0).shape == (3, 4, 2)


def test_empty_batches_are_rejected() -> None:
    with pytest.raises(ValueError, match="empty"):
        rc.PaddedBatch.from_samples([])
    with pytest.raises(ValueError, match="empty"):
        rc.PackedBatch.from_samples([])


@st.composite
def _sample_lists(draw: st.DrawFn) -> list[rc.Sample]:
    n = draw(st.integers(1, 5))
    samples = []
    for i in range(n):
        prompt = draw(st.lists(st.integers(1, 63), max_size=6))
        t = draw(st.integers(0, 6))
        samples.append(
            rc.Sample(
                uid=f"s{i}",
                group_id=f"g{i % 2}",
                prompt_ids=prompt,
                response_ids=draw(st.lists(st.integers(1, 63), min_size=t, max_size=t)),
                loss_mask=draw(st.lists(st.integers(0, 1), min_size=t, max_size=t)),
                # Exactly representable in float32 so the round trip is exact.
                behaviour_logprobs=[-x / 8 for x in draw(st.lists(st.integers(0, 80), min_size=t, max_size=t))],
                policy_versions=draw(st.lists(st.integers(0, 9), min_size=t, max_size=t)),
                reward=draw(st.none() | st.sampled_from([0.0, 0.5, 1.0])),
            )
        )
    return samples


@settings(max_examples=60, deadline=None)
@given(_sample_lists())
def test_padded_and_packed_round_trip_property(samples: list[rc.Sample]) -> None:
    assert rc.PaddedBatch.from_samples(samples).to_samples() == samples
    packed = rc.PackedBatch.from_samples(samples)
    assert packed.to_samples() == samples
    padded = rc.PaddedBatch.from_samples(samples)
    response = packed.to_response_padded(packed.input_ids)
    t = padded.response_ids.shape[1]
    assert torch.equal(response[:, :t], padded.response_ids[:, : response.shape[1]])


def test_to_device_moves_every_tensor() -> None:
    padded = rc.PaddedBatch.from_samples(_samples()).to("cpu")
    packed = rc.PackedBatch.from_samples(_samples()).to(torch.device("cpu"))
    assert padded.to_samples() == _samples() and packed.to_samples() == _samples()
