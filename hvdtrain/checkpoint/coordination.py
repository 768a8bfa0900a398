"""Checkpoints across ranks: who reads and writes, and every rank reaching the same outcome.

Rank 0 owns the directory for the run (hvdtrain.checkpoint.ownership), reads the newest valid
checkpoint and checks it belongs to this run (hvdtrain.checkpoint.formats.compatibility). Before any
rank uses it, its files are verified against their checksums: a full one by rank 0 as it reads it,
a sharded one by every rank, each a share of its files (sources.files_to_verify), the outcome
all-gathered. A corrupt one is named on rank 0, set aside (CheckpointStore.set_aside) and the
next older one tried, every rank in step; the load then trusts the checksums checked here. Full format:
rank 0 writes, every rank receives by broadcast. Sharded format: every rank writes and reads its
own file. Either way every rank decides from the same data (rank 0's outcome, broadcast, or every
rank's, all-gathered): all succeed, or all raise the same error. The files themselves are
hvdtrain.checkpoint.formats'; a strategy reads what it keeps of them through a source
(hvdtrain.checkpoint.sources).

train.checkpoint_async: a save copies the state to host memory (hvdtrain.checkpoint.async_writing.snapshot) and
returns; a background thread writes, fsyncs and moves ``latest`` (hvdtrain.checkpoint.async_writing.background).
The next save, and the end of the run, wait for it and agree on its outcome.

Every storage section of a save or resume, on every rank and in the writer thread, runs inside an
activity the stall watchdog sees (hvdtrain.common.io_watch: ``_storage``), from the lease's check
to the prune: a call that hangs on a hung mount ends the job with its STALL line. A save that would
not load back (a value ``weights_only`` refuses) is refused before anything is written
(hvdtrain.checkpoint.formats.loading); while the run owns the directory, each irreversible step of
a save is fenced by its lease (hvdtrain.checkpoint.ownership).
"""
from __future__ import annotations

import contextlib
import threading
from pathlib import Path
from typing import Any, Callable, ContextManager, Dict, Iterator, List, Mapping, Optional

from hvdtrain.distributed import collectives
from hvdtrain.checkpoint.formats import loading, sharded
from hvdtrain.checkpoint import CheckpointError, CorruptCheckpoint
from hvdtrain.checkpoint.sources import sharded as sources
from hvdtrain.checkpoint.async_writing.background import BackgroundWrite
from hvdtrain.checkpoint.formats.compatibility import check_settings
from hvdtrain.checkpoint.ownership import Ownership
from hvdtrain.checkpoint.formats.run_state import RunState
from hvdtrain.checkpoint.async_writing.snapshot import HostSnapshot
from hvdtrain.checkpoint.formats.full import CheckpointStore, unfenced
from hvdtrain.common import io_watch
from hvdtrain.common.units import format_bytes
from hvdtrain.config.train import TrainConfig
from hvdtrain.parallel.topology import Topology
from hvdtrain.strategies.base import Strategy


class Checkpointing:
    """The checkpoints of one run, as seen by every rank of it (the world read from ``topology``
    at each call: under Horovod elastic, whichever rank is 0 now writes)."""

    def __init__(self, config: TrainConfig, topology: Topology, job_config: Mapping[str, Any]) -> None:
        self.config, self.topology, self.job_config = config, topology, job_config
        self.store = CheckpointStore(config.checkpoint_dir, keep=config.keep_checkpoints, log=topology.log)
        self.ownership: Optional[Ownership] = None
        self.background = BackgroundWrite() if config.checkpoint_async else None
        self.snapshot = HostSnapshot()
        self._abandoned = threading.Event()  # set when the run ends with a write in flight
        self._candidate: Optional[Path] = None  # rank 0: the checkpoint _read_newest found
        self._verified: Optional[Path] = None  # the checkpoint whose files' checksums this rank's start agreed on

    def start(self, broadcast: bool) -> Optional[Dict[str, Any]]:
        """Rank 0 claims the directory for this run, removes what killed saves left, and reads the
        newest valid checkpoint (train.resume), which every rank receives by broadcast. A refusal (a
        live owner, a checkpoint of other settings, resume=false over checkpoints) is raised on
        every rank.

        A checkpoint is resumed only once its files match their checksums; a corrupt one is set
        aside and the previous one read (see the module's text). Without ``broadcast`` (Horovod
        elastic set-up, which must run no collective) rank 0 verifies every file alone and only it
        holds the checkpoint, or raises; the elastic sync gives the others rank 0's state instead.
        """
        outcome = attempt(lambda: self._open(verify_shards=not broadcast), self._storage("resume")) \
            if self.topology.is_root else None
        if broadcast:
            outcome = collectives.broadcast_state(outcome, root_rank=0, name="checkpoint")
            outcome = self._verified_by_every_rank(outcome)
        elif self.topology.is_root and isinstance(outcome, dict):
            self._resuming(outcome)
        try:
            if isinstance(outcome, str):
                raise CheckpointError(outcome)
            if outcome is not None:  # every rank alike, before any set-up follows from it
                check_settings(outcome, self.job_config, force=self.config.resume == "force", log=self.topology.log)
        except (CheckpointError, ValueError):
            self.close()  # refused: the directory stays its previous owner's to resume
            raise
        return outcome

    def _open(self, verify_shards: bool) -> Optional[Dict[str, Any]]:
        self._own()
        log = self.topology.log
        removed, freed = self.store.remove_leftovers()
        if removed:
            log.info(f"removed {removed} file(s) ({format_bytes(freed)}) that killed saves left in "
                     f"{self.store.directory}")
        if self.config.resume == "false":
            existing = self.store.steps()
            if existing:
                raise CheckpointError(
                    f"checkpoint_dir {self.store.directory} holds checkpoints already (newest: {existing[0][1].name}) "
                    f"and train.resume=false: this run's checkpoints would be mixed with them. Give this run another "
                    f"checkpoint_dir, move those away, or continue them with train.resume=true")
            return None
        return self._read_newest(verify_shards)

    def _read_newest(self, verify_shards: bool = False) -> Optional[Dict[str, Any]]:
        """Rank 0: the newest valid checkpoint, the corrupt ones newer than it set aside;
        ``verify_shards``: a sharded one's files all checked here (else by every rank, a share each)."""
        newest = self.store.read_newest_valid(set_aside=True, verify_shards=verify_shards)
        if newest is None:
            return None
        self._candidate, found = newest
        return found

    def _resuming(self, found: Dict[str, Any]) -> None:
        """Rank 0, once the checkpoint's files are agreed good: say which it resumes."""
        self.topology.log.info(f"resuming from {self._candidate}")
        self._verified = self._candidate

    def _verified_by_every_rank(self, outcome: Any) -> Any:
        """Every rank, with rank 0's broadcast outcome: a sharded checkpoint's files, each checked by
        one rank; while any is corrupt, rank 0 names it, sets it aside and reads the next older one
        (broadcast, checked alike). Returns the outcome every rank continues with; every rank makes
        the same collectives, each round's outcome being agreed."""
        world = self.topology.world
        while isinstance(outcome, dict) and sharded.is_sharded(outcome):
            path, manifest = Path(outcome["path"]), outcome
            share = sources.files_to_verify(world.size, world.rank, len(manifest["files"]))
            with self._storage("resume"):
                verified = check(lambda: sources.verify(path, manifest, share))
            found = collectives.allgather_object(verified, name="checkpoint.verify")
            failed = [f"rank {rank}: {problem}" for rank, (corrupt, problem) in enumerate(found) if problem and not corrupt]
            if failed:  # not the files' content (a permission, an I/O error): every rank stops, naming it
                return f"the sharded checkpoint {path} cannot be verified: {'; '.join(failed)}"
            corrupt = [problem for is_corrupt, problem in found if is_corrupt]
            if not corrupt:
                self._verified = path
                if world.is_root:
                    self._resuming(outcome)
                return outcome

            def fall_back() -> Optional[Dict[str, Any]]:
                self.store.report_corrupt(path, "; ".join(corrupt), set_aside=True)
                return self._read_newest()
            outcome = attempt(fall_back, self._storage("resume")) if world.is_root else None
            outcome = collectives.broadcast_state(outcome, root_rank=0, name="checkpoint.fallback")
        if world.is_root and isinstance(outcome, dict):
            self._resuming(outcome)
        return outcome

    def read_newest(self) -> Optional[Dict[str, Any]]:
        """Every rank: the newest valid checkpoint of this run (a sharded one's manifest), read by
        rank 0 (which owns the directory from now on) and broadcast; None when there is none yet.
        Under Horovod elastic, what a sharded strategy continues from after a world change."""
        def read() -> Optional[Dict[str, Any]]:
            self._own()
            return self._read_newest()
        outcome = attempt(read, self._storage("resume")) if self.topology.is_root else None
        outcome = collectives.broadcast_state(outcome, root_rank=0, name="checkpoint.newest")
        outcome = self._verified_by_every_rank(outcome)
        if isinstance(outcome, str):
            raise CheckpointError(outcome)
        return outcome

    def _own(self) -> None:
        """This process owns the directory (under Horovod elastic, whichever rank is 0 now), or
        raises: a run whose lease another run took over writes nothing more there. From then on the
        store fences its irreversible steps with the lease and stamps what it publishes."""
        if self.ownership is None:
            self.ownership = Ownership.claim(self.store.directory, self.topology.log,
                                             floor=self.store.generation_floor)
            self.store.fence, self.store.stamp = self.ownership.fence, self.ownership.stamp
        else:
            self.ownership.fence()

    def fence(self) -> None:
        """Right before something else this run publishes into the directory (the compile cache):
        the lease renewed and still this process's, else CheckpointError."""
        if self.ownership is None:
            raise CheckpointError(f"this process does not own checkpoint_dir {self.store.directory}: it publishes "
                                  f"nothing there")
        with self._storage("lease check"):
            self.ownership.fence()

    @contextlib.contextmanager
    def _owned(self) -> Iterator[None]:
        """Rank 0's part of a save: the directory owned first; a storage error inside, in a directory
        taken over meanwhile (its new owner removed what this run was writing), is told as the loss
        of the lease it follows from."""
        self._own()
        try:
            yield
        except (OSError, CheckpointError):
            self.ownership.fence()  # raises the lease's loss, when that is the cause
            raise

    def _storage(self, what: str) -> ContextManager[io_watch.IOActivity]:
        """A storage section of a save or a resume: watched by the stall watchdog as one activity
        (hvdtrain.common.io_watch), beaten by each of its calls that returns."""
        return io_watch.watching(self.store.directory, f"checkpoint {what}")

    def close(self) -> None:
        """Let the directory go (the run is over in this process). A write still in flight (the run
        ended by an error before finish()) completes if it can, or stops waiting for other ranks."""
        if self.background is not None and self.background.in_flight:
            self._abandoned.set()
            failure = self.background.wait()
            if failure:
                self.topology.log.warning(f"the checkpoint written in the background when the run stopped "
                                          f"failed: {failure}")
            self._abandoned.clear()
        if self.ownership is not None:
            self.ownership.release()
            self.ownership = None
            self.store.fence, self.store.stamp = unfenced, None

    def batch_per_worker(self, resumed: Optional[Dict[str, Any]], elastic: bool) -> int:
        """A run resumed on another worker count keeps the checkpoint's global batch, so each
        worker's batch follows from it (under elastic, the global batch follows the world)."""
        cfg, size = self.config, self.topology.data_world.size
        if resumed is None or elastic:
            return cfg.batch_size
        saved = RunState.from_checkpoint(resumed)
        if saved.data_parallel == size:
            return cfg.batch_size
        if saved.global_batch % (size * cfg.accumulation):
            raise ValueError(
                f"the checkpoint's global batch {saved.global_batch} (written by {saved.world_size} "
                f"workers) cannot be split over {size} data-parallel workers x {cfg.accumulation} accumulation: "
                f"resume on a worker count that divides it, or start a new run"
            )
        per_worker = saved.global_batch // (size * cfg.accumulation)
        self.topology.log.warning(
            f"resuming a checkpoint of {saved.data_parallel} data-parallel workers ({saved.world_size} ranks) "
            f"on {size}: the global batch stays {saved.global_batch}, so each data-parallel worker now takes "
            f"{per_worker} samples per micro-batch"
        )
        return per_worker

    def save(self, state: Dict[str, Any], step: int) -> None:
        """Rank 0 writes; the others wait for its outcome, so no rank runs ahead of a save, and a
        failed save (a full disk, a permission) is raised on every rank. Asynchronous: rank 0 copies
        ``state`` and writes the copy in the background; its outcome is agreed at finish()."""
        def write(state: Dict[str, Any]) -> None:
            with self._storage(f"save of step {step}"), self._owned():
                path = self.store.save(state, step)
            self.topology.log.info(f"checkpoint {path}")
        if self.background is None:
            self._agree(attempt(lambda: write(state)) if self.topology.is_root else None, "checkpoint.save")
            return
        self.finish()
        # Refused now, on every rank, rather than in the writer thread at the next save.
        loadable = attempt(lambda: loading.check_loadable(state, "the checkpoint's state")) \
            if self.topology.is_root else None
        self._agree(loadable, "checkpoint.loadable")
        if self.topology.is_root:
            copied = self.snapshot.copy(state)
            self.background.start(lambda: write(copied))

    def save_sharded(self, shard: Dict[str, Any], run_state: Dict[str, Any], step: int) -> None:
        """Every rank writes its own ``shard``; rank 0 then publishes the directory with the
        manifest (holding ``run_state``). An error anywhere is raised on every rank (asynchronous:
        at finish(); the ranks then tell rank 0 their file is written through a record file)."""
        world = self.topology.world
        directory, rank, size = Path(self.store.directory), world.rank, world.size
        self.finish()
        # Rank 0 empties the temporary directory of this claim before anyone writes into it; every
        # rank learns its name (the claim's token is in it) with the outcome.
        def prepare() -> Dict[str, str]:
            with self._owned():
                temporary = sharded.temporary_directory(directory, step, self.ownership.owner.token)
                sharded.prepare(temporary)
            return {"temporary": str(temporary)}
        prepared = attempt(prepare, self._storage(f"save of step {step}")) if world.is_root else None
        temporary = Path(self._agree(prepared, "checkpoint.sharded.prepare")["temporary"])

        def publish(records) -> None:
            store = self.store
            with self._owned():
                path = sharded.publish(directory, step, self.config.strategy, records, run_state, temporary,
                                       store.fence, store.stamp)
                store.point_latest_at(path, step)
            self.topology.log.info(f"checkpoint {path} ({size} shards, {sum(r['bytes'] for r in records)} bytes)")
        if self.background is not None:
            # Refused now, on every rank, rather than in the writer threads at the next save.
            check = attempt(lambda: loading.check_loadable(shard, f"rank {rank}'s part of the checkpoint"))
            problems = problems_on_any_rank(check, "checkpoint.sharded.loadable")
            if problems:
                raise CheckpointError(f"the sharded checkpoint of step {step} was not written: {'; '.join(problems)}")
            copied = self.snapshot.copy(shard)
            self.background.start(lambda: self._write_shard_in_background(temporary, copied, publish))
            return
        written = attempt(lambda: sharded.write_shard(temporary, rank, size, shard),
                          self._storage(f"save of step {step}"))
        records = collectives.allgather_object(written, name="checkpoint.sharded.files")
        failed = [f"rank {r}: {record}" for r, record in enumerate(records) if isinstance(record, str)]
        if failed:
            raise CheckpointError(f"the sharded checkpoint of step {step} was not written: {'; '.join(failed)}")
        self._agree(attempt(lambda: publish(records), self._storage(f"save of step {step}")) if world.is_root
                    else None, "checkpoint.sharded.publish")

    def _write_shard_in_background(self, temporary: Path, shard: Dict[str, Any], publish) -> None:
        """In the writer thread: this rank's file, then its record; rank 0 then waits for every
        rank's record and publishes (no collective: this is not the training thread)."""
        world = self.topology.world
        with self._storage("background save"):
            try:
                record = sharded.write_shard(temporary, world.rank, world.size, shard)
            except Exception as error:
                sharded.write_record(temporary, world.rank, f"{type(error).__name__}: {error}")
                raise
            sharded.write_record(temporary, world.rank, record)
            if world.is_root:
                timeout = self.config.stall_timeout or 600.0
                publish(sharded.wait_for_records(temporary, world.size, timeout, stop=self._abandoned.is_set))

    def finish(self) -> None:
        """Every rank: wait for this rank's background write (if any); a failure on any rank is
        raised on every rank. The next save and the end of the run call it."""
        if self.background is None:
            return
        failure = self.background.wait()
        problems = problems_on_any_rank(failure, "checkpoint.async.outcome")
        if problems:
            raise CheckpointError(f"a checkpoint written in the background failed: {'; '.join(problems)}")

    def load_own_shard(self, state: Dict[str, Any], strategy: Strategy) -> Dict[str, Any]:
        """Every rank reads its own file of the sharded checkpoint ``state`` (a manifest) and checks
        it against the manifest and its strategy; only when every rank's is good does every rank
        load (a ZeRO strategy's load is a collective). Returns this rank's file (its "rng" and
        "callbacks" states)."""
        shard = None

        def read() -> None:
            nonlocal shard
            shard = sharded.read_shard(Path(state["path"]), state, self.topology.world.rank,
                                       verified=self._verified == Path(state["path"]))
            strategy.check_shard_state_dict(shard["strategy"])
        problems = problems_on_any_rank(attempt(read, self._storage("resume")), "checkpoint.sharded.check")
        if problems:
            raise CheckpointError(f"the sharded checkpoint {state['path']} cannot be resumed: {'; '.join(problems)}")
        strategy.load_shard_state_dict(shard["strategy"])
        return shard

    def load_resharded(self, state: Dict[str, Any], strategy: Strategy, keep_own: bool = False
                       ) -> Optional[Dict[str, Any]]:
        """The sharded checkpoint ``state`` (a manifest) written at another worker count or under
        another strategy, or by a mesh (read from every rank's file at any layout): every file is
        checked against the manifest (each by one rank), then every rank reads what its strategy
        keeps (Strategy.read_part: a sharded strategy's ranks their own part in their own layout, a
        mesh's ranks their slices and stages one whole tensor at a time, any other strategy the whole
        state); only when every rank's read succeeded does any rank load it (Strategy.load_part).
        ``keep_own``: the checkpoint was written at this layout; returns this rank's own file (its
        "rng" and "callbacks" states)."""
        world, path = self.topology.world, Path(state["path"])
        part = source = None

        def prepare() -> None:
            nonlocal part, source
            if self._verified != path:  # start() verified it already: each file is hashed once per resume
                sources.verify(path, state, sources.files_to_verify(world.size, world.rank, len(state["files"])))
            source = sources.open_source(path, state)
            try:
                part = strategy.read_part(source)
            except (KeyError, IndexError, TypeError) as error:
                raise CheckpointError(f"its shards do not fit together: {type(error).__name__}: {error}") from None
        problems = problems_on_any_rank(attempt(prepare, self._storage("resume")), "checkpoint.resharded.check")
        if problems:
            raise CheckpointError(f"the sharded checkpoint {path} cannot be resumed: {'; '.join(problems)}")
        if not keep_own:
            ranks = lambda count: f"{count} rank{'s' if count != 1 else ''}"  # noqa: E731
            self.topology.log.info(f"resharding {path} ({ranks(state['world_size'])}, {state['strategy']}) for "
                                   f"{ranks(world.size)} under {self.config.strategy}")
        strategy.load_part(part)
        return source.files[world.rank] if keep_own else None

    def _agree(self, outcome: Any, name: str) -> Any:
        """Rank 0's outcome on every rank (a small value, or None): its error (a message) raised
        everywhere, else the value returned."""
        outcome = collectives.broadcast_object(outcome, root_rank=0, name=name)
        if isinstance(outcome, str):
            raise CheckpointError(outcome)
        return outcome


def attempt(action: Callable[[], Any], inside: Optional[ContextManager] = None) -> Any:
    """``action()``'s result, or its error as a message (to share with the other ranks); run
    ``inside`` a context (a storage section) when given."""
    try:
        with inside if inside is not None else contextlib.nullcontext():
            result = action()
    except (CheckpointError, OSError, ValueError, RuntimeError, MemoryError) as error:
        return f"{type(error).__name__}: {error}" if not isinstance(error, CheckpointError) else str(error)
    return result


def check(action: Callable[[], Any]) -> "tuple[bool, Optional[str]]":
    """(whether a file is corrupt, the problem or None) of ``action()``, a check of files."""
    try:
        action()
    except CorruptCheckpoint as error:
        return True, str(error)
    except (CheckpointError, OSError, ValueError, RuntimeError) as error:
        return False, f"{type(error).__name__}: {error}" if not isinstance(error, CheckpointError) else str(error)
    return False, None


def problems_on_any_rank(problem: Optional[str], name: str) -> List[str]:
    """Every rank's problem, as "rank r: ..." (a collective: every rank calls it, with None when it
    has none); empty when no rank had one."""
    return [f"rank {r}: {p}" for r, p in enumerate(collectives.allgather_object(problem, name=name)) if p]
