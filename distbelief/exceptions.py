"""Exceptions raised by distbelief. All are plain classes so they survive pickling across processes."""


class DistBeliefError(Exception):
    """Base class for errors raised by distbelief."""


class ConfigError(DistBeliefError, ValueError):
    """A configuration value is invalid. The message names the field and how to fix it."""

    def __init__(self, field: str, message: str):
        self.field = field
        super().__init__(f"{field}: {message}")

    def __reduce__(self):
        return (type(self), (self.field, str(self).split(": ", 1)[1]))


class RemoteTimeoutError(DistBeliefError, TimeoutError):
    """A remote role did not answer in time. The message names the role and the setting to change."""


class RoleFailedError(DistBeliefError):
    """A remote role (shard, replica) died or raised; carries the role's name."""


class ClusterUnreachableError(DistBeliefError, ConnectionError):
    """The Ray cluster named by --address could not be reached."""


class ReplicaKilled(RuntimeError):
    """Raised inside a replica (or partition) whose death was injected in process (tests' fault injection)."""


class DivergedError(DistBeliefError):
    """Training diverged: the loss became non-finite or exploded. The message names ``--lr`` and a lower rate."""
