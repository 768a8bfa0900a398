"""The Trainer's settings (the ``train`` section of a job's configuration), validated when created."""
from __future__ import annotations

import dataclasses
import math
import signal
from dataclasses import dataclass, field
from typing import Any, Dict, List, Optional


from hvdtrain.common.capabilities import DECLARED, EXPERT_PARALLEL, EXPERT_PARALLEL_FSDP
from hvdtrain.common.capabilities import STRATEGY_NAMES as STRATEGIES
from hvdtrain.common import layout_rules
from hvdtrain.config.checks import check_choices, check_only_with, check_whole_numbers
from hvdtrain.config.strategy_checks import check_strategy_settings

PROGRESS_MODES = ("auto", "bar", "log", "off")
CHECKPOINT_FORMATS = ("full", "sharded")
PRECISIONS = ("fp32", "bf16", "fp16")
REDUCTIONS = ("average", "adasum")
PIPELINE_SCHEDULES = ("gpipe", "1f1b", "zb-h1")
# hvdtrain.components.token_mean's modes (auto: tokens, or replica under Adasum).
LOSS_MEANS = ("auto", "tokens", "replica")
# The data-parallel strategies whose reduction serves a sequence group's ranks (the sum of their partial gradients).
SEQUENCE_STRATEGIES = ("ddp", "zero1", "zero2", "fsdp")
RESUME_MODES = ("true", "false", "force")
LR_SCHEDULES = ("constant", "linear", "cosine", "wsd")
ACTIVATION_CHECKPOINTING = ("none", "full", "every_k", "selective")
PIN_MEMORY_MODES = ("auto", "true", "false")
# hvdtrain.distributed.cpu_allocator.MODES, which this layer may not import (its sibling).
CPU_ALLOCATOR_MODES = ("cache", "system")
# hvdtrain.strategies.fsdp.strategy.OVERLAPS, likewise (tests/unit/test_fsdp_overlap.py holds them equal).
FSDP_OVERLAPS = ("auto", "full", "gathers", "forward", "none")
# Signals a preemption may be asked with: caught (not KILL, STOP), and not sent by the system for
# other reasons (CHLD, WINCH, PIPE, ALRM...). '' disables it.
PREEMPT_SIGNALS = ("USR1", "USR2", "TERM", "INT", "HUP")
LOGGERS = ("csv", "mlflow", "wandb")  # beside metrics.jsonl and TensorBoard (hvdtrain.observability.metric_sinks)


@dataclass
class TrainConfig:
    """How the Trainer trains, checkpoints, survives failures and reports.

    Scripts load it as the ``train`` section of their configuration (hvdtrain.config.loader):
    from a YAML file and ``--train.key=value`` overrides.
    """

    epochs: int = field(default=10, metadata={"help": "passes over the training set"})
    batch_size: int = field(default=32, metadata={"help": "samples per worker per micro-batch"})
    lr: Optional[float] = field(default=None, metadata={"help": "ONE worker's peak learning rate, before scale_lr; when set, it replaces the optimizer's rates (null: the optimizer's own, as you built it)", "details": "It replaces the first parameter group's rate; every other group keeps its ratio to it. The start line prints the real peak rates after scaling."})
    scale_lr: bool = field(default=True, metadata={"help": "multiply the LR by the global batch over one worker's batch (workers x accumulation: the linear scaling rule)", "details": "Goyal et al.'s linear scaling rule, Horovod's default. Set false to fine-tune at the rate you chose (e.g. AdamW at 2e-5), whatever the worker count."})
    warmup_epochs: float = field(default=0.0, metadata={"help": "linear warm-up to the peak LR, in epochs; 0: none (the default: a port trains as its script did)", "details": "Off unless you ask, as in Horovod's, DDP's, Accelerate's and Lightning's examples: a port given a warm-up its script never had learned slower (Horovod's pytorch_mnist on the digits, 2 workers, 3 epochs, 5 seeds: 88.9% mean against the script's 90.4%; without it 90.8%). Goyal et al. warm up over 5 epochs from one worker's rate for global batches of thousands: set it for those. It starts from one worker's rate when scale_lr scales it, else (one worker, scale_lr=false) from the peak / its steps. The start line says where it starts."})
    warmup_steps: Optional[int] = field(default=None, metadata={"help": "the warm-up in optimizer steps instead of epochs (replaces warmup_epochs when set): for a stream without len(), whose epoch has no known length"})
    lr_schedule: str = field(default="constant", metadata={"help": "after the warm-up: constant; linear or cosine decay to min_lr_ratio; wsd: constant, then a linear decay", "details": "linear and cosine reach min_lr_ratio at the run's last step (epochs, or max_steps); wsd decays linearly over the last decay_fraction of the steps.", "choices": LR_SCHEDULES})
    min_lr_ratio: float = field(default=0.0, metadata={"help": "where linear, cosine and wsd end, as a fraction of each parameter group's peak rate"})
    decay_fraction: float = field(default=0.2, metadata={"help": "wsd: the share of the run's steps spent decaying, at its end"})
    accumulation: int = field(default=1, metadata={"help": "micro-batches per optimizer step (backward_passes_per_step)"})
    loss_mean: str = field(default="auto", metadata={"help": "tokens: the loss is the mean over every scored token of the global batch (one process's); replica: each replica's mean, averaged; auto: tokens (adasum: replica)", "details": "With padding, masked prompts or packed rows, replicas hold different numbers of scored tokens, and a mean of their means is not one process's loss. tokens counts each micro-batch's scored items before the step (the labels a Hugging Face model's loss scores, a cross-entropy loss_fn's targets other than its ignore index, packed_lm_step's next-token labels; samples for any other loss) and weighs its loss by them: one all-reduce of a number per step. The reported train_loss is the same token mean. replica is Horovod's and DDP's average of the replicas' losses. Adasum combines updates, not a sum of gradients, so it takes replica. See docs/concepts/data-parallelism.md.", "choices": LOSS_MEANS})
    strategy: str = field(default="ddp", metadata={"help": "how model state is spread over the ranks: ddp replicates it; zero1, zero2 and fsdp shard ever more of it; hsdp: fsdp per host; ps: a parameter server", "details": "ddp replicates the state (all-reduce); zero1 shards the optimizer state, zero2 also the gradients (reduce-scatter + all-gather), fsdp also the parameters (each block gathered while it computes); hsdp shards as fsdp within each host (train.hsdp_shard_size) and averages the shards across hosts; ps: a parameter server, every rank sends its gradients to the servers, which step and send the weights back (a baseline). See docs/concepts/strategies.md.", "choices": STRATEGIES})
    ps_servers: int = field(default=1, metadata={"help": "strategy=ps: ranks 0..ps_servers-1 also serve, each holding the optimizer state of one contiguous slice of the parameters (at most the world size)"})
    hsdp_shard_size: int = field(default=0, metadata={"help": "strategy=hsdp: ranks per shard group, fsdp within it and ddp across groups; 0: the ranks of one host", "details": "The shard groups are K consecutive ranks (one host's, as launchers place them), each holding 1/K of the parameters, gradients and optimizer state; once per step the slices' gradients are averaged across the groups. A smaller K than a host's ranks, or a host split simulated on one machine, set it here; it must divide the world. See docs/concepts/strategies.md."})
    fp16_allreduce: bool = field(default=False, metadata={"help": "compress gradients to fp16 for the all-reduce"})
    fsdp_overlap: str = field(default="auto", metadata={"help": "fsdp/hsdp, what runs ahead: full (gathers, and reduce-scatters behind backward: +4 units held), gathers (+3), forward (+2); auto: full on GPU, gathers on CPU", "details": "full: the next unit's all-gather starts while this one computes, in forward and in backward, and a unit's reduce-scatter runs while the units before it compute, one at a time; a rank holds up to 16 Psi/N bytes (fp32 Adam) plus four units' full size in backward. gathers: the same gathers, each reduce-scatter waited for at once: three units. forward: only forward's gathers run ahead: two units, the least backward can hold (a unit's parameters and its gradient). none: nothing ahead. On a CPU the collectives run on the cores that compute, so a reduce-scatter running behind backward hides little there (hvdtrain bench strategies --fsdp-overlap). See docs/concepts/strategies.md.", "choices": FSDP_OVERLAPS})
    reduction: str = field(default="average", metadata={"help": "how ddp combines the ranks' gradients: average (Horovod's all-reduce) or adasum (Horovod's Adasum; ddp only, over MPI)", "details": "average: the LR is scaled by workers x accumulation. adasum: each rank steps with its own gradient and the updates are combined pairwise, summed where orthogonal, averaged where parallel; the LR is not scaled by the workers; ddp only, over MPI, on a power-of-two number of workers. See docs/concepts/data-parallelism.md.", "choices": REDUCTIONS})
    hierarchical_allreduce: bool = field(default=False, metadata={"help": "set HOROVOD_HIERARCHICAL_ALLREDUCE=1 before hvd.init(): all-reduce within each host, then across hosts", "details": "Horovod applies it only with NCCL on GPUs across several hosts. false: Horovod's default, off unless the launch sets it. See docs/concepts/data-parallelism.md."})
    precision: str = field(default="fp32", metadata={"help": "the forward's precision: fp32; bf16 (autocast); fp16 (autocast and a dynamic loss scale)", "details": "bf16 needs no loss scaling and runs on CPUs too; under fp16, steps with inf/nan are skipped on every rank alike. See docs/porting/trainer.md, Precision.", "choices": PRECISIONS})
    max_grad_norm: Optional[float] = field(default=None, metadata={"help": "clip the averaged gradients to this global L2 norm, across shards under sharded strategies (null: no clipping)"})
    sync_batchnorm: bool = field(default=False, metadata={"help": "compute BatchNorm statistics over the global batch (every rank's samples) instead of each rank's own"})
    activation_checkpointing: str = field(default="none", metadata={"help": "the model's blocks keep only their inputs for backward and compute their forward again there: none, full, every_k or selective", "details": "The blocks are the members of the model's nn.ModuleList / nn.Sequential containers (a transformer's layers). full: every block; every_k: every activation_checkpointing_every-th block; selective: every block keeps the outputs of its matrix products and attention and computes the rest again (norms, activations, elementwise). Less activation memory for about one more forward (selective: less recompute, more memory than full); the same results. See docs/how-to/large-models.md.", "choices": ACTIVATION_CHECKPOINTING})
    activation_checkpointing_every: int = field(default=2, metadata={"help": "activation_checkpointing=every_k: checkpoint the k-th, 2k-th, ... block"})
    compile: bool = field(default=False, metadata={"help": "run the model's forward (and its backward) through torch.compile; not with strategy=fsdp", "details": "The model, its state_dict keys and checkpoints stay as they are; the first step and the first evaluation compile. See docs/how-to/compile.md."})
    tensor_parallel: int = field(default=1, metadata={"help": "ranks that split each layer of one model replica (Megatron-style), one host's ranks; needs a tensor plan", "details": "Attention is split by heads, the MLP by columns then rows: two all-reduces per block forward, two backward. Innermost in the mesh, so one host's ranks. train_lm.py has the example transformer's tensor plan. See docs/concepts/model-parallelism.md."})
    pipeline_parallel: int = field(default=1, metadata={"help": "pipeline stages per model replica, each holding a contiguous run of layers", "details": "Activations move forward and their gradients backward between neighbouring stages; data-parallel width = workers / (tensor_parallel x pipeline_parallel). See docs/concepts/model-parallelism.md."})
    sequence_parallel: int = field(default=1, metadata={"help": "ranks that share each batch and hold 1/S of every sequence (Ulysses): longer sequences per rank; heads split around attention", "details": "The ranks of a sequence group read the same batch, each keeps its part of every sequence, and an all-to-all turns tokens into heads around attention and back (any head-local attention: SDPA, eager, causal, sliding-window, grouped-query with key/value heads replicated when fewer than S). Data-parallel width for the data = workers / (sequence_parallel x tensor_parallel); gradients are reduced over all workers by train.strategy (ddp, zero1, zero2, fsdp; ddp or zero1 with tensor_parallel, whose tensor groups sit inside the sequence groups' ranks); not with pipeline_parallel. A Hugging Face model is split through transformers' attention interface and proved at set-up against the whole model on a probe. See docs/concepts/sequence-parallelism.md."})
    expert_parallel: int = field(default=1, metadata={"help": "ranks over which each mixture-of-experts layer's experts are split (E consecutive data-parallel ranks); tokens reach them by all-to-all", "details": "Each rank of an expert group holds experts / E of every fused experts module (transformers 5's MoE families) and keeps its own data; the router, its top-k and its load-balancing loss stay the model's. The experts' gradients are averaged over the ranks holding the same experts; the rest of the model as train.strategy says: ddp, zero1, zero2 or fsdp (the experts outside their buckets or units, 1/E per rank). Not with hsdp, ps, tensor or pipeline parallelism. See docs/concepts/model-parallelism.md."})
    micro_batches: int = field(default=1, metadata={"help": "micro-batches each worker's batch is cut into for the pipeline (pipeline_parallel > 1); must divide batch_size", "details": "More micro-batches, a smaller idle bubble: (stages - 1) / (micro_batches + stages - 1)."})
    pipeline_schedule: str = field(default="1f1b", metadata={"help": "gpipe: all forwards, then all backwards; 1f1b: one forward, one backward in turn; zb-h1: 1f1b with weight gradients deferred into the bubble", "details": "gpipe holds all micro-batches' activations, 1f1b and zb-h1 at most pipeline_parallel micro-batches'; gpipe and 1f1b idle (P - 1) / (M + P - 1) of a step (1f1b interleaved: (P - 1) / (v·M + P - 1), see pipeline_virtual_stages), zb-h1 about a third of 1f1b's idle time (its backward split into the input's gradient and the weights', done later). The same result.", "choices": PIPELINE_SCHEDULES})
    pipeline_virtual_stages: int = field(default=1, metadata={"help": "model chunks per pipeline stage (v): the layers cut into pipeline_parallel x v chunks, chunk c on stage c mod P; v > 1 interleaves 1f1b", "details": "The interleaved 1F1B schedule (Narayanan et al. 2021): each micro-batch visits every stage v times, so the idle bubble shrinks to (P - 1) / (v·M + P - 1) at the price of v times the point-to-point exchanges. Needs pipeline_schedule=1f1b and micro_batches a multiple of pipeline_parallel; a stage plan (ModelPlan.stage_layers) then lists the P x v chunks."})
    seed: int = field(default=42, metadata={"help": "one seed for the job; ranks derive theirs from it"})
    eval_every: int = field(default=0, metadata={"help": "steps between evaluations on the validation set, besides the one at each epoch's end (0: at epoch ends only)"})
    log_every: int = field(default=20, metadata={"help": "steps between log lines (rank 0)"})
    max_steps: Optional[int] = field(default=None, metadata={"help": "stop after this many optimizer steps"})
    num_workers: int = field(default=0, metadata={"help": "DataLoader worker processes per rank"})
    eval_batch_size: Optional[int] = field(default=None, metadata={"help": "samples per worker per evaluation batch (null: batch_size)"})
    prefetch_factor: Optional[int] = field(default=None, metadata={"help": "batches each DataLoader worker process loads ahead (null: torch's default, 2); needs num_workers > 0"})
    pin_memory: str = field(default="auto", metadata={"help": "the loaders' batches in page-locked host memory, for faster copies to the GPU: auto (on a GPU), true or false", "details": "Copies from page-locked memory to the GPU are faster and overlap the compute. auto: on when this rank's device is a GPU; true is refused on a CPU device, which copies nothing; false locks less host memory (e.g. with many DataLoader workers on hosts short of RAM). A loader_factory's loaders are yours to set.", "choices": PIN_MEMORY_MODES})
    cpu_allocator: str = field(default="cache", metadata={"help": "on a CPU rank, cache: malloc keeps what a step frees for the next step (no page faults each step); system: glibc's default", "details": "system returns large blocks to the system at once, and the next step faults them in again. cache is what CUDA's caching allocator does on a GPU; on a CPU it saves the kernel first-touching the step's large tensors again every step (hvdtrain bench strategies gives the figures). The process's resident memory then stays at the most a step held (plus fragmentation) between steps. A malloc tuning of your own (MALLOC_*, GLIBC_TUNABLES, a preloaded jemalloc, tcmalloc or mimalloc) is left alone, as is a GPU rank. See docs/concepts/strategies.md.", "choices": CPU_ALLOCATOR_MODES})
    checkpoint_dir: Optional[str] = field(default=None, metadata={"help": "where rank 0 writes checkpoints (none: no checkpoints)"})
    checkpoint_every: int = field(default=0, metadata={"help": "steps between checkpoints (0: at the end of each epoch only)"})
    keep_checkpoints: int = field(default=3, metadata={"help": "checkpoints kept; older ones are deleted"})
    checkpoint_format: str = field(default="full", metadata={"help": "full: rank 0 writes the whole state in one file; sharded (zero1, zero2, fsdp, meshes, expert_parallel): every rank writes only its own part", "details": "A full checkpoint is gathered on rank 0 and resumes under any strategy and worker count. A sharded one gathers nothing; it resumes at any worker count and under any strategy, resharded on load (each rank reads only the slices it needs), and hvdtrain checkpoint consolidate makes it a full one. See docs/concepts/checkpoints.md.", "choices": CHECKPOINT_FORMATS})
    checkpoint_async: bool = field(default=False, metadata={"help": "a save stalls training only while the state is copied to host memory; a background thread writes it", "details": "The next save (or the end of the run) waits for that write. Costs one more host copy of what this rank writes. See docs/concepts/checkpoints.md."})
    resume: str = field(default="true", metadata={"help": "true: continue from the newest valid checkpoint in checkpoint_dir; force: even one of other settings; false: start anew", "details": "true is refused when the checkpoint was written with settings that define another run (the model, the data, and train's batch_size, lr, scale_lr, warmup_epochs, warmup_steps, lr_schedule, min_lr_ratio, decay_fraction, reduction, precision, max_grad_norm, sync_batchnorm, seed); force continues it all the same, with this run's settings; false is refused when checkpoint_dir already holds checkpoints. See docs/concepts/checkpoints.md.", "choices": RESUME_MODES})
    preempt_signal: str = field(default="USR1", metadata={"help": "signal that asks for checkpoint + requeue: USR1, USR2, TERM, INT or HUP ('' disables); under hvdtrain launch USR1 or USR2", "details": "SLURM sends it before the time limit with #SBATCH --signal=B:USR1@90. hvdtrain launch passes USR1 and USR2 on to the ranks; INT, HUP and TERM sent to it stop the whole job (mpirun kills the ranks: TERM, then KILL a second later), so under it a rank refuses them at start, with one line. KILL and STOP cannot be caught, and CHLD, WINCH and the like come from the system routinely: refused. See docs/how-to/launching.md and docs/how-to/slurm.md."})
    preempt_on_term: bool = field(default=False, metadata={"help": "TERM also asks for checkpoint + requeue, beside preempt_signal: SLURM's preemption with GraceTime sends TERM, then KILL", "details": "Off by default: TERM is also what scancel and a time limit send, and a run that ends for them should not requeue itself. The checkpoint must be written within GraceTime (or KillWait): vote often (preempt_check_every). Under mpirun, a TERM to mpirun itself kills the ranks a second later: this is for signals SLURM sends to the ranks (srun). See docs/how-to/slurm.md."})
    stall_timeout: float = field(default=600.0, metadata={"help": "seconds without a finished step before a rank ends the job, naming where it is stuck (0: never)"})
    flight_recorder: int = field(default=2048, metadata={"help": "collectives and step phases each rank keeps for hang dumps into run_dir/flight (0: off)", "details": "Written on a stall, on SIGUSR2 and by hvdtrain debug dump RUN_DIR; hvdtrain debug analyze RUN_DIR names the first collective the ranks disagree on and the slowest rank per phase. See docs/concepts/faults.md."})
    checkpoint_timeout: float = field(default=600.0, metadata={"help": "seconds a checkpoint's storage call may not return (a file being written may move no byte) before its rank ends the job, naming it (0: never)", "details": "While every rank saves or resumes, stall_timeout's step clock is paused (a large save is slow, not stuck) and every storage section of the save or resume, in any thread (a background save's, the lease's renewal too), is watched by this clock instead: it restarts with every block written or hashed and every call that returns (the lease check, mkdir, a rename, a poll), so a slow save that moves is never ended; a read that torch or safetensors does at once is one call, timed from its start. A rank stuck on a hung mount reports the work stuck (its file, the bytes written so far) and exits with the stall exit code (75). See docs/concepts/faults.md."})
    elastic_commit_every: int = field(default=10, metadata={"help": "steps between in-memory commits under Horovod elastic (what a worker loss rolls back to; zero1/zero2/fsdp commit at each checkpoint instead)"})
    preempt_check_every: int = field(default=10, metadata={"help": "steps between the ranks' vote on a preemption signal (and on a stop a callback asked for)"})
    run_dir: Optional[str] = field(default=None, metadata={"help": "parent of the run directories (resolved config, metrics.jsonl, TensorBoard events, per-rank logs); null: no files"})
    run_name: Optional[str] = field(default=None, metadata={"help": "this run's directory under run_dir; null: slurm-<job id> under SLURM (a requeued job appends to it), else the start time"})
    progress: str = field(default="auto", metadata={"help": "rank 0's progress display: a tqdm bar, log lines every log_every steps, or nothing; auto: a bar on a terminal, lines otherwise (SLURM logs)", "choices": PROGRESS_MODES})
    tensorboard: bool = field(default=True, metadata={"help": "write TensorBoard event files into the run directory"})
    loggers: List[str] = field(default_factory=list, metadata={"help": "more places rank 0 writes the records to, beside metrics.jsonl and TensorBoard: csv, mlflow, wandb; needs run_dir", "details": "csv: metrics-<kind>.csv in the run directory; mlflow: an MLflow run (pip install -e .[mlflow]); wandb: a W&B run in offline mode under run_dir/wandb (pip install -e .[wandb]). E.g. [csv, mlflow].", "choices": LOGGERS})
    mlflow_tracking_uri: Optional[str] = field(default=None, metadata={"help": "loggers=[mlflow]: MLflow's tracking URI (null: sqlite:///<run_dir>/mlflow.db, one store for every run under run_dir)"})
    mlflow_experiment: str = field(default="hvdtrain", metadata={"help": "loggers=[mlflow]: the MLflow experiment the run belongs to"})
    wandb_project: str = field(default="hvdtrain", metadata={"help": "loggers=[wandb]: the W&B project the offline run belongs to (wandb sync uploads it there)"})
    timeline_steps: int = field(default=0, metadata={"help": "record the Horovod timeline for this many steps, after 5 warm-up steps, into the run directory (0: off)"})

    # The settings a resumed run must share with its checkpoint (beside every other section of the
    # job: the model, the data): changed, the run would continue another run's training. The rest
    # (length, strategy and layout, checkpointing, reporting) may change between a run and its resume.
    DEFINES_THE_RUN = ("batch_size", "lr", "scale_lr", "warmup_epochs", "warmup_steps", "lr_schedule", "min_lr_ratio",
                       "decay_fraction", "reduction", "precision", "max_grad_norm", "sync_batchnorm", "seed", "loss_mean")

    def __post_init__(self) -> None:
        for name in ("resume", "pin_memory"):  # TrainConfig(resume=False) from Python: settings of words
            if isinstance(getattr(self, name), bool):
                setattr(self, name, "true" if getattr(self, name) else "false")
        check_choices(self)  # every field with "choices" in its metadata (strategy, precision, resume, ...)
        for name in ("checkpoint_dir", "run_dir"):
            if getattr(self, name) == "":
                raise ValueError(f"TrainConfig.{name} must be a directory, or null for none, got ''")
        check_whole_numbers(self, ("epochs", "batch_size", "accumulation", "log_every", "keep_checkpoints",
                                   "preempt_check_every", "elastic_commit_every"))
        check_whole_numbers(self, ("num_workers", "checkpoint_every", "timeline_steps", "eval_every", "flight_recorder"),
                            minimum=0)
        if not isinstance(self.seed, int) or isinstance(self.seed, bool) or self.seed < 0:
            raise ValueError(f"TrainConfig.seed must be a whole number >= 0 (each rank's seed is derived from it by "
                             f"numpy's SeedSequence, which takes no negative number), got {self.seed!r}")
        self._check_preempt_signal()
        if self.lr is not None and (isinstance(self.lr, bool) or not isinstance(self.lr, (int, float))
                                    or not (math.isfinite(self.lr) and self.lr > 0)):
            raise ValueError(f"TrainConfig.lr must be a finite number > 0, or null for the optimizer's own rates, "
                             f"got {self.lr!r}")
        if not (math.isfinite(self.stall_timeout) and self.stall_timeout >= 0):
            raise ValueError(f"TrainConfig.stall_timeout must be a finite number of seconds >= 0 (0: no watchdog), "
                             f"got {self.stall_timeout!r}")
        if not (math.isfinite(self.checkpoint_timeout) and self.checkpoint_timeout >= 0):
            raise ValueError(f"TrainConfig.checkpoint_timeout must be a finite number of seconds >= 0 (0: checkpoint "
                             f"reads and writes are not watched), got {self.checkpoint_timeout!r}")
        if not (math.isfinite(self.warmup_epochs) and self.warmup_epochs >= 0):
            raise ValueError(f"TrainConfig.warmup_epochs must be a finite number >= 0, got {self.warmup_epochs!r}")
        for name in ("eval_batch_size", "prefetch_factor"):
            value = getattr(self, name)
            if value is not None and (isinstance(value, bool) or not isinstance(value, int) or value < 1):
                raise ValueError(f"TrainConfig.{name} must be a whole number >= 1 or None, got {value!r}")
        if self.warmup_steps is not None and (isinstance(self.warmup_steps, bool) or not isinstance(self.warmup_steps, int)
                                              or self.warmup_steps < 0):
            raise ValueError(f"TrainConfig.warmup_steps must be a whole number >= 0, or None to count the warm-up in "
                             f"warmup_epochs, got {self.warmup_steps!r}")
        if self.prefetch_factor is not None and self.num_workers == 0:
            raise ValueError(f"TrainConfig.prefetch_factor={self.prefetch_factor!r} needs DataLoader worker processes "
                             f"to load ahead: set num_workers > 0 too, or leave prefetch_factor null")
        check_whole_numbers(self, ("activation_checkpointing_every",))
        check_only_with(self, "activation_checkpointing_every", 2, "activation_checkpointing", "every_k")
        if self.loggers and not self.run_dir:
            raise ValueError(f"TrainConfig.loggers={self.loggers!r} write the run directory's records: set run_dir too")
        if not 0.0 <= self.min_lr_ratio <= 1.0:
            raise ValueError(f"TrainConfig.min_lr_ratio must be a fraction in [0, 1], got {self.min_lr_ratio!r}")
        if not 0.0 < self.decay_fraction <= 1.0:
            raise ValueError(f"TrainConfig.decay_fraction must be a fraction in (0, 1], got {self.decay_fraction!r}")
        if self.max_steps is not None and self.max_steps < 1:
            raise ValueError(f"TrainConfig.max_steps must be >= 1 or None, got {self.max_steps!r}")
        check_whole_numbers(self, ("ps_servers",))
        check_only_with(self, "ps_servers", 1, "strategy", "ps")
        check_whole_numbers(self, ("hsdp_shard_size",), minimum=0)
        check_only_with(self, "hsdp_shard_size", 0, "strategy", "hsdp")
        if self.fsdp_overlap != "auto" and self.strategy not in ("fsdp", "hsdp"):
            raise ValueError(f"TrainConfig.fsdp_overlap={self.fsdp_overlap} applies to strategy=fsdp or hsdp only, got "
                             f"strategy={self.strategy}: set strategy=fsdp, or leave fsdp_overlap at auto")
        if self.reduction == "adasum":
            self._check_adasum()
        if self.max_grad_norm is not None and not (math.isfinite(self.max_grad_norm) and self.max_grad_norm > 0):
            raise ValueError(f"TrainConfig.max_grad_norm must be > 0 or None (no clipping), got {self.max_grad_norm!r}")
        check_whole_numbers(self, ("tensor_parallel", "pipeline_parallel", "sequence_parallel", "expert_parallel",
                                   "micro_batches", "pipeline_virtual_stages"))
        if self.pipeline_virtual_stages > 1:
            self._check_virtual_stages()
        if self.sequence_parallel > 1:
            self._check_sequence_parallel()
        if self.expert_parallel > 1:
            self._check_expert_parallel()
        if self.model_parallel:
            self._check_model_parallel()
        elif self.micro_batches > 1:
            raise ValueError(f"TrainConfig.micro_batches={self.micro_batches} cuts the batch for a pipeline, but "
                             f"pipeline_parallel=1: set pipeline_parallel > 1, or use accumulation to split a "
                             f"data-parallel batch")
        if self.run_name is not None and (not self.run_name or "/" in self.run_name or self.run_name.startswith(".")):
            raise ValueError(f"TrainConfig.run_name must be a plain directory name, got {self.run_name!r}")
        # What the strategy (or the model-parallel layout) cannot do: hvdtrain.common.capabilities.
        check_strategy_settings(self)

    @property
    def resolved_loss_mean(self) -> str:
        """tokens or replica: auto is tokens, except under Adasum (which averages no gradients)."""
        if self.loss_mean == "auto":
            return "replica" if self.reduction == "adasum" else "tokens"
        return self.loss_mean

    @property
    def needs_process_sets(self) -> bool:
        """Whether Horovod must start with dynamic process sets (a mesh, or sequence groups)."""
        return self.model_parallel or self.sequence_parallel > 1 or self.expert_parallel > 1 or self.strategy == "hsdp"

    @property
    def model_parallel(self) -> bool:
        """Whether one model replica spans several ranks (tensor or pipeline parallelism)."""
        return self.tensor_parallel * self.pipeline_parallel > 1

    def _check_model_parallel(self) -> None:
        """What tensor and pipeline parallelism do not combine with (yet), each with the reason."""
        layout = f"tensor_parallel={self.tensor_parallel} x pipeline_parallel={self.pipeline_parallel}"
        if self.batch_size % self.micro_batches:
            raise ValueError(f"TrainConfig.micro_batches={self.micro_batches} does not divide batch_size="
                             f"{self.batch_size}: every micro-batch must hold the same number of samples, so "
                             f"that the pipeline's mean loss is the batch's; choose a divisor of {self.batch_size}")
        refused = [
            (self.precision == "fp16", "precision=fp16: the loss scale's inf/nan check and unscale cover one "
             "rank's whole model today, not its stage's or its tensor slice's; use precision=bf16 (no loss scale)"),
            (self.sync_batchnorm, "sync_batchnorm: its statistics are reduced over every rank, and a model "
             "replica spans several; set sync_batchnorm=false"),
        ]
        for refused_here, why in refused:
            if refused_here:
                raise ValueError(f"TrainConfig.{layout} does not work with {why}")

    def _check_virtual_stages(self) -> None:
        """The interleaved schedule's needs: a pipeline, 1f1b, micro-batches in groups of pipeline_parallel."""
        v = self.pipeline_virtual_stages
        if self.pipeline_parallel < 2:
            raise ValueError(f"TrainConfig.pipeline_virtual_stages={v} cuts each pipeline stage into chunks, but "
                             f"pipeline_parallel={self.pipeline_parallel}: set pipeline_parallel > 1, or "
                             f"pipeline_virtual_stages=1")
        if self.pipeline_schedule != "1f1b":
            raise ValueError(f"TrainConfig.pipeline_virtual_stages={v} interleaves the 1f1b schedule; "
                             f"pipeline_schedule={self.pipeline_schedule} runs one chunk per stage: set "
                             f"pipeline_schedule=1f1b, or pipeline_virtual_stages=1")
        if self.micro_batches % self.pipeline_parallel:
            raise ValueError(f"TrainConfig.pipeline_virtual_stages={v}: the interleaved schedule sends micro-batches "
                             f"round the stages in groups of pipeline_parallel={self.pipeline_parallel}, and "
                             f"micro_batches={self.micro_batches} is not a multiple of it; choose micro_batches a "
                             f"multiple of {self.pipeline_parallel}")

    def _check_sequence_parallel(self) -> None:
        """What sequence parallelism does not combine with (yet), each with the reason and the way out: the
        dimensions and strategies from hvdtrain.common.layout_rules, the other settings here."""
        self._check_layout_rules(layout_rules.SEQUENCE)
        refused = [
            (self.reduction == "adasum", "reduction=adasum: a sequence group's ranks each hold part of one "
             "gradient, to be summed, which Adasum's combination is not; use reduction=average"),
            (self.sync_batchnorm, "sync_batchnorm: a sequence model has no batch norm to synchronise; set "
             "sync_batchnorm=false"),
            (self.compile, "compile: the all-to-alls inside the compiled forward and its switch between split and "
             "whole forwards are not proved under torch.compile yet; set compile=false"),
        ]
        for refused_here, why in refused:
            if refused_here:
                raise ValueError(f"TrainConfig.sequence_parallel={self.sequence_parallel} does not work with {why}")

    def _check_expert_parallel(self) -> None:
        """What expert parallelism does not combine with (yet), each with the reason and the way out: the
        dimensions and strategies from hvdtrain.common.layout_rules, the other settings here."""
        layout = f"expert_parallel={self.expert_parallel}"
        refuses = DECLARED[EXPERT_PARALLEL_FSDP if self.strategy == "fsdp" else EXPERT_PARALLEL].refuses
        self._check_layout_rules(layout_rules.EXPERT)
        refused = [
            (self.reduction == "adasum", f"reduction=adasum: {refuses['adasum']}; use reduction=average"),
            (self.compile, f"compile: {refuses['compile']}; set compile=false"),
            (self.precision == "fp16", "precision=fp16: the loss scale's inf/nan check covers one rank's gradients, "
             "and a rank's experts are its own; use precision=bf16 (no loss scale)"),
        ]
        for refused_here, why in refused:
            if refused_here:
                raise ValueError(f"TrainConfig.{layout} does not work with {why}")

    def _check_layout_rules(self, dimension: str) -> None:
        """The first pair of ``dimension`` with another dimension or the strategy that
        hvdtrain.common.layout_rules refuses, with its reason and way out."""
        settings = {name: getattr(self, name) for name in layout_rules.DIMENSIONS}
        settings["strategy"] = self.strategy
        found = layout_rules.refusals(settings, of=dimension)
        if found:
            raise ValueError(layout_rules.message(*found[0], settings))

    def _check_preempt_signal(self) -> None:
        """preempt_signal as a bare upper-case name (SIGUSR1 and usr1 are USR1), one of PREEMPT_SIGNALS or ''."""
        if not isinstance(self.preempt_signal, str):
            raise ValueError(f"TrainConfig.preempt_signal must be a signal's name, got {self.preempt_signal!r}")
        name = self.preempt_signal.strip().upper()
        self.preempt_signal = name[3:] if name.startswith("SIG") else name
        if self.preempt_signal and self.preempt_signal not in PREEMPT_SIGNALS:
            known = hasattr(signal, f"SIG{self.preempt_signal}")
            why = {"KILL": "it cannot be caught", "STOP": "it cannot be caught"}.get(
                self.preempt_signal, "the system sends it for other reasons" if known else "no such signal")
            raise ValueError(f"TrainConfig.preempt_signal must be one of {', '.join(PREEMPT_SIGNALS)}, or '' for "
                             f"none, got {self.preempt_signal!r} ({why})")

    def _check_adasum(self) -> None:
        """What Horovod's Adasum cannot be combined with (beyond the strategies that refuse it), each
        refused with the reason and a way out."""
        if self.loss_mean == "tokens":
            raise ValueError(
                "TrainConfig.reduction=adasum does not work with loss_mean=tokens: a token mean over the global batch "
                "weighs each rank's gradient before an average, and Adasum combines the ranks' updates instead of "
                "averaging them. Set loss_mean=replica (or auto) with adasum, or reduction=average for the token mean")
        if self.precision == "fp16":
            raise ValueError(
                "TrainConfig.reduction=adasum does not work with precision=fp16: Horovod's Adasum optimizer "
                "steps each parameter with this rank's own gradient inside backward, before the loop can "
                "unscale the loss scale and check for inf/nan. Use precision=bf16 (no loss scale) or fp32 "
                "with adasum, or reduction=average with fp16")
        if self.max_grad_norm is not None:
            raise ValueError(
                "TrainConfig.reduction=adasum does not work with max_grad_norm: no rank ever holds the "
                "combined gradient to clip (each rank steps with its own gradient inside backward and "
                "Adasum combines the updates). Set max_grad_norm to null with adasum, or use "
                "reduction=average to clip")

    def to_dict(self) -> Dict[str, Any]:
        return dataclasses.asdict(self)
