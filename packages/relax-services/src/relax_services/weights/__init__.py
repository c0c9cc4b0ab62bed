"""Policy weights from the trainer to the roles that read them: the versioned weight stores (in-process and Ray),
the bucketed weight stream, and the broadcast store that moves buckets over a collective group.

Only the stores are imported here (no torch): the bucket and broadcast modules are imported where weights move.
"""

from relax_services.weights.stores import (
    InProcessWeightStore,
    PublishStats,
    RayWeightStore,
    WeightPoller,
    WeightStore,
    WeightStoreActor,
    WeightUpdate,
    state_dict_bytes,
)

__all__ = [
    "InProcessWeightStore",
    "PublishStats",
    "RayWeightStore",
    "WeightPoller",
    "WeightStore",
    "WeightStoreActor",
    "WeightUpdate",
    "state_dict_bytes",
]
