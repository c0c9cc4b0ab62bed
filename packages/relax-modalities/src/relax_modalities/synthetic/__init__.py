"""Synthetic omni tasks: real media files plus a JSONL manifest, verifiable rewards and chance levels.

`write_synthetic_tasks` writes image (which colour), audio (which pitch), video (which way a 28-px
square moves), text (single-digit addition) and audio+video (direction and pitch) items;
`read_manifest` reads them back as `TaskItem`s; `reward` grades a response by exact match.
"""

from relax_modalities.synthetic._manifest import (
    MediaKind,
    MediaRef,
    TaskItem,
    iter_manifest,
    read_manifest,
    write_manifest,
)
from relax_modalities.synthetic._rewards import REWARD_FNS, RewardFn, chance_level, exact_match_reward, reward
from relax_modalities.synthetic._tasks import TASKS, write_mp4, write_synthetic_tasks

__all__ = [  # generation
    "TASKS",
    "write_mp4",
    "write_synthetic_tasks",
]
__all__ += [  # manifest
    "MediaKind",
    "MediaRef",
    "TaskItem",
    "iter_manifest",
    "read_manifest",
    "write_manifest",
]
__all__ += [  # rewards
    "REWARD_FNS",
    "RewardFn",
    "chance_level",
    "exact_match_reward",
    "reward",
]
