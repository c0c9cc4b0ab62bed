"""Synthetic omni tasks: real media files plus a JSONL manifest, verifiable rewards and chance levels.

`write_synthetic_tasks` writes image (which colour), audio (which pitch), video (which way a 28-px
square moves), text (single-digit addition) and audio+video (direction and pitch) items;
`read_manifest` reads them back as `TaskItem`s; `reward` grades a response by exact match.
`write_synthetic_dataset` also writes them as a JSONL in the dataset row schema (read by `build_stream`), and
`write_task_file` one task's items as a file of its own (the default run's per-task files).
"""

from relax_modalities.synthetic._dataset import task_item_row, write_synthetic_dataset, write_task_file
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
__all__ += [  # as a dataset file in the row schema
    "task_item_row",
    "write_synthetic_dataset",
    "write_task_file",
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
