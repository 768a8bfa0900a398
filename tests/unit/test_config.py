import dataclasses
import re
from dataclasses import dataclass, field
from typing import Dict, List, Optional, Tuple

import pytest
import yaml

from hvdtrain.config.train import TrainConfig
from hvdtrain.config.loader import ConfigError, job_argument_parser, load_job, parse_job, reference, to_yaml


@pytest.mark.parametrize("field_name,value", [
    ("epochs", 0), ("batch_size", -4), ("accumulation", 0), ("log_every", 0),
    ("lr", 0.0), ("warmup_epochs", -1.0), ("max_steps", 0), ("num_workers", -1),
    ("batch_size", 2.5), ("progress", "fancy"), ("timeline_steps", -1), ("run_name", "a/b"),
    ("strategy", "zero4"), ("lr", float("inf")), ("lr", float("nan")), ("stall_timeout", float("nan")),
    ("stall_timeout", float("inf")), ("checkpoint_timeout", float("nan")), ("checkpoint_timeout", -1.0),
    ("checkpoint_dir", ""), ("run_dir", ""), ("resume", "maybe"),
    ("max_grad_norm", float("inf")), ("pin_memory", "always"),
])
def test_invalid_settings_name_the_field_and_the_value(field_name, value):
    with pytest.raises(ValueError, match=rf"TrainConfig\.{field_name} must be .*{value!r}"):
        TrainConfig(**{field_name: value})


@dataclass
class ModelSection:
    """A model."""

    width: int = field(default=8, metadata={"help": "units"})
    dropout: Optional[float] = None
    name: str = "mlp"


@dataclass
class Job:
    train: TrainConfig = field(default_factory=lambda: TrainConfig(epochs=3, lr=0.5))
    model: ModelSection = field(default_factory=ModelSection)


def write(tmp_path, text):
    path = tmp_path / "job.yaml"
    path.write_text(text)
    return str(path)


def test_defaults_then_file_then_command_line(tmp_path):
    assert load_job(Job) == Job()
    path = write(tmp_path, "train:\n  epochs: 7\n  lr: 1\nmodel:\n  width: 16\n")
    job = load_job(Job, path, ["--train.lr=0.1", "--model.dropout", "0.25", "--batch-size", "16",
                               "--train.fp16_allreduce", "--train.scale-lr=false"])
    assert (job.train.epochs, job.train.lr, job.train.batch_size) == (7, 0.1, 16)
    assert isinstance(job.train.lr, float) and job.train.fp16_allreduce and not job.train.scale_lr
    assert (job.model.width, job.model.dropout, job.model.name) == (16, 0.25, "mlp")
    assert load_job(Job, None, ["--model.dropout=null"]).model.dropout is None
    assert load_job(Job, None, ["--train.run_dir=runs", "--train.run_dir=null"]).train.run_dir is None
    assert load_job(Job, None, ["--model.name=null"]).model.name == "null"  # not optional: text


def test_the_resolved_yaml_loads_back_to_the_same_job(tmp_path):
    job = load_job(Job, None, ["--train.max_steps=9", "--model.name=cnn", "--train.run_dir=runs"])
    assert load_job(Job, write(tmp_path, to_yaml(job))) == job


@pytest.mark.parametrize("text,message", [
    ("train:\n  lrr: 0.1\n", r"unknown key train\.lrr \(did you mean lr\?\); valid: epochs, batch_size"),
    ("trian:\n  lr: 0.1\n", r"unknown section 'trian' \(did you mean train\?\); valid: train, model"),
    ("train:\n  epochs: ten\n", r"job\.yaml: train\.epochs: expected a whole number, got 'ten'"),
    ("train:\n  epochs: 2.5\n", r"train\.epochs: expected a whole number, got 2\.5"),
    ("train:\n  scale_lr: 1\n", r"train\.scale_lr: expected true or false, got 1"),
    ("train:\n  epochs: 0\n", r"section train: TrainConfig\.epochs must be a whole number >= 1, got 0"),
    ("train: 3\n", r"train: a section holds key: value lines"),
    ("- a\n- b\n", r"the top level must be sections"),
    ("train: [\n", r"is not valid YAML"),
])
def test_a_bad_file_names_the_key_and_what_is_accepted(tmp_path, text, message):
    with pytest.raises(ConfigError, match=message):
        load_job(Job, write(tmp_path, text))


@pytest.mark.parametrize("argv,message", [
    (["--train.epochs=many"], r"--train\.epochs: expected a whole number, got 'many'"),
    (["--model.widht=3"], r"unknown key model\.widht \(did you mean width\?\)"),
    (["--colour=red"], r"unknown setting --colour"),
    (["--train.lr"], r"--train\.lr: needs a value \(a number or null\)"),
    (["stray"], r"unexpected argument 'stray': settings are --section\.key=value"),
    (["--model.progress=bar"], r"unknown key model\.progress"),
    (["--train.strategy=zero"], r"section train: TrainConfig\.strategy must be one of ddp, zero1, zero2, fsdp, hsdp, ps, got 'zero'"),
])
def test_a_bad_override_names_it(argv, message):
    with pytest.raises(ConfigError, match=message):
        load_job(Job, None, argv)


@pytest.mark.parametrize("argv,message", [
    # Other trainers' names, answered by meaning: by letters num_train_epochs is closest to num_workers.
    (["--train.learning_rate=3e-5"], r"unknown key train\.learning_rate: hvdtrain's name for it is --train\.lr "
                                     r"\(learning_rate is Hugging Face's Trainer's name\)"),
    (["--num_train_epochs", "3"], r"unknown setting --num_train_epochs: hvdtrain's name for it is --train\.epochs"),
    (["--max_epochs=3"], r"--train\.epochs \(max_epochs is Lightning's name\)"),
    (["--bf16"], r"hvdtrain's name for it is --train\.precision=bf16"),
    (["--gradient_accumulation_steps=4"], r"--train\.accumulation"),
    (["--devices=8"], r"in hvdtrain the launcher sets the workers \(horovodrun -np N"),
    # A bare key misspelled is matched against the bare keys: "epoch" is far from "train.epochs" by letters.
    (["--epoch=3"], r"unknown setting --epoch=3 \(did you mean --train\.epochs\?\)"),
    (["--train.strategy=FSDP"], r"strategy must be one of .*got 'FSDP' \(did you mean fsdp\? the choices are lower case\)"),
    (["--train.strategy=zero-2"], r"got 'zero-2' \(did you mean zero2\?\)"),
])
def test_another_trainers_name_or_a_slip_gets_hvdtrains_name(argv, message):
    with pytest.raises(ConfigError, match=message):
        load_job(Job, None, argv)


def test_another_trainers_name_in_a_file_gets_hvdtrains_name(tmp_path):
    with pytest.raises(ConfigError, match=r"unknown key train\.num_train_epochs: hvdtrain's name for it is --train\.epochs"):
        load_job(Job, write(tmp_path, "train:\n  num_train_epochs: 3\n"))


def test_every_name_offered_for_another_trainers_is_a_real_setting():
    from hvdtrain.config.other_names import OTHER_NAMES

    keys = {f"--train.{f.name}" for f in dataclasses.fields(TrainConfig)}
    for name, (setting, _) in OTHER_NAMES.items():
        for offered in re.findall(r"--train\.[a-z_]+", setting):
            assert offered in keys, f"{name} points to {offered}, which is not a setting"
        assert name not in {f.name for f in dataclasses.fields(TrainConfig)}, f"{name} is hvdtrain's own key"


def test_a_missing_file_says_so(tmp_path):
    with pytest.raises(ConfigError, match=r"config file .*nope\.yaml does not exist"):
        load_job(Job, str(tmp_path / "nope.yaml"))


def test_a_bare_key_in_two_sections_must_be_qualified():
    @dataclass
    class Other:
        epochs: int = 1

    @dataclass
    class TwoJob:
        train: TrainConfig = field(default_factory=TrainConfig)
        other: Other = field(default_factory=Other)

    with pytest.raises(ConfigError, match=r"--epochs is in several sections \(train, other\)"):
        load_job(TwoJob, None, ["--epochs", "2"])


def test_script_parser_exits_2_with_the_reason_and_prints_the_config(capsys, tmp_path):
    parser = job_argument_parser(Job, "demo")
    with pytest.raises(SystemExit) as exit_info:
        parse_job(Job, parser, ["--train.epochs=x"])
    assert exit_info.value.code == 2
    assert "--train.epochs: expected a whole number, got 'x'" in capsys.readouterr().err
    with pytest.raises(SystemExit) as exit_info:
        parse_job(Job, job_argument_parser(Job, "demo"), ["--print-config", "--model.width=5"])
    assert exit_info.value.code == 0
    printed = yaml.safe_load(capsys.readouterr().out)
    assert printed["model"]["width"] == 5 and printed["train"]["epochs"] == 3
    assert "--model.width=8" in job_argument_parser(Job, "demo").format_help()


def test_reference_lists_every_key_with_type_default_and_choices():
    text = reference(Job)
    for f in dataclasses.fields(TrainConfig):
        assert f"| `{f.name}` |" in text
    assert "| `epochs` | a whole number | `3` |" in text
    assert "| `dropout` | a number or null | `null` |" in text
    assert "(one of: auto, bar, log, off)" in text


def test_resume_takes_true_false_and_force_from_yaml_the_command_line_and_python(tmp_path):
    assert load_job(Job, write(tmp_path, "train:\n  resume: false\n")).train.resume == "false"
    assert load_job(Job, overrides=["--train.resume=force"]).train.resume == "force"
    assert TrainConfig(resume=False).resume == "false" and TrainConfig().resume == "true"


def test_pin_memory_takes_auto_true_and_false_from_yaml_the_command_line_and_python(tmp_path):
    assert load_job(Job, write(tmp_path, "train:\n  pin_memory: false\n")).train.pin_memory == "false"
    assert load_job(Job, overrides=["--train.pin_memory=true"]).train.pin_memory == "true"
    assert TrainConfig(pin_memory=True).pin_memory == "true" and TrainConfig().pin_memory == "auto"


@dataclass
class OptimSection:
    """An optimizer's settings, with the containers a real one needs."""

    betas: Tuple[float, float] = field(default=(0.9, 0.999), metadata={"help": "Adam's betas"})
    milestones: List[int] = field(default_factory=lambda: [30, 60])
    widths: Tuple[int, ...] = (64, 32)
    lr_by_group: Dict[str, float] = field(default_factory=dict)
    clip: Optional[List[float]] = None


@dataclass
class OptimJob:
    train: TrainConfig = field(default_factory=TrainConfig)
    optim: OptimSection = field(default_factory=OptimSection)


def test_lists_tuples_and_mappings_come_from_yaml_and_the_command_line(tmp_path):
    path = write(tmp_path, "optim:\n  betas: [0.9, 0.95]\n  milestones: [10, 20, 30]\n"
                           "  lr_by_group: {decay: 0.1, no_decay: 1}\n")
    job = load_job(OptimJob, str(path), ["--optim.widths=[128, 64, 32]", "--optim.clip", "[0.5,1]"])
    assert job.optim.betas == (0.9, 0.95) and isinstance(job.optim.betas[1], float)
    assert job.optim.milestones == [10, 20, 30]
    assert job.optim.widths == (128, 64, 32)
    assert job.optim.lr_by_group == {"decay": 0.1, "no_decay": 1.0}
    assert job.optim.clip == [0.5, 1.0]
    assert load_job(OptimJob, None, ["--optim.clip=null"]).optim.clip is None
    # The resolved config is plain YAML (tuples written as lists) and loads back to the same job.
    again = write(tmp_path, to_yaml(job))
    assert load_job(OptimJob, str(again)) == job
    shown = reference(OptimJob, skip=("train",))
    assert "| `betas` | a list of 2: (a number), (a number) | `[0.9, 0.999]` | Adam's betas |" in shown
    assert "| `lr_by_group` | a mapping of text to (a number) | `{}` |" in shown


@pytest.mark.parametrize("override,message", [
    ("--optim.betas=[0.9]", r"--optim.betas: expected a list of 2: \(a number\), \(a number\), got 1 value"),
    ("--optim.betas=[0.9, fast]", r"--optim.betas\[1\]: expected a number, got 'fast'"),
    ("--optim.milestones=10", r"--optim.milestones: expected a list of \(a whole number\), got 10"),
    ("--optim.milestones=[1, 2.5]", r"--optim.milestones\[1\]: expected a whole number, got 2.5"),
    ("--optim.lr_by_group=[1, 2]", r"--optim.lr_by_group: expected a mapping of text to \(a number\)"),
    ("--optim.widths=[1, 2", r"--optim.widths: expected a list of \(a whole number\), got '\[1, 2'"),
])
def test_a_bad_element_is_named_by_its_position(override, message):
    with pytest.raises(ConfigError, match=message):
        load_job(OptimJob, None, [override])


@pytest.mark.parametrize("loggers", [["comet"], ["csv", "csv"]])
def test_a_list_setting_takes_each_of_its_choices_at_most_once(loggers):
    with pytest.raises(ValueError, match=r"TrainConfig\.loggers takes each of csv, mlflow, wandb at most once"):
        TrainConfig(loggers=loggers, run_dir="runs")
    assert TrainConfig(loggers=["mlflow", "csv"], run_dir="runs").loggers == ["mlflow", "csv"]


def test_a_bad_setting_is_said_by_rank_zero_alone(capsys, monkeypatch):
    """Every rank reads the same settings: the others exit 2 too, silently."""
    monkeypatch.setenv("OMPI_COMM_WORLD_RANK", "1")
    with pytest.raises(SystemExit) as exit_info:
        parse_job(Job, job_argument_parser(Job, "demo"), ["--train.epochs=x"])
    assert exit_info.value.code == 2
    assert capsys.readouterr().err == ""
    monkeypatch.setenv("OMPI_COMM_WORLD_RANK", "0")
    with pytest.raises(SystemExit) as exit_info:
        parse_job(Job, job_argument_parser(Job, "demo"), ["--train.epochs=x"])
    assert exit_info.value.code == 2 and "--train.epochs: expected a whole number, got 'x'" in capsys.readouterr().err
