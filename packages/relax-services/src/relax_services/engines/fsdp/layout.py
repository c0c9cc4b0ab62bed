"""How the FSDP2 engine lays a model over its meshes: the units ``fully_shard`` wraps (each text decoder block,
and a scoring root holding the rest), and the process group of every rank that holds a piece of the model.

The root is a small module whose forward is the whole scoring computation
(:func:`~relax_services.engines.score_responses`), because the scoring calls the decoder, the embeddings, the
media encoders and the LM head directly rather than through the model's own forward; the root group holds the
embeddings, final norm, LM head and the media encoders.
"""

from __future__ import annotations

import re
from collections.abc import Sequence

import torch
import torch.distributed as dist
from torch.distributed.device_mesh import DeviceMesh

from relax_services.engines.fsdp.sequence_parallel import SequenceParallel, score_responses_sp, score_values_sp
from relax_services.engines.scoring import FrozenReference, score_responses, score_values
from relax_services.engines.torch.train import TorchTrainConfig
from relax_services.models.inputs import OmniPrompt
from relax_services.models.value import ValueModel

__all__ = ["ScoringRoot", "decoder_blocks", "joined_mesh", "shard_group"]

# Text decoder blocks of a thinker (``model.layers.N``) or of a critic (``thinker.model.layers.N``).
_BLOCK_NAME = re.compile(r"(thinker\.)?model\.layers\.\d+")


def decoder_blocks(model: torch.nn.Module) -> list[torch.nn.Module]:
    """The text decoder blocks of a Qwen2.5-Omni thinker or critic, the units ``fully_shard`` wraps.

    Raises:
        ValueError: If ``model`` has none (names ``model.layers.N`` or ``thinker.model.layers.N``).
    """
    blocks = [m for name, m in model.named_modules() if _BLOCK_NAME.fullmatch(name)]
    if not blocks:
        raise ValueError(
            f"{type(model).__name__} has no text decoder blocks named 'model.layers.N' or 'thinker.model.layers.N'"
        )
    return blocks


def shard_group(mesh: DeviceMesh, tp_mesh: DeviceMesh | None) -> dist.ProcessGroup:
    """The process group of every rank that holds a piece of the model: ``mesh``'s (FSDP's: data parallel, or
    ``dp × sp`` flattened with sequence parallelism), or with tensor parallelism the ``(mesh, tp)`` submesh's.
    Checkpoints and exports run over it: DCP's save plan must cover every shard, and over the dp group alone the
    tensor-parallel ranks of one dp rank would each write the same files. Collective over ``tp_mesh``'s root mesh
    when ``tp_mesh`` is given.

    Raises:
        ValueError: If ``tp_mesh`` is given and either mesh has no dimension name.
    """
    if tp_mesh is None:
        return mesh.get_group()
    return joined_mesh([mesh, tp_mesh]).get_group()


def joined_mesh(meshes: Sequence[DeviceMesh]) -> DeviceMesh:
    """The 1-D mesh over the ranks of several 1-D meshes of one root mesh (a submesh flattened to one dimension).
    Collective over the root mesh.

    Raises:
        ValueError: If a mesh has no dimension name.
    """
    names = [(m.mesh_dim_names or (None,))[0] for m in meshes]
    if None in names:
        raise ValueError(f"joining meshes needs dimension names, got {names}")
    # The submesh fully_shard itself builds from the same meshes (DeviceMesh._concatenate), flattened to one
    # dimension: torch has no public way yet to a group over several mesh dimensions (torchtitan flattens too).
    both = DeviceMesh._concatenate(list(meshes))
    return both._flatten("_".join(str(n) for n in names))


class ScoringRoot(torch.nn.Module):
    """FSDP root: its forward is the scoring of a micro-batch, so the root group's parameters (embeddings,
    encoders, LM head) are gathered for exactly that computation.

    The full KL's frozen reference is a plain attribute (:class:`FrozenReference` is not a module), so
    ``fully_shard`` of the root neither shards nor gathers it: each rank scores with its own whole copy.

    With ``sequence_parallel`` each micro-batch's sequences are split over that group
    (:func:`~relax_services.engines.fsdp.sequence_parallel.score_responses_sp`); the scores returned are the whole
    rows on every rank of it."""

    def __init__(
        self,
        policy: torch.nn.Module,
        config: TorchTrainConfig,
        device: torch.device,
        reference: FrozenReference | None = None,
        sequence_parallel: SequenceParallel | None = None,
    ) -> None:
        super().__init__()
        self.policy = policy
        self._config = config
        self._device = device
        self._reference = reference
        self.sequence_parallel = sequence_parallel

    def forward(
        self, prompts: Sequence[OmniPrompt], responses: Sequence[torch.Tensor], full_kl: bool = False
    ) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor | None, torch.Tensor | None]:
        """Scores one micro-batch: ``(logprobs, entropy, mask, values, full_kl)``, each ``[B, L]`` (``values`` only
        for a critic, ``full_kl`` only for a policy asked for it, with the reference)."""
        # A tuple of tensors, not a dataclass, so that FSDP's hooks see the outputs.
        sp = self.sequence_parallel
        if sp is not None:
            return self._forward_sp(prompts, responses, full_kl, sp)
        if isinstance(self.policy, ValueModel):
            s = score_values(
                self.policy, prompts, responses, self._config.suppressed_ids, self._device, packed=self._config.packing
            )
        else:
            s = score_responses(
                self.policy,
                prompts,
                responses,
                self._config.temperature,
                self._config.suppressed_ids,
                self._device,
                reference=self._reference if full_kl else None,
                chunk_tokens=self._config.scoring_chunk_tokens,
                packed=self._config.packing,
            )
        return s.logprobs, s.entropy, s.mask, s.values, s.full_kl

    def _forward_sp(
        self,
        prompts: Sequence[OmniPrompt],
        responses: Sequence[torch.Tensor],
        full_kl: bool,
        sp: SequenceParallel,
    ) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor | None, torch.Tensor | None]:
        if isinstance(self.policy, ValueModel):
            s = score_values_sp(self.policy, prompts, responses, sp, self._config.suppressed_ids, self._device)
        else:
            s = score_responses_sp(
                self.policy,
                prompts,
                responses,
                sp,
                self._config.temperature,
                self._config.suppressed_ids,
                self._device,
                reference=self._reference if full_kl else None,
                chunk_tokens=self._config.scoring_chunk_tokens,
            )
        return s.logprobs, s.entropy, s.mask, s.values, s.full_kl
