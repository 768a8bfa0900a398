"""The interface every launcher's environment implements: who am I, as the launcher says."""
from __future__ import annotations

from typing import ClassVar, Mapping, Optional


class LauncherEnvironmentError(RuntimeError):
    """The launcher's variables are malformed, or disagree with what Horovod reports."""


class ClusterEnvironment:
    """What one launcher's environment variables say about this process.

    Subclasses only read variables. A value the launcher does not publish is None: it is
    then taken from Horovod after init, not guessed.
    """

    name: ClassVar[str] = "unknown"
    hint: ClassVar[str] = ""  # what to check when this launcher's view disagrees with Horovod's

    def __init__(self, env: Mapping[str, str]) -> None:
        self.env = env

    @classmethod
    def detect(cls, env: Mapping[str, str]) -> bool:
        raise NotImplementedError

    def world_size(self) -> Optional[int]:
        return None

    def global_rank(self) -> Optional[int]:
        return None

    def local_rank(self) -> Optional[int]:
        return None

    def local_size(self) -> Optional[int]:
        return None

    def node_rank(self) -> Optional[int]:
        return None

    def _int(self, *names: str) -> Optional[int]:
        """The first of ``names`` that is set, as a whole number >= 0 (or None if none is set)."""
        for name in names:
            raw = self.env.get(name)
            if raw is None:
                continue
            try:
                value = int(raw)
            except ValueError:
                raise LauncherEnvironmentError(
                    f"{self.name}: {name}={raw!r} is not a whole number. HINT: the variable was "
                    f"overwritten by a job script or a module; unset it and launch again"
                ) from None
            if value < 0:
                raise LauncherEnvironmentError(f"{self.name}: {name}={raw!r} is negative")
            return value
        return None

    def describe(self) -> str:
        values = {
            "rank": self.global_rank(), "size": self.world_size(),
            "local_rank": self.local_rank(), "local_size": self.local_size(),
        }
        known = ", ".join(f"{k}={v}" for k, v in values.items() if v is not None)
        return f"{self.name} ({known})" if known else self.name
