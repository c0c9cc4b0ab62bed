"""``relax bench parallel``: the predictions it prints beside its measurements, and (slow) one measured layout."""

from __future__ import annotations

import argparse

import pytest

from relax_services.bench.parallel import LAYOUTS, SAMPLES, layout_config, media_prompt, predict, run


def test_every_layout_is_a_two_rank_mesh_the_group_executes() -> None:
    for name in LAYOUTS:
        cfg = layout_config(name)
        assert cfg.world_size == 2 and cfg.pp == cfg.ep == 1


def test_the_predictions_follow_the_split() -> None:
    """At 8,192 tokens the activations dominate: dp = 2 gives each rank a whole sequence, sp = 2 half of each of
    the two (the same tokens per rank, the attention's quadratic part halved), tp = 2 half of each layer's width;
    a longer sequence costs every layout more."""
    dp, sp, tp = (predict(name, 8192)[0] for name in ("dp2", "sp2", "tp2"))
    assert sp < dp and tp < dp
    assert predict("sp2", 16384)[0] > sp
    assert SAMPLES == 2  # one sequence per data-parallel rank at dp = 2


def test_media_workloads_are_the_sizes_they_name() -> None:
    """Image: 8 images of 224 px, 16 × 16 patches of 14 px, 64 tokens each after the 2 × 2 merge, each between its
    vision markers; video: 32 frames of 112 px, 16 temporal patches of 8 × 8, 256 tokens; then 32 text tokens. The
    planner's predictions for them are positive and sp = 2 holds less than dp = 2 of the video's long sequence."""
    import torch

    image = media_prompt("image", torch.Generator().manual_seed(0))
    assert image.num_tokens == 8 * (64 + 2) + 32 and tuple(image.media()["image_grid_thw"].shape) == (8, 3)
    video = media_prompt("video", torch.Generator().manual_seed(0))
    assert video.num_tokens == 256 + 2 + 32 and video.media()["video_grid_thw"].tolist() == [[16, 8, 8]]
    for kind in ("image", "video"):
        assert all(x > 0 for name in LAYOUTS for x in predict(name, 0, kind))
    assert predict("sp2", 0, "video")[0] < predict("dp2", 0, "video")[0]
    with pytest.raises(ValueError, match="image or video"):
        media_prompt("text", torch.Generator())


@pytest.mark.slow  # a group of two spawned ranks imports the model stack: ~1 min on 2 loaded cores
@pytest.mark.timeout(600)
def test_a_measured_layout_reports_positive_figures_beside_the_prediction(capsys: pytest.CaptureFixture[str]) -> None:
    rows = run(argparse.Namespace(tokens=256, updates=1, layouts=["sp2"], json=None))
    printed = capsys.readouterr().out
    assert len(rows) == 1 and rows[0].layout == "sp2"
    assert rows[0].s_per_update > 0 and rows[0].predicted_s > 0 and rows[0].predicted_mib > 0
    assert printed.splitlines()[-1].startswith("sp2 ")
