"""What a trainer imports: the client, advantages, and the run-log export. Nothing of the server.

Installs with httpx, pydantic and numpy only (`pip install rollout-service`); the server needs
the `server` extra.
"""

from ..advantages import group_advantages
from ..protocol import Attempt, GroupRequest, GroupResult, PolicyState, PolicyUpdateResult, Segment, Turn
from .client import (
    AsyncRolloutClient,
    BatchItem,
    GroupFailed,
    RequestRejected,
    RolloutClient,
    RolloutError,
    Sampled,
    ServiceBusy,
    ServiceStarting,
    ServiceUnavailable,
    StreamCut,
)
from .sharded import AsyncShardedClient, ShardedClient
from .trajectory import NoTrajectory, token_batch, trainable, trl_rollout

__all__ = [
    "AsyncRolloutClient",
    "AsyncShardedClient",
    "Attempt",
    "BatchItem",
    "GroupFailed",
    "GroupRequest",
    "GroupResult",
    "NoTrajectory",
    "PolicyState",
    "PolicyUpdateResult",
    "RequestRejected",
    "RolloutClient",
    "RolloutError",
    "Sampled",
    "ServiceBusy",
    "Segment",
    "ServiceStarting",
    "ServiceUnavailable",
    "ShardedClient",
    "StreamCut",
    "Turn",
    "group_advantages",
    "token_batch",
    "trainable",
    "trl_rollout",
]
