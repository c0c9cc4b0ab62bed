"""The modality seam on the model side: what one modality owns between a prompt's tensors and the model.

A `ModelModality` owns its forward kwargs in a prompt (`ModelModality.fields`, checked by
`ModelModality.validate`), how many placeholder tokens they need (`ModelModality.check_placeholders`), how
several prompts' tensors are collated into a batch (`ModelModality.collate`), its encoder call
(`ModelModality.encode`: one feature row per placeholder token), and its part in the position rule: the shapes
positions depend on (`ModelModality.structure`, the cache key) and the arguments it gives the family's
``get_rope_index`` (`ModelModality.rope_args`, and its number in the Qwen-VL rule's token types,
`ModelModality.vl_token_type`). Its placeholder id is the model config's `ModelModality.token_attr` (and the
checkpoint's ``TokenIds`` role of the same name as the modality). It also reads its data path's settings from a
checkpoint folder (`ModelModality.processor_settings`: the model config and its processor config,
``Checkpoint.preprocessor_for``: ``video_preprocessor_config.json`` for video where the folder has one, else
``preprocessor_config.json``).

`MODEL_MODALITIES` is the explicit registry, in the order the forward kwargs are laid out. Adding a modality is
one module with its `ModelModality` plus one entry here; its data path is relax-modalities' `ModalityPath`.
"""

from __future__ import annotations

from collections.abc import Callable, Hashable, Mapping, Sequence
from typing import TYPE_CHECKING, Any, Protocol, cast

import torch

if TYPE_CHECKING:
    from relax_modalities import ImageSettings, VideoSettings

__all__ = [
    "AUDIO",
    "IMAGE",
    "MODEL_MODALITIES",
    "VIDEO",
    "AudioModality",
    "ModelModality",
    "VisionModality",
    "audio_token_count",
    "image_settings",
    "media_fields",
    "video_settings",
]


class ModelModality(Protocol):
    """What one modality owns between a prompt's tensors and the model.

    Attributes:
        name: The modality's name (its placeholder role in ``TokenIds.placeholders``).
        fields: The forward kwargs it owns in a prompt, in collation order.
        encoder_fields: The fields its encoder reads: two prompts whose values of these are equal share one
            encoding (the rest, such as seconds per video grid, only matter to positions).
        token_attr: The model-config attribute holding its placeholder id.
        position_fields: The fields only the position rule reads (seconds per video grid): the model's forward is
            always given positions, so they are not passed to it.
        vl_token_type: Its tokens' number in the ``mm_token_type_ids`` the Qwen-VL families' rope rule takes
            (0: positioned as text; image 1, video 2).
    """

    name: str
    fields: tuple[str, ...]
    encoder_fields: tuple[str, ...]
    position_fields: tuple[str, ...]
    token_attr: str
    vl_token_type: int

    def processor_settings(self, config: object, preprocessor: Mapping[str, object]) -> object | None:
        """Its data path's settings for a checkpoint (of the type of relax-modalities'
        ``ModalityPath.default_settings``), from the model ``config`` and its processor config (``preprocessor``:
        ``Checkpoint.preprocessor_for`` this modality); None: the path's defaults."""
        ...

    def validate(self, media: Mapping[str, torch.Tensor]) -> None:
        """Checks one prompt's tensors of this modality (some of `fields`, at least one).

        Raises:
            ValueError: naming the modality and what is inconsistent.
        """
        ...

    def check_placeholders(self, n_tokens: int, media: Mapping[str, torch.Tensor]) -> None:
        """Checks ``n_tokens`` placeholder tokens against one prompt's tensors of this modality (maybe none).

        Raises:
            ValueError: naming the modality and the counts.
        """
        ...

    def num_items(self, media: Mapping[str, torch.Tensor]) -> int:
        """Items (images, clips, ...) in one prompt's tensors of this modality."""
        ...

    def collate(self, parts: Sequence[Mapping[str, torch.Tensor]]) -> dict[str, torch.Tensor]:
        """The batch's kwargs from the prompts that have this modality, in batch order (at least one)."""
        ...

    def encode(self, model: object, media: Mapping[str, torch.Tensor]) -> Sequence[torch.Tensor]:
        """Features ``[tokens_i, H]`` of each collated item, in order, from one encoder call of ``model``."""
        ...

    def structure(self, media: Mapping[str, torch.Tensor]) -> Hashable:
        """What positions depend on in one prompt's tensors of this modality (shapes, never values)."""
        ...

    def rope_args(self, positions: str, media: Mapping[str, torch.Tensor]) -> dict[str, object]:
        """Keyword arguments of the family's ``get_rope_index`` (``positions`` is the family's rule,
        ``"vl-mrope"``, ``"vl3-mrope"`` or ``"omni-mrope"``) from a batch's collated media; ``{}`` when its tokens
        are positioned as text (one index each)."""
        ...


def audio_token_count(num_frames: int) -> int:
    """Audio placeholder tokens for ``num_frames`` log-mel frames (two stride-2 stages of the encoder)."""
    return ((num_frames - 1) // 2 + 1 - 2) // 2 + 1


def _flat(x: torch.Tensor | None) -> tuple[float, ...] | None:
    return None if x is None else tuple(x.flatten().tolist())


class VisionModality:
    """Image or video: flattened patches ``[P, C·t·p·p]`` with one ``(t, h, w)`` grid per item; the vision tower
    merges ``spatial_merge_size²`` patches into one token (the model checks the exact count).

    Args:
        name: ``"image"`` or ``"video"``.
        pixels: The patches' kwarg.
        grid: The grids' kwarg.
        seconds: The seconds-per-temporal-grid kwarg (video), ``None`` for images.
        token_attr: The model-config attribute of the placeholder id.
        encoder: The model's encoder method (``get_image_features`` / ``get_video_features``).
        vl_token_type: Its number in the Qwen-VL rope rule's token types.
        settings: Its data path's settings from a checkpoint's model config and preprocessor config.
        rope_seconds: Name of the seconds argument of ``get_rope_index`` per position rule.
    """

    def __init__(
        self,
        name: str,
        pixels: str,
        grid: str,
        seconds: str | None,
        token_attr: str,
        encoder: str,
        vl_token_type: int,
        settings: Callable[[object, Mapping[str, object]], object],
        rope_seconds: Mapping[str, str] | None = None,
    ) -> None:
        self.name, self.pixels, self.grid, self.seconds = name, pixels, grid, seconds
        self.fields: tuple[str, ...] = (pixels, grid) + ((seconds,) if seconds else ())
        self.encoder_fields: tuple[str, ...] = (pixels, grid)
        self.position_fields: tuple[str, ...] = (seconds,) if seconds else ()
        self.token_attr, self.encoder, self.vl_token_type = token_attr, encoder, vl_token_type
        self._settings = settings
        self.rope_seconds = dict(rope_seconds or {})

    def processor_settings(self, config: object, preprocessor: Mapping[str, object]) -> object:
        """The patch geometry of the config's ``vision_config``, the pixel budget and normalisation of the
        preprocessor config (the image processor's defaults where a key is absent)."""
        return self._settings(config, preprocessor)

    def validate(self, media: Mapping[str, torch.Tensor]) -> None:
        """Pixels and grid both set, their patch counts equal, one seconds value per video."""
        pixels, grid = media.get(self.pixels), media.get(self.grid)
        if (pixels is None) != (grid is None):
            raise ValueError(f"OmniPrompt {self.name}: pixels and grid must both be set")
        if pixels is not None and grid is not None and int(grid.prod(-1).sum()) != pixels.shape[0]:
            raise ValueError(
                f"OmniPrompt {self.name}: {pixels.shape[0]} patches, but grid {grid.tolist()} has "
                f"{int(grid.prod(-1).sum())} patches"
            )
        if self.seconds is not None and grid is not None:
            seconds = media.get(self.seconds)
            if seconds is None or len(seconds) != len(grid):
                raise ValueError(f"OmniPrompt.{self.seconds} must give one value per {self.name}")

    def check_placeholders(self, n_tokens: int, media: Mapping[str, torch.Tensor]) -> None:
        """At least one placeholder exactly when there are pixels."""
        pixels = media.get(self.pixels)
        if (n_tokens == 0) != (pixels is None):
            raise ValueError(
                f"OmniPrompt has {n_tokens} {self.name} placeholder tokens; "
                f"{'pixels and grid must both be set' if pixels is None else 'but has ' + self.name + ' pixels'}"
            )

    def num_items(self, media: Mapping[str, torch.Tensor]) -> int:
        """One item per grid row."""
        return len(media[self.grid])

    def collate(self, parts: Sequence[Mapping[str, torch.Tensor]]) -> dict[str, torch.Tensor]:
        """Every field concatenated in batch order (the model scatters features in that order)."""
        out: dict[str, torch.Tensor] = {}
        for name in self.fields:
            values = [p[name] for p in parts if name in p]
            if values:
                out[name] = torch.cat(values, dim=0)
        return out

    def encode(self, model: object, media: Mapping[str, torch.Tensor]) -> Sequence[torch.Tensor]:
        """The vision tower's merged features, split per item."""
        return self.encode_layers(model, media)[0]

    def encode_layers(
        self, model: object, media: Mapping[str, torch.Tensor]
    ) -> tuple[Sequence[torch.Tensor], list[Sequence[torch.Tensor]]]:
        """The merged features split per item, and (a DeepStack tower's, :mod:`~relax_services.models.deepstack`)
        each inner layer's features split per item; that list is empty for a tower without DeepStack."""
        encoded = getattr(model, self.encoder)(media[self.pixels], media[self.grid])
        per_item: Sequence[torch.Tensor] = encoded.pooler_output
        deep = encoded.get("deepstack_features")  # a ModelOutput: keys only for the fields the tower set
        return per_item, list(deep) if deep is not None else []

    def structure(self, media: Mapping[str, torch.Tensor]) -> Hashable:
        """The grids (and seconds per grid): positions depend on them only."""
        seconds = _flat(media.get(self.seconds)) if self.seconds else None
        return (_flat(media.get(self.grid)), seconds)

    def rope_args(self, positions: str, media: Mapping[str, torch.Tensor]) -> dict[str, object]:
        """The grids, and the seconds per grid under the family's argument name (Qwen3-VL's rule takes none:
        its frames' times are text tokens of the prompt)."""
        args: dict[str, object] = {self.grid: media.get(self.grid)}
        if self.seconds is not None and positions in self.rope_seconds:
            args[self.rope_seconds[positions]] = media.get(self.seconds)
        return args


class AudioModality:
    """Audio: log-mel features ``[n_aud, n_mels, L]`` with their frame mask; the encoder's two stride-2 stages
    give `audio_token_count` tokens per clip."""

    name: str = "audio"
    fields: tuple[str, ...] = ("input_features", "feature_attention_mask")
    encoder_fields: tuple[str, ...] = ("input_features", "feature_attention_mask")
    position_fields: tuple[str, ...] = ()
    token_attr: str = "audio_token_id"
    vl_token_type: int = 0  # the VL families have no audio

    def processor_settings(self, config: object, preprocessor: Mapping[str, object]) -> object:
        """The mel bins of the config's ``audio_config``, the sampling rate and framing of the preprocessor
        config (the feature extractor's defaults where a key is absent)."""
        from relax_modalities import AudioSettings  # lazily: unpickling a prompt must not load the media stack

        sound = AudioSettings()
        mels = getattr(getattr(config, "audio_config", None), "num_mel_bins", None)
        return AudioSettings(
            sampling_rate=_int(preprocessor, "sampling_rate", sound.sampling_rate),
            n_fft=_int(preprocessor, "n_fft", sound.n_fft),
            hop_length=_int(preprocessor, "hop_length", sound.hop_length),
            num_mel_bins=int(mels) if mels is not None else _int(preprocessor, "feature_size", sound.num_mel_bins),
        )

    def validate(self, media: Mapping[str, torch.Tensor]) -> None:
        """Features ``[n_aud, n_mels, L]`` come with a mask."""
        feats = media.get("input_features")
        if feats is not None and (media.get("feature_attention_mask") is None or feats.ndim != 3):
            raise ValueError("OmniPrompt.input_features must be [n_aud, n_mels, L] with a feature_attention_mask")

    def check_placeholders(self, n_tokens: int, media: Mapping[str, torch.Tensor]) -> None:
        """Exactly the encoder's output length."""
        mask = media.get("feature_attention_mask")
        if media.get("input_features") is None or mask is None:
            if n_tokens:
                raise ValueError(f"OmniPrompt has {n_tokens} audio placeholder tokens but no input_features")
            return
        expected = sum(audio_token_count(int(n)) for n in mask.sum(-1))
        if expected != n_tokens:
            raise ValueError(f"OmniPrompt has {n_tokens} audio placeholder tokens but its features need {expected}")

    def num_items(self, media: Mapping[str, torch.Tensor]) -> int:
        """One item per mask row."""
        return len(media["feature_attention_mask"])

    def collate(self, parts: Sequence[Mapping[str, torch.Tensor]]) -> dict[str, torch.Tensor]:
        """Clips padded to the longest with their masks."""
        feats = [p["input_features"] for p in parts if "input_features" in p]
        masks = [p["feature_attention_mask"] for p in parts if "feature_attention_mask" in p]
        if not feats:
            return {}
        length = max(f.shape[-1] for f in feats)
        return {
            "input_features": torch.cat(
                [torch.nn.functional.pad(f, (0, length - f.shape[-1])) for f in feats], dim=0
            ),  # [n_aud, n_mels, L_max]
            "feature_attention_mask": torch.cat(
                [torch.nn.functional.pad(m.long(), (0, length - m.shape[-1])) for m in masks], dim=0
            ),  # [n_aud, L_max]
        }

    def encode(self, model: object, media: Mapping[str, torch.Tensor]) -> Sequence[torch.Tensor]:
        """The audio tower's output, split per clip by its token count."""
        mask = media["feature_attention_mask"]
        tower = cast(Any, model).get_audio_features  # the family's method; models are typed loosely by transformers
        flat = tower(media["input_features"], feature_attention_mask=mask).last_hidden_state
        return torch.split(flat, [audio_token_count(int(n)) for n in mask.sum(-1)])

    def structure(self, media: Mapping[str, torch.Tensor]) -> Hashable:
        """The clips' lengths."""
        mask = media.get("feature_attention_mask")
        return None if mask is None else tuple(mask.sum(-1).tolist())

    def rope_args(self, positions: str, media: Mapping[str, torch.Tensor]) -> dict[str, object]:
        """The clips' lengths (the omni rope only; the VL families have no audio)."""
        if positions != "omni-mrope":
            return {}
        mask = media.get("feature_attention_mask")
        return {"audio_seqlens": mask.sum(-1) if mask is not None else None}


def _int(pre: Mapping[str, object], key: str, default: int) -> int:
    value = pre.get(key, default)
    if not isinstance(value, int | float | str):
        raise ValueError(f"preprocessor_config.json: {key!r} must be a number, got {value!r}")
    return int(value)


def _rgb(pre: Mapping[str, object], key: str, default: tuple[float, float, float]) -> tuple[float, float, float]:
    value = pre.get(key, default)
    if not isinstance(value, list | tuple) or len(value) != 3:
        raise ValueError(f"preprocessor_config.json: {key!r} must be 3 numbers (R, G, B), got {value!r}")
    return float(value[0]), float(value[1]), float(value[2])


def image_settings(config: object, pre: Mapping[str, object]) -> ImageSettings:
    """relax-modalities' image settings of a checkpoint: the vision tower's patch geometry (``vision_config``), the
    pixel budget and normalisation of ``preprocessor_config.json`` (the image processor's defaults elsewhere).

    The pixel budget is read as transformers' Qwen-VL image processors read it: ``min_pixels`` / ``max_pixels``
    where given, else ``size``'s ``shortest_edge`` / ``longest_edge`` (the key Qwen3-VL's processors ship)."""
    from relax_modalities import ImageSettings  # lazily: unpickling a prompt must not load the media stack

    vision, image = getattr(config, "vision_config", None), ImageSettings()
    size = pre.get("size")
    edges: Mapping[str, object] = size if isinstance(size, Mapping) else {}

    def geometry(attr: str, key: str | None, default: int) -> int:
        own = getattr(vision, attr, None)
        return int(own) if own is not None else (_int(pre, key, default) if key else default)

    return ImageSettings(
        patch_size=geometry("patch_size", "patch_size", image.patch_size),
        merge_size=geometry("spatial_merge_size", "merge_size", image.merge_size),
        temporal_patch_size=geometry("temporal_patch_size", None, image.temporal_patch_size),
        min_pixels=_int(pre, "min_pixels", _int(edges, "shortest_edge", image.min_pixels)),
        max_pixels=_int(pre, "max_pixels", _int(edges, "longest_edge", image.max_pixels)),
        image_mean=_rgb(pre, "image_mean", image.image_mean),
        image_std=_rgb(pre, "image_std", image.image_std),
    )


def _float(pre: Mapping[str, object], key: str, default: float) -> float:
    value = pre.get(key, default)
    if value is None:
        return default
    try:
        if isinstance(value, bool) or not isinstance(value, int | float | str):
            raise ValueError
        return float(value)
    except ValueError:
        raise ValueError(f"video processor config: {key!r} must be a number, got {value!r}") from None


def video_settings(config: object, pre: Mapping[str, object]) -> VideoSettings:
    """relax-modalities' video settings of a checkpoint: frames share the images' patch geometry and the
    normalisation of ``pre`` (the checkpoint's video processor config, :meth:`Checkpoint.preprocessor_for`).

    A family whose video layout is ``"timestamped_frames"`` (:attr:`ModelFamily.video_layout`, Qwen3-VL) also takes
    its video processor's sampling and budget from ``pre`` as transformers' ``Qwen3VLVideoProcessor`` reads them
    (its class defaults where a key is absent): ``fps`` (2), ``min_frames`` (4), ``max_frames`` (768), ``size``'s
    ``shortest_edge`` / ``longest_edge`` as the clip's pixel bounds (131072 / 786432), ``cap_pixels_per_frame``
    (off) and ``max_video_tokens`` (768). The clip-layout families keep relax's video defaults.

    Raises:
        ValueError: naming the key whose value is not a number, or a sampling the data path does not reproduce (a
            fixed ``num_frames``, ``do_sample_frames`` false).
    """
    from relax_modalities import VideoSettings  # lazily: unpickling a prompt must not load the media stack
    from relax_services.models.families import family_of_config

    vision = image_settings(config, pre)
    family = family_of_config(config)
    if family is None or family.video_layout != "timestamped_frames":
        return VideoSettings(vision=vision)
    refused = {
        "num_frames": pre.get("num_frames") is not None,
        "do_sample_frames": pre.get("do_sample_frames") is False,
    }
    for key in (k for k, bad in refused.items() if bad):
        raise ValueError(
            f"video processor config: {key}={pre[key]!r} is not supported (relax samples frames by fps within "
            "min_frames .. max_frames); remove the key"
        )
    size = pre.get("size")
    edges: Mapping[str, object] = size if isinstance(size, Mapping) else {}
    defaults = VideoSettings()
    return VideoSettings(
        fps=_float(pre, "fps", 2.0),
        min_frames=_int(pre, "min_frames", 4),
        max_frames=_int(pre, "max_frames", 768),
        min_pixels=_int(pre, "min_pixels", _int(edges, "shortest_edge", 128 * 32 * 32)),
        max_pixels=_int(pre, "max_pixels", _int(edges, "longest_edge", 32 * 32 * 768)),
        max_tokens=max(
            defaults.max_tokens, _int(pre, "max_pixels", _int(edges, "longest_edge", 0)) // vision.factor**2
        ),
        vision=vision,
        layout="timestamped_frames",
        cap_pixels_per_frame=bool(pre.get("cap_pixels_per_frame") or False),
        max_frame_tokens=_int(pre, "max_video_tokens", 768),
    )


IMAGE = VisionModality(
    "image", "pixel_values", "image_grid_thw", None, "image_token_id", "get_image_features", 1, image_settings
)
VIDEO = VisionModality(
    "video",
    "pixel_values_videos",
    "video_grid_thw",
    "video_second_per_grid",
    "video_token_id",
    "get_video_features",
    2,
    video_settings,
    rope_seconds={"omni-mrope": "second_per_grids", "vl-mrope": "second_per_grid_ts"},
)
AUDIO = AudioModality()

MODEL_MODALITIES: dict[str, ModelModality] = {
    "image": IMAGE,
    "video": VIDEO,
    "audio": AUDIO,
}
"""Modality name → its model side, in the order of the forward kwargs. One entry per modality."""


def media_fields() -> tuple[str, ...]:
    """Every registered modality's fields, in registry order (the media kwargs an `OmniPrompt` may hold)."""
    return tuple(f for m in MODEL_MODALITIES.values() for f in m.fields)
