"""A job's settings: a dataclass of sections (``train`` is hvdtrain's TrainConfig, the script adds its
own), filled from the defaults, then a YAML file, then ``--section.key=value`` overrides.

A setting is a whole number, a number, true/false, text, or a list (``List[float]``), a tuple
(``Tuple[float, float]``, ``Tuple[int, ...]``) or a mapping (``Dict[str, float]``) of them: in YAML
as YAML writes them, on the command line in YAML's flow style (``--optim.betas=[0.9,0.95]``).

An unknown section or key, or a value of the wrong type, is an error naming the key, where it came
from and what is accepted; nothing is silently ignored.
"""
from __future__ import annotations

import argparse
import dataclasses
import difflib
import typing
from pathlib import Path
from typing import Any, Dict, List, Optional, Sequence, Tuple

import yaml

from hvdtrain.common.errors import REFUSED_EXIT_CODE, HvdtrainError, launcher_rank
from hvdtrain.config.other_names import other_name_hint

_NONE_WORDS = {"none", "null", "~", ""}
_TRUE_WORDS = {"true", "yes", "on", "1"}
_FALSE_WORDS = {"false", "no", "off", "0"}


class ConfigError(HvdtrainError, ValueError):
    """A setting that cannot be used; the message names it and says what is accepted."""


def sections(job_cls: type) -> Dict[str, type]:
    """Section name -> section dataclass, in declaration order."""
    hints = typing.get_type_hints(job_cls)
    return {f.name: hints[f.name] for f in dataclasses.fields(job_cls)}


def section_keys(section_cls: type) -> Dict[str, Any]:
    """Key -> type hint of one section."""
    hints = typing.get_type_hints(section_cls)
    return {f.name: hints[f.name] for f in dataclasses.fields(section_cls)}


def _suggest(word: str, choices: Sequence[str]) -> str:
    close = difflib.get_close_matches(word, choices, n=1)
    hint = f" (did you mean {close[0]}?)" if close else ""
    return f"{hint}; valid: {', '.join(choices)}"


def _type_name(hint: Any) -> str:
    origin, args = typing.get_origin(hint), typing.get_args(hint)
    if origin is typing.Union:
        inner = [a for a in args if a is not type(None)]
        return f"{_type_name(inner[0])} or null"
    if origin is list or (origin is tuple and len(args) == 2 and args[1] is Ellipsis):
        return f"a list of ({_type_name(args[0])})"
    if origin is tuple:
        return f"a list of {len(args)}: " + ", ".join(f"({_type_name(a)})" for a in args)
    if origin is dict:
        return f"a mapping of text to ({_type_name(args[1])})"
    return {int: "a whole number", float: "a number", bool: "true or false", str: "text"}.get(hint, str(hint))


def _coerce_container(value: Any, hint: Any, where: str) -> Any:
    """A list, tuple or mapping setting: each element as its type asks, named by its position."""
    origin, args = typing.get_origin(hint), typing.get_args(hint)
    if isinstance(value, str):  # from the command line: YAML's flow style, [0.9, 0.95] or {a: 1}
        try:
            value = yaml.safe_load(value)
        except yaml.YAMLError as error:
            raise ConfigError(f"{where}: expected {_type_name(hint)}, got {value!r} ({error.problem})") from None
    if origin is dict:
        if not isinstance(value, dict):
            raise ConfigError(f"{where}: expected {_type_name(hint)}, got {value!r}")
        return {coerce(key, args[0], f"{where} key {key!r}"): coerce(item, args[1], f"{where}.{key}")
                for key, item in value.items()}
    if not isinstance(value, (list, tuple)):
        raise ConfigError(f"{where}: expected {_type_name(hint)}, got {value!r}")
    if origin is list or args[1:] == (Ellipsis,):
        items = [coerce(item, args[0], f"{where}[{index}]") for index, item in enumerate(value)]
        return items if origin is list else tuple(items)
    if len(value) != len(args):
        raise ConfigError(f"{where}: expected {_type_name(hint)}, got {len(value)} value(s): {value!r}")
    return tuple(coerce(item, arg, f"{where}[{index}]") for index, (item, arg) in enumerate(zip(value, args)))


def coerce(value: Any, hint: Any, where: str) -> Any:
    """``value`` (from YAML, or text from the command line) as the type ``hint`` asks for."""
    optional = typing.get_origin(hint) is typing.Union
    base = next(a for a in typing.get_args(hint) if a is not type(None)) if optional else hint
    if isinstance(value, str) and optional and value.strip().lower() in _NONE_WORDS:
        return None  # `--train.run_dir=null` on a command line, as in YAML
    if typing.get_origin(base) in (list, tuple, dict):
        return None if value is None and optional else _coerce_container(value, base, where)
    if isinstance(value, str) and base is not str:
        value = _from_text(value, base, optional, where)
    if value is None:
        if optional:
            return None
        raise ConfigError(f"{where}: expected {_type_name(hint)}, got null")
    if base is bool and isinstance(value, bool):
        return value
    if base is int and isinstance(value, int) and not isinstance(value, bool):
        return value
    if base is float and isinstance(value, (int, float)) and not isinstance(value, bool):
        return float(value)
    if base is str and isinstance(value, bool):  # YAML's true/false for a setting of words (train.resume)
        return "true" if value else "false"
    if base is str and isinstance(value, (str, int, float)):
        return str(value)
    raise ConfigError(f"{where}: expected {_type_name(hint)}, got {value!r}")


def _from_text(text: str, base: type, optional: bool, where: str) -> Any:
    word = text.strip().lower()
    try:
        if base is bool:
            if word in _TRUE_WORDS | _FALSE_WORDS:
                return word in _TRUE_WORDS
            raise ValueError
        if base is int:
            return int(text)
        if base is float:
            return float(text)
    except ValueError:
        raise ConfigError(f"{where}: expected {_type_name(base)}, got {text!r}") from None
    return text


def _read_yaml(path: Path) -> Dict[str, Any]:
    if not path.is_file():
        raise ConfigError(f"config file {path} does not exist: check the path (examples are in configs/)")
    try:
        data = yaml.safe_load(path.read_text())
    except yaml.YAMLError as error:
        raise ConfigError(f"{path} is not valid YAML: {error}") from None
    if data is None:
        return {}
    if not isinstance(data, dict):
        raise ConfigError(f"{path}: the top level must be sections (train:, model:, ...), "
                          f"got {type(data).__name__}")
    return data


def _section(job_cls: type, section: str, where: str) -> type:
    known = sections(job_cls)
    if section not in known:
        raise ConfigError(f"{where}: unknown section {section!r}{_suggest(section, list(known))}")
    return known[section]


def _lookup(job_cls: type, section: str, key: str, where: str) -> Any:
    keys = section_keys(_section(job_cls, section, where))
    if key not in keys:
        other = other_name_hint(key)
        if other:
            raise ConfigError(f"{where}: unknown key {section}.{key}: {other}")
        raise ConfigError(f"{where}: unknown key {section}.{key}"
                          f"{_suggest(key, list(keys))} (in section {section})")
    return keys[key]


def parse_overrides(job_cls: type, argv: Sequence[str]) -> List[Tuple[str, str, str]]:
    """``--section.key=value`` / ``--section.key value`` / ``--key value`` -> (section, key, text).

    A bare ``--key`` is accepted when exactly one section has that key (``--epochs 20`` is
    ``--train.epochs=20``); a boolean key given without a value means true.
    """
    parsed: List[Tuple[str, str, str]] = []
    index = 0
    while index < len(argv):
        token = argv[index]
        if not token.startswith("--") or token == "--":
            raise ConfigError(f"unexpected argument {token!r}: settings are --section.key=value "
                              f"(e.g. --train.lr=0.05); see --help for every key")
        name, has_value, text = token[2:].partition("=")
        section, key = _resolve_name(job_cls, name.replace("-", "_"), token)
        hint = _lookup(job_cls, section, key, token)
        if not has_value:
            following = argv[index + 1] if index + 1 < len(argv) else None
            if following is None or following.startswith("--"):
                if hint is not bool:
                    raise ConfigError(f"{token}: needs a value ({_type_name(hint)})")
                text = "true"
            else:
                text = following
                index += 1
        parsed.append((section, key, text))
        index += 1
    return parsed


def _resolve_name(job_cls: type, name: str, token: str) -> Tuple[str, str]:
    if "." in name:
        section, _, key = name.partition(".")
        return section, key
    owners = [s for s, cls in sections(job_cls).items() if name in section_keys(cls)]
    if len(owners) == 1:
        return owners[0], name
    if owners:
        raise ConfigError(f"{token} is in several sections ({', '.join(owners)}): "
                          f"write --{owners[0]}.{name}=...")
    other = other_name_hint(name)
    if other:
        raise ConfigError(f"unknown setting {token}: {other}")
    every = [f"{s}.{k}" for s, cls in sections(job_cls).items() for k in section_keys(cls)]
    # A bare name is spelled against the bare keys too: "epoch" is too far from "train.epochs" by letters.
    bare = {k: f"{s}.{k}" for s, cls in sections(job_cls).items() for k in section_keys(cls)}
    close = difflib.get_close_matches(name, list(bare), n=1)
    if close:
        raise ConfigError(f"unknown setting {token} (did you mean --{bare[close[0]]}?); valid: {', '.join(every)}")
    raise ConfigError(f"unknown setting {token}{_suggest(name, every)}")


def load_job(job_cls: type, path: Optional[str] = None, overrides: Sequence[str] = ()) -> Any:
    """Defaults, then the YAML file at ``path``, then the command-line ``overrides``."""
    values: Dict[str, Dict[str, Any]] = {name: {} for name in sections(job_cls)}
    if path:
        for section, entries in _read_yaml(Path(path)).items():
            where = f"{path}: {section}"
            _section(job_cls, section, str(path))
            if not isinstance(entries, dict):
                raise ConfigError(f"{where}: a section holds key: value lines, got {entries!r}")
            for key, value in entries.items():
                hint = _lookup(job_cls, section, str(key), f"{path}")
                values[section][key] = coerce(value, hint, f"{path}: {section}.{key}")
    for section, key, text in parse_overrides(job_cls, overrides):
        hint = _lookup(job_cls, section, key, f"--{section}.{key}")
        values[section][key] = coerce(text, hint, f"--{section}.{key}")

    defaults = job_cls()
    built = {}
    for section in values:
        try:
            built[section] = dataclasses.replace(getattr(defaults, section), **values[section])
        except ValueError as error:
            raise ConfigError(f"section {section}: {error}") from None
    return job_cls(**built)


def to_dict(job: Any) -> Dict[str, Any]:
    """The job as plain values (tuples as lists: YAML and JSON have lists)."""
    return _plain(dataclasses.asdict(job))


def _plain(value: Any) -> Any:
    if isinstance(value, dict):
        return {key: _plain(item) for key, item in value.items()}
    if isinstance(value, (list, tuple)):
        return [_plain(item) for item in value]
    return value


def to_yaml(job: Any) -> str:
    """The resolved configuration, loadable again with ``load_job``."""
    return yaml.safe_dump(to_dict(job), sort_keys=False, default_flow_style=False)


def reference(job_cls: type, skip: Sequence[str] = ()) -> str:
    """Every section (but ``skip``) and key with its type, default and meaning, as Markdown tables.

    A key's ``help`` (its metadata) is its meaning in the table, short enough for one screen; its
    ``details``, when it has them, follow the table, one item per key."""
    defaults = job_cls()
    out: List[str] = []
    for name, cls in sections(job_cls).items():
        if name in skip:
            continue
        doc = (cls.__doc__ or "").strip().splitlines()[0] if cls.__doc__ else ""
        out += [f"**`{name}`**: {doc}", "", "| key | type | default | meaning |", "|---|---|---|---|"]
        section_default = getattr(defaults, name)
        details = [f"- `{name}.{f.name}`: {f.metadata['details']}"
                   for f in dataclasses.fields(cls) if f.metadata.get("details")]
        for f in dataclasses.fields(cls):
            hint = section_keys(cls)[f.name]
            default = getattr(section_default, f.name)
            shown = yaml.safe_dump(_plain(default), default_flow_style=True).strip().removesuffix("...").strip()
            meaning = f.metadata.get("help", "")
            choices = f.metadata.get("choices")
            if choices:
                meaning += f" (one of: {', '.join(choices)})"
            out.append(f"| `{f.name}` | {_type_name(hint)} | `{shown}` | {meaning} |")
        out.append("")
        if details:
            out += [f"More on the `{name}` keys:", "", *details, ""]
    return "\n".join(out)


def job_argument_parser(job_cls: type, description: str) -> argparse.ArgumentParser:
    """A script's parser: --config, --print-config, and every setting listed in --help."""
    defaults = job_cls()
    listing = [f"  --{s}.{k}={getattr(getattr(defaults, s), k)!r}"
               for s, cls in sections(job_cls).items() for k in section_keys(cls)]
    parser = argparse.ArgumentParser(
        description=description, allow_abbrev=False,
        formatter_class=argparse.RawDescriptionHelpFormatter,
        epilog="settings (defaults shown; set them in the --config file or as --section.key=value;\n"
               "a key found in one section only may be given bare, e.g. --epochs 20):\n" + "\n".join(listing),
    )
    parser.add_argument("--config", metavar="FILE", help="YAML file of settings (examples in configs/)")
    parser.add_argument("--print-config", action="store_true", help="print the resolved settings and exit")
    return parser


def parse_job(job_cls: type, parser: argparse.ArgumentParser,
              argv: Optional[Sequence[str]] = None) -> Tuple[Any, argparse.Namespace]:
    """(the job's settings, the script's own options); a bad setting exits 2 with its reason, said
    by rank 0 alone (every rank reads the same settings, before Horovod starts)."""
    args, rest = parser.parse_known_args(argv)
    try:
        job = load_job(job_cls, args.config, rest)
    except ConfigError as error:
        if launcher_rank() != 0:
            parser.exit(REFUSED_EXIT_CODE)
        parser.error(str(error))
    if args.print_config:
        print(to_yaml(job), end="")
        parser.exit(0)
    return job, args
