"""The interface every launcher's environment implements: who am I, as the launcher says."""
from __future__ import annotations

from typing import ClassVar, Mapping, Optional, Tuple

from hvdtrain.common.errors import HvdtrainError


class LauncherEnvironmentError(HvdtrainError, RuntimeError):
    """The launcher's variables are malformed, or disagree with what Horovod reports."""


class ClusterEnvironment:
    """What one launcher's environment variables say about this process.

    Subclasses only read variables: they name them in the ``*_VARS`` tuples (the first one set
    wins). A value the launcher does not publish is None: it is then taken from Horovod after
    init, not guessed.
    """

    name: ClassVar[str] = "unknown"
    hint: ClassVar[str] = ""  # what to check when this launcher's view disagrees with Horovod's
    RANK_VARS: ClassVar[Tuple[str, ...]] = ()
    SIZE_VARS: ClassVar[Tuple[str, ...]] = ()
    LOCAL_RANK_VARS: ClassVar[Tuple[str, ...]] = ()
    LOCAL_SIZE_VARS: ClassVar[Tuple[str, ...]] = ()
    NODE_RANK_VARS: ClassVar[Tuple[str, ...]] = ()

    def __init__(self, env: Mapping[str, str]) -> None:
        self.env = env

    @classmethod
    def detect(cls, env: Mapping[str, str]) -> bool:
        raise NotImplementedError

    def world_size(self) -> Optional[int]:
        return self._int(*self.SIZE_VARS)

    def global_rank(self) -> Optional[int]:
        return self._int(*self.RANK_VARS)

    def local_rank(self) -> Optional[int]:
        return self._int(*self.LOCAL_RANK_VARS)

    def local_size(self) -> Optional[int]:
        return self._int(*self.LOCAL_SIZE_VARS)

    def node_rank(self) -> Optional[int]:
        return self._int(*self.NODE_RANK_VARS)

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
