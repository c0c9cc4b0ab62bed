"""The model families relax trains, in one explicit table: what each supports, how its positions are computed,
which of its token ids are never sampled, and the transformers class that loads it.

A checkpoint's family is found from ``config.json``'s ``architectures`` entry. Adding a family is one entry
here (plus, where its forward differs, one module the engines dispatch to through :attr:`ModelFamily.positions`).
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import TYPE_CHECKING, Literal

import transformers

if TYPE_CHECKING:
    from transformers import PreTrainedModel

Modality = Literal["text", "image", "video", "audio"]
Positions = Literal["1d", "vl-mrope", "vl3-mrope", "omni-mrope"]
VideoLayout = Literal["clip", "timestamped_frames"]

__all__ = [
    "CONTAINERS",
    "FAMILIES",
    "Container",
    "Modality",
    "ModelFamily",
    "Positions",
    "UnsupportedArchitectureError",
    "VideoLayout",
    "family_of",
    "family_of_config",
    "family_of_model",
]


@dataclass(frozen=True)
class ModelFamily:
    """One model family.

    Attributes:
        name: Short family name (``"qwen2.5-omni-thinker"``).
        model_class: Name of the transformers class that loads a checkpoint of the family (it is also the
            ``architectures`` entry of its ``config.json``).
        modalities: Input modalities the family's forward accepts.
        positions: How position ids are computed: ``"1d"`` (one index per real token, the causal LM's), or the
            3-D time/height/width rope of the model's own ``get_rope_index``: ``"vl-mrope"`` (Qwen2.5-VL's, from
            per-token modality types and seconds per grid), ``"vl3-mrope"`` (Qwen3-VL's, from per-token modality
            types, each video frame its own grid: its time is written as text tokens between frames, so it takes
            no seconds) or ``"omni-mrope"`` (the omni thinker's, with audio).
        placeholder_keys: Model-config keys of each media placeholder id (``image`` / ``video`` / ``audio``),
            and of the span markers, read from the checkpoint (the text config when a key is not at the top).
        never_sample: What must never be sampled: every special (added) token of the tokenizer except the
            end-of-turn ids, and every placeholder and marker id named in ``placeholder_keys``.
        chat_template_required: A checkpoint of the family must ship a chat template (else prompts are
            rendered in the documented plain-text mode).
        deepstack: The vision tower also gives features of some of its inner layers that the decoder adds to the
            hidden states at the vision tokens after each of its first layers (Qwen3-VL's DeepStack): where relax
            runs the decoder on its own input embeddings (media encoded once per distinct item) it passes those
            features too (:mod:`~relax_services.models.deepstack`).
        video_layout: How its processor lays a video out in the prompt (relax-modalities' ``VideoSettings.layout``):
            ``"clip"``, one placeholder block per clip (Qwen2.5-VL, the omni thinker), or ``"timestamped_frames"``,
            one block per temporal grid step after its ``<t seconds>`` text, with the processor's own frame
            sampling and whole-clip pixel budget (Qwen3-VL, whose rope takes one grid row per block).
        tool_parser: How an assistant turn's tool calls are read in multi-turn episodes: a key of
            ``relax_services.agents.TOOL_PARSERS`` (``"qwen"``: ``<tool_call>{"name": ..., "arguments": ...}
            </tool_call>``, the form the Qwen2.5/3 chat templates and SmolLM2's tool prompts use).
    """

    name: str
    model_class: str
    modalities: tuple[Modality, ...]
    positions: Positions
    placeholder_keys: tuple[tuple[str, str], ...] = ()
    never_sample: str = "special tokens except eos; media placeholders and markers"
    chat_template_required: bool = False
    deepstack: bool = False
    video_layout: VideoLayout = "clip"
    tool_parser: str = "qwen"

    def load_class(self) -> type[PreTrainedModel]:
        """The transformers class (an ``ImportError`` names the version when this transformers lacks it)."""
        cls: type[PreTrainedModel] | None = getattr(transformers, self.model_class, None)
        if cls is None:
            raise ImportError(
                f"transformers {transformers.__version__} has no {self.model_class} (family {self.name}); "
                "upgrade transformers"
            )
        return cls


_VL_KEYS: tuple[tuple[str, str], ...] = (
    ("image", "image_token_id"),
    ("video", "video_token_id"),
    ("vision_start", "vision_start_token_id"),
    ("vision_end", "vision_end_token_id"),
)
_OMNI_KEYS: tuple[tuple[str, str], ...] = (
    ("image", "image_token_id"),
    ("video", "video_token_id"),
    ("audio", "audio_token_id"),
    ("vision_start", "vision_start_token_id"),
    ("vision_end", "vision_end_token_id"),
    ("audio_start", "audio_start_token_id"),
    ("audio_end", "audio_end_token_id"),
)

_ALL: tuple[ModelFamily, ...] = (
    ModelFamily("qwen2", "Qwen2ForCausalLM", ("text",), "1d"),
    ModelFamily("qwen3", "Qwen3ForCausalLM", ("text",), "1d"),
    ModelFamily("llama", "LlamaForCausalLM", ("text",), "1d"),  # Llama 2/3, SmolLM / SmolLM2
    ModelFamily("qwen2.5-vl", "Qwen2_5_VLForConditionalGeneration", ("text", "image", "video"), "vl-mrope", _VL_KEYS),
    ModelFamily(
        "qwen3-vl",
        "Qwen3VLForConditionalGeneration",
        ("text", "image", "video"),
        "vl3-mrope",
        _VL_KEYS,
        deepstack=True,
        video_layout="timestamped_frames",
    ),
    ModelFamily(
        "qwen2.5-omni-thinker",
        "Qwen2_5OmniThinkerForConditionalGeneration",
        ("text", "image", "video", "audio"),
        "omni-mrope",
        _OMNI_KEYS,
    ),
)

# ``dir`` lists transformers' lazy names without importing their modules (``hasattr`` would import every family's
# modeling code, and with it torch.distributed and sympy, in each process that only unpickles a prompt).
_EXPORTED = frozenset(dir(transformers))
FAMILIES: dict[str, ModelFamily] = {f.model_class: f for f in _ALL if f.model_class in _EXPORTED}
"""Architecture name (``config.json`` ``architectures[0]``) → family; Qwen2.5 checkpoints are ``Qwen2ForCausalLM``.
Families whose class the installed transformers lacks are left out."""


@dataclass(frozen=True)
class Container:
    """A published architecture that holds a family's model as one part (with parts relax does not train).

    Attributes:
        part: The architecture of the part relax trains (a :data:`FAMILIES` key); its transformers class loads
            it from the container's folder, reading the sub-config and the weights under its prefix.
        config_key: The container config's attribute holding the part's config.
        other_parts: What the container also holds, which relax neither loads nor trains (named in the docs).
    """

    part: str
    config_key: str
    other_parts: str


_OMNI_CONTAINER = Container(
    "Qwen2_5OmniThinkerForConditionalGeneration", "thinker_config", "the talker and token2wav (speech output)"
)
CONTAINERS: dict[str, Container] = {
    "Qwen2_5OmniModel": _OMNI_CONTAINER,  # the published Qwen2.5-Omni-3B / 7B config.json
    "Qwen2_5OmniForConditionalGeneration": _OMNI_CONTAINER,  # what transformers writes for the full model
}
"""Architecture of a whole published model → the part relax trains. A folder of such a model is trained as its
part (the thinker of Qwen2.5-Omni: text out from text, image, audio and video in); the other parts' weights are
not loaded, and exported checkpoints are the part's own."""


def family_of_config(config: object) -> ModelFamily | None:
    """The family of a loaded model config, by its ``architectures`` entry; None when it names none (a part's
    sub-config, such as the omni container's thinker config) or one outside the table."""
    names = getattr(config, "architectures", None) or []
    if not names:
        return None
    name = str(names[0])
    return FAMILIES.get(CONTAINERS[name].part if name in CONTAINERS else name)


def family_of_model(model: object) -> ModelFamily:
    """The family of a loaded model, by its class (a critic's thinker included)."""
    return family_of(type(model).__name__, where=f"model class {type(model).__module__}.{type(model).__name__}")


# Not in the table yet, with the reason (named in the error):
_NOT_YET: dict[str, str] = {}


class UnsupportedArchitectureError(ValueError):
    """A checkpoint's architecture is not in :data:`FAMILIES`."""


def family_of(architecture: str, where: str = "") -> ModelFamily:
    """The family of an architecture name.

    Raises:
        UnsupportedArchitectureError: naming the architecture, ``where`` it came from and the supported list.
    """
    if architecture in CONTAINERS:
        architecture = CONTAINERS[architecture].part
    try:
        return FAMILIES[architecture]
    except KeyError:
        at = f" ({where})" if where else ""
        why = f" ({_NOT_YET[architecture]})" if architecture in _NOT_YET else ""
        raise UnsupportedArchitectureError(
            f"unsupported architecture {architecture!r}{at}{why}; supported: {', '.join(sorted(FAMILIES))}"
        ) from None
