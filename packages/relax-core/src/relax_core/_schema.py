"""Trajectory schema: one generated sample, and its padded and packed (varlen) batch forms."""

from __future__ import annotations

import dataclasses
import math
from collections.abc import Mapping, Sequence
from dataclasses import dataclass, field
from typing import Any, Literal

import torch
from torch import Tensor

__all__ = ["MediaRef", "Modality", "PackedBatch", "PaddedBatch", "Sample"]

Modality = Literal["image", "audio", "video"]
_MODALITIES = ("image", "audio", "video")


@dataclass(frozen=True)
class MediaRef:
    """A reference to one multimodal input of a prompt (the bytes live elsewhere).

    Attributes:
        modality: ``image``, ``audio`` or ``video``.
        uri: Where the item is: a file path, URL or storage key.
        num_tokens: Placeholder tokens it occupies in the prompt, when known.
        meta: Free-form details (size, duration, fps, ...).
    """

    modality: Modality
    uri: str
    num_tokens: int | None = None
    meta: dict[str, Any] = field(default_factory=dict)

    def __post_init__(self) -> None:
        if self.modality not in _MODALITIES:
            raise ValueError(f"MediaRef.modality must be one of {', '.join(_MODALITIES)}; got {self.modality!r}")


@dataclass
class Sample:
    """One trajectory: a prompt, the generated response and everything training needs about it.

    Per-token lists are aligned with ``response_ids``. Missing per-token fields default to: loss mask
    all ones, behaviour log-probs all zero, policy versions all zero.

    Attributes:
        uid: Unique id of the sample (the queue row key).
        group_id: Samples of the same prompt share it (GRPO groups).
        prompt_ids: Prompt token ids.
        response_ids: Response token ids, including environment/tool tokens of multi-turn rollouts.
        loss_mask: 1 on tokens the policy generated, 0 on environment tokens.
        behaviour_logprobs: log μ of each response token under the weights that generated it.
        policy_versions: Policy version that generated each response token.
        reward: Scalar outcome reward, None until scored.
        reward_error: Why scoring failed, None when it did not.
        media: References to the prompt's multimodal inputs.
        metadata: Anything else (ground truth, task name, ...); must be serialisable to travel.
    """

    uid: str
    group_id: str
    prompt_ids: list[int]
    response_ids: list[int]
    loss_mask: list[int] = field(default_factory=list)
    behaviour_logprobs: list[float] = field(default_factory=list)
    policy_versions: list[int] = field(default_factory=list)
    reward: float | None = None
    reward_error: str | None = None
    media: list[MediaRef] = field(default_factory=list)
    metadata: dict[str, Any] = field(default_factory=dict)

    def __post_init__(self) -> None:
        n = len(self.response_ids)
        if not self.loss_mask:
            self.loss_mask = [1] * n
        if not self.behaviour_logprobs:
            self.behaviour_logprobs = [0.0] * n
        if not self.policy_versions:
            self.policy_versions = [0] * n
        for name in ("loss_mask", "behaviour_logprobs", "policy_versions"):
            length = len(getattr(self, name))
            if length != n:
                raise ValueError(f"sample {self.uid!r}: {name} has {length} entries; response_ids has {n}")
        if any(m not in (0, 1) for m in self.loss_mask):
            raise ValueError(f"sample {self.uid!r}: loss_mask entries must be 0 or 1")
        if any(v < 0 for v in self.policy_versions):
            raise ValueError(f"sample {self.uid!r}: policy_versions must be >= 0")

    @property
    def version_range(self) -> tuple[int, int]:
        """``(v_min, v_max)`` over the policy-generated tokens (all response tokens if none are).

        Raises:
            ValueError: If the response is empty.
        """
        versions = [v for v, m in zip(self.policy_versions, self.loss_mask, strict=True) if m] or self.policy_versions
        if not versions:
            raise ValueError(f"sample {self.uid!r} has an empty response: no policy version")
        return min(versions), max(versions)

    def staleness(self, current_version: int) -> int:
        """``V − v_min``: how many updates older than ``current_version`` its oldest token is."""
        return current_version - self.version_range[0]

    def to_dict(self) -> dict[str, Any]:
        """Plain-data form (lists, numbers, strings), e.g. for a queue or JSON."""
        return dataclasses.asdict(self)

    @classmethod
    def from_dict(cls, data: Mapping[str, Any]) -> Sample:
        """Inverse of :meth:`to_dict`."""
        fields = dict(data)
        fields["media"] = [m if isinstance(m, MediaRef) else MediaRef(**m) for m in fields.get("media", [])]
        return cls(**fields)


def _non_tensor_fields(samples: Sequence[Sample]) -> dict[str, Any]:
    return {
        "uids": [s.uid for s in samples],
        "group_ids": [s.group_id for s in samples],
        "rewards": torch.tensor([math.nan if s.reward is None else s.reward for s in samples], dtype=torch.float32),
        "reward_errors": [s.reward_error for s in samples],
        "media": [list(s.media) for s in samples],
        "metadata": [dict(s.metadata) for s in samples],
    }


def _tensors_to(batch: Any, device: torch.device | str) -> dict[str, Any]:
    return {
        f.name: getattr(batch, f.name).to(device)
        for f in dataclasses.fields(batch)
        if isinstance(getattr(batch, f.name), Tensor)
    }


def _reward(value: float) -> float | None:
    return None if math.isnan(value) else value


@dataclass
class PaddedBatch:
    """Samples as padded tensors: prompts left-padded, responses right-padded.

    ``input_ids = cat(prompt_ids, response_ids)``; the logits at position P − 1 + t predict response
    token t, so response log-probs are ``logits[:, P - 1 : -1]``.

    Attributes:
        prompt_ids: ``[B, P]`` left-padded with the pad id.
        prompt_mask: ``[B, P]`` 1 on real prompt tokens.
        response_ids: ``[B, T]`` right-padded.
        response_mask: ``[B, T]`` 1 on every real response token (environment tokens included).
        loss_mask: ``[B, T]`` 1 on policy-generated tokens only.
        behaviour_logprobs: ``[B, T]`` float32, 0 on padding.
        policy_versions: ``[B, T]`` int64, −1 on padding.
        rewards: ``[B]`` float32, NaN where unscored.
        uids, group_ids, reward_errors, media, metadata: Per-sample lists.
    """

    prompt_ids: Tensor
    prompt_mask: Tensor
    response_ids: Tensor
    response_mask: Tensor
    loss_mask: Tensor
    behaviour_logprobs: Tensor
    policy_versions: Tensor
    rewards: Tensor
    uids: list[str]
    group_ids: list[str]
    reward_errors: list[str | None]
    media: list[list[MediaRef]]
    metadata: list[dict[str, Any]]

    def to(self, device: torch.device | str) -> PaddedBatch:
        """A copy with every tensor moved to ``device``."""
        return dataclasses.replace(self, **_tensors_to(self, device))

    @property
    def input_ids(self) -> Tensor:
        """``[B, P + T]`` prompt and response ids."""
        return torch.cat([self.prompt_ids, self.response_ids], dim=1)

    @property
    def attention_mask(self) -> Tensor:
        """``[B, P + T]`` 1 on real tokens."""
        return torch.cat([self.prompt_mask, self.response_mask], dim=1)

    @property
    def position_ids(self) -> Tensor:
        """``[B, P + T]`` positions counted from each sequence's first real token (0 on left padding)."""
        return (self.attention_mask.cumsum(dim=1) - 1).clamp(min=0)

    @classmethod
    def from_samples(cls, samples: Sequence[Sample], pad_token_id: int = 0) -> PaddedBatch:
        """Pad a list of samples.

        Raises:
            ValueError: If ``samples`` is empty.
        """
        if not samples:
            raise ValueError("cannot pad an empty list of samples")
        n = len(samples)
        p_len = max(len(s.prompt_ids) for s in samples)
        t_len = max(len(s.response_ids) for s in samples)
        prompt_ids = torch.full((n, p_len), pad_token_id, dtype=torch.long)
        prompt_mask = torch.zeros((n, p_len), dtype=torch.long)
        response_ids = torch.full((n, t_len), pad_token_id, dtype=torch.long)
        response_mask = torch.zeros((n, t_len), dtype=torch.long)
        loss_mask = torch.zeros((n, t_len), dtype=torch.long)
        logprobs = torch.zeros((n, t_len), dtype=torch.float32)
        versions = torch.full((n, t_len), -1, dtype=torch.long)
        for i, s in enumerate(samples):
            p, t = len(s.prompt_ids), len(s.response_ids)
            if p:
                prompt_ids[i, p_len - p :] = torch.tensor(s.prompt_ids)
                prompt_mask[i, p_len - p :] = 1
            if t:
                response_ids[i, :t] = torch.tensor(s.response_ids)
                response_mask[i, :t] = 1
                loss_mask[i, :t] = torch.tensor(s.loss_mask)
                logprobs[i, :t] = torch.tensor(s.behaviour_logprobs, dtype=torch.float32)
                versions[i, :t] = torch.tensor(s.policy_versions)
        return cls(
            prompt_ids=prompt_ids,
            prompt_mask=prompt_mask,
            response_ids=response_ids,
            response_mask=response_mask,
            loss_mask=loss_mask,
            behaviour_logprobs=logprobs,
            policy_versions=versions,
            **_non_tensor_fields(samples),
        )

    def to_samples(self) -> list[Sample]:
        """Unpad back into samples (inverse of :meth:`from_samples`, up to float32 log-probs)."""
        samples = []
        for i in range(len(self.uids)):
            prompt = self.prompt_ids[i][self.prompt_mask[i].bool()]
            valid = self.response_mask[i].bool()
            samples.append(
                Sample(
                    uid=self.uids[i],
                    group_id=self.group_ids[i],
                    prompt_ids=prompt.tolist(),
                    response_ids=self.response_ids[i][valid].tolist(),
                    loss_mask=self.loss_mask[i][valid].tolist(),
                    behaviour_logprobs=self.behaviour_logprobs[i][valid].tolist(),
                    policy_versions=self.policy_versions[i][valid].tolist(),
                    reward=_reward(float(self.rewards[i])),
                    reward_error=self.reward_errors[i],
                    media=list(self.media[i]),
                    metadata=dict(self.metadata[i]),
                )
            )
        return samples


@dataclass
class PackedBatch:
    """Samples packed end to end without padding (varlen / FlashAttention ``cu_seqlens`` form).

    Sequence b occupies ``[cu_seqlens[b], cu_seqlens[b + 1])``: its prompt then its response.
    Per-token fields are aligned with the token itself; the logit predicting token j sits at j − 1.

    Attributes:
        input_ids: ``[N]`` all tokens.
        position_ids: ``[N]`` restart at 0 for every sequence.
        cu_seqlens: ``[B + 1]`` int32 cumulative sequence lengths.
        prompt_lens: ``[B]`` int64 prompt length of each sequence.
        max_seqlen: Longest sequence length.
        loss_mask: ``[N]`` 1 on policy-generated response tokens (0 on prompts).
        behaviour_logprobs: ``[N]`` float32 (0 on prompts).
        policy_versions: ``[N]`` int64 (−1 on prompts).
        rewards: ``[B]`` float32, NaN where unscored.
        uids, group_ids, reward_errors, media, metadata: Per-sample lists.
    """

    input_ids: Tensor
    position_ids: Tensor
    cu_seqlens: Tensor
    prompt_lens: Tensor
    max_seqlen: int
    loss_mask: Tensor
    behaviour_logprobs: Tensor
    policy_versions: Tensor
    rewards: Tensor
    uids: list[str]
    group_ids: list[str]
    reward_errors: list[str | None]
    media: list[list[MediaRef]]
    metadata: list[dict[str, Any]]

    @classmethod
    def from_samples(cls, samples: Sequence[Sample]) -> PackedBatch:
        """Pack a list of samples.

        Raises:
            ValueError: If ``samples`` is empty.
        """
        if not samples:
            raise ValueError("cannot pack an empty list of samples")
        ids: list[int] = []
        pos: list[int] = []
        mask: list[int] = []
        logprobs: list[float] = []
        versions: list[int] = []
        lengths = []
        for s in samples:
            p, t = len(s.prompt_ids), len(s.response_ids)
            ids += s.prompt_ids + s.response_ids
            pos += list(range(p + t))
            mask += [0] * p + s.loss_mask
            logprobs += [0.0] * p + s.behaviour_logprobs
            versions += [-1] * p + s.policy_versions
            lengths.append(p + t)
        cu = torch.zeros(len(samples) + 1, dtype=torch.int32)
        cu[1:] = torch.cumsum(torch.tensor(lengths), dim=0)
        return cls(
            input_ids=torch.tensor(ids, dtype=torch.long),
            position_ids=torch.tensor(pos, dtype=torch.long),
            cu_seqlens=cu,
            prompt_lens=torch.tensor([len(s.prompt_ids) for s in samples], dtype=torch.long),
            max_seqlen=max(lengths),
            loss_mask=torch.tensor(mask, dtype=torch.long),
            behaviour_logprobs=torch.tensor(logprobs, dtype=torch.float32),
            policy_versions=torch.tensor(versions, dtype=torch.long),
            **_non_tensor_fields(samples),
        )

    def to(self, device: torch.device | str) -> PackedBatch:
        """A copy with every tensor moved to ``device``."""
        return dataclasses.replace(self, **_tensors_to(self, device))

    def response_index(self) -> tuple[Tensor, Tensor]:
        """Where the response tokens are: ``(flat [M], response_mask [B, T])``.

        ``flat`` holds the packed positions of all response tokens in sample order; scattering them
        into ``response_mask``'s true entries gives the padded ``[B, T]`` layout of PaddedBatch.
        """
        starts = self.cu_seqlens[:-1].long() + self.prompt_lens  # [B]
        ends = self.cu_seqlens[1:].long()  # [B]
        lengths = ends - starts  # [B]
        t_len = int(lengths.max().item()) if lengths.numel() else 0
        response_mask = torch.arange(t_len).unsqueeze(0) < lengths.unsqueeze(1)  # [B, T]
        flat = torch.cat([torch.arange(int(a), int(b)) for a, b in zip(starts, ends, strict=True)])
        return flat, response_mask

    def to_response_padded(self, values: Tensor, fill: float = 0.0) -> Tensor:
        """Gather per-token values ``[N, ...]`` of the response tokens into padded ``[B, T, ...]``."""
        flat, response_mask = self.response_index()
        out = torch.full((*response_mask.shape, *values.shape[1:]), fill, dtype=values.dtype, device=values.device)
        out[response_mask.to(values.device)] = values[flat.to(values.device)]
        return out

    def to_samples(self) -> list[Sample]:
        """Unpack back into samples (inverse of :meth:`from_samples`, up to float32 log-probs)."""
        samples = []
        for i in range(len(self.uids)):
            start, end = int(self.cu_seqlens[i]), int(self.cu_seqlens[i + 1])
            mid = start + int(self.prompt_lens[i])
            samples.append(
                Sample(
                    uid=self.uids[i],
                    group_id=self.group_ids[i],
                    prompt_ids=self.input_ids[start:mid].tolist(),
                    response_ids=self.input_ids[mid:end].tolist(),
                    loss_mask=self.loss_mask[mid:end].tolist(),
                    behaviour_logprobs=self.behaviour_logprobs[mid:end].tolist(),
                    policy_versions=self.policy_versions[mid:end].tolist(),
                    reward=_reward(float(self.rewards[i])),
                    reward_error=self.reward_errors[i],
                    media=list(self.media[i]),
                    metadata=dict(self.metadata[i]),
                )
            )
        return samples
