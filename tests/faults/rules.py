"""Which file calls a hung mount stops: the operations it knows, their aliases, and one rule.

Shared by both sides of the mount: the test process checks a rule when it is made (a misspelt
operation fails there, not as a call that never blocks), the server process applies it to each call.
"""
import fnmatch
from dataclasses import dataclass
from typing import Iterable, Optional, Tuple, Union

# The calls of libfuse's high-level API that the server answers and can stop, as the kernel sends
# them: a path lookup reaches it as getattr; chmod, chown, truncate and utimens are the parts of
# one setattr. release and releasedir are left out: the kernel sends them after close() returned
# and no one waits for them.
OPERATIONS = frozenset({
    "access", "chmod", "chown", "create", "flush", "fsync", "fsyncdir", "getattr", "link", "mkdir",
    "mknod", "open", "opendir", "read", "readdir", "readlink", "rename", "rmdir", "statfs", "symlink",
    "truncate", "unlink", "utimens", "write",
})

# The names a test may use for what it means: os.utime reaches the server as utimens, os.stat and
# every path walk as getattr.
ALIASES = {
    "utime": ("utimens",),
    "stat": ("getattr",),
    "lookup": ("getattr",),
    "setattr": ("chmod", "chown", "truncate", "utimens"),
}

Names = Union[str, Iterable[str], None]


@dataclass(frozen=True)
class FaultRule:
    """Calls of ``ops`` (None: every operation) on a path one of ``names`` matches (None: every
    path) are stopped once ``after`` such calls went through: they wait until released, or fail
    with ``error`` (an errno) when it is set.

    A name without a slash is matched against the last part of the path (``owner.json``, ``*.pt``);
    one with a slash against the whole path inside the mount (``/ckpt/step-*/*``).
    """
    ops: Optional[Tuple[str, ...]] = None
    names: Optional[Tuple[str, ...]] = None
    after: int = 0
    error: Optional[int] = None

    @classmethod
    def make(cls, ops: Names = None, names: Names = None, after: int = 0,
             error: Optional[int] = None) -> "FaultRule":
        """A rule from what a test says; an unknown operation raises ValueError.

        Args:
            ops: an operation or alias, or several (a set, a list); None: every operation.
            names: a glob or several; None: every path.
            after: how many matching calls go through before the rule stops them.
            error: the errno they fail with; None: they wait until released.
        """
        return cls(ops=None if ops is None else expand_operations(ops),
                   names=None if names is None else _as_tuple(names), after=int(after), error=error)

    def matches(self, op: str, paths: Tuple[str, ...]) -> bool:
        """Whether a call of ``op`` on ``paths`` (two for rename and link) falls under this rule."""
        if self.ops is not None and op not in self.ops:
            return False
        if self.names is None:
            return True
        return any(_name_matches(pattern, path) for pattern in self.names for path in paths)

    def to_message(self) -> dict:
        return {"ops": self.ops, "names": self.names, "after": self.after, "error": self.error}

    @classmethod
    def from_message(cls, message: dict) -> "FaultRule":
        return cls(ops=None if message["ops"] is None else tuple(message["ops"]),
                   names=None if message["names"] is None else tuple(message["names"]),
                   after=message["after"], error=message["error"])


def expand_operations(ops: Names) -> Tuple[str, ...]:
    """The server's operation names for ``ops``, aliases resolved; an unknown name raises."""
    expanded = set()
    for op in _as_tuple(ops):
        if op in ALIASES:
            expanded.update(ALIASES[op])
        elif op in OPERATIONS:
            expanded.add(op)
        else:
            raise ValueError(f"unknown file operation {op!r}: use one of {sorted(OPERATIONS)} "
                             f"or an alias {sorted(ALIASES)}")
    return tuple(sorted(expanded))


def _as_tuple(values: Names) -> Tuple[str, ...]:
    return (values,) if isinstance(values, str) else tuple(values)


def _name_matches(pattern: str, path: str) -> bool:
    subject = path if "/" in pattern else path.rsplit("/", 1)[-1]
    return fnmatch.fnmatchcase(subject, pattern)
