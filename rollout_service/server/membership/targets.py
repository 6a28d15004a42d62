"""What a group runs against: its task's envs (`TaskTarget`, each env an `EnvHandle`) and the model
route that answers its turns (`ModelRoute`). The env registry and the replica registry build them;
the runner reads them, and carries them with the group's request as one `GroupRun`."""

from __future__ import annotations

from dataclasses import dataclass, field

from ...backends.env_client import EnvClient
from ...backends.replica_pool import ReplicaPool
from ...backends.template_renderer import TemplateRenderer
from ...protocol import EnvContract, GroupRequest
from .world_scheduler import EnvSlots


@dataclass
class ModelRoute:
    """Who answers a stage: a model (as results name it) on a chat client."""

    model: str
    client: ReplicaPool
    served_model: str | None = None  # the name the server knows it by, when it differs
    renderer: TemplateRenderer | None = field(init=False, default=None)

    def __post_init__(self) -> None:
        if self.client.token_ids:  # a server that returns token ids may take token prompts too
            self.renderer = TemplateRenderer(self.client, self.request_model)

    @property
    def request_model(self) -> str:
        return self.served_model or self.model


@dataclass
class EnvHandle:
    url: str
    client: EnvClient
    slots: EnvSlots
    contract: EnvContract


@dataclass
class TaskTarget:
    """A task and the envs that serve it now (all with the same dataset fingerprint): the service
    adds and removes envs here as they come and go, and each try asks it afresh."""

    task_id: str
    slug: str
    envs: list[EnvHandle]
    contract: EnvContract = field(init=False)  # the dataset and reward every env of it shares

    def __post_init__(self) -> None:
        self.contract = self.envs[0].contract

    def env(self, url: str) -> EnvHandle:
        return next(e for e in self.envs if e.url == url)

    def candidates(self, include_eval: bool) -> list[str]:
        return [e.url for e in self.envs if include_eval or e.contract.side != "eval"]

    def drained(self, include_eval: bool) -> bool:
        """Whether every env of `candidates` drains: none starts an episode of it (true of none at all)."""
        return all(e.slots.draining for e in self.envs if include_eval or e.contract.side != "eval")


@dataclass(frozen=True)
class GroupRun:
    """A group as its attempts and its result see it. `sequence` orders the group's claims on worlds;
    `share` names the request it came with (concurrent requests get fair shares of the pools)."""

    request: GroupRequest
    target: TaskTarget
    route: ModelRoute  # the group's policy route
    group_id: str
    sequence: int
    share: object
