"""From YAML and `--set section.key=value` overrides to a typed `Config`.

Unknown keys are an error that names the nearest valid key; type and choice errors name the
dotted field and the value given. `describe_options` is the body of `plait train --help`.
"""

from __future__ import annotations

import copy
import difflib
import functools
import os
from pathlib import Path
from typing import Any

import yaml
from pydantic import BaseModel, ValidationError

from plait.config.schema import ENVIRONMENT_TYPES, Config, ConfigError, default_rewards, type_tag
from plait.config.trl_names import trl_option


def did_you_mean(name: str, choices: list[str]) -> str:
    near = difflib.get_close_matches(name, choices, n=1, cutoff=0.5)
    return f" Did you mean '{near[0]}'?" if near else f" Valid keys: {', '.join(sorted(choices))}."


def _models_in(ann: Any) -> list[type[BaseModel]]:
    """The pydantic classes an annotation holds, through list[...], X | None, Annotated[...] and
    unions (several: a union of entry types, told apart by their `type`)."""
    if isinstance(ann, type):
        return [ann] if issubclass(ann, BaseModel) else []
    return [m for arg in getattr(ann, "__args__", ()) for m in _models_in(arg)]


def _model_for(models: list[type[BaseModel]], value: Any) -> type[BaseModel] | None:
    """Of a field's models (`_models_in`), the one `value` is validated as: of a union of entry
    types the one its `type` names; None for a leaf or a type no entry has (validation names it)."""
    if len(models) > 1:
        tag = value.get("type") if isinstance(value, dict) else None
        return next((m for m in models if type_tag(m) == tag), None)
    return models[0] if models else None


def _elsewhere(model: type[BaseModel], key: str, where: str, siblings: list[type[BaseModel]]) -> str | None:
    """An entry's key that belongs to another type of entry, said as such."""
    owners = [type_tag(m) for m in siblings if m is not model and key in m.model_fields]
    if not owners:
        return None
    return (
        f"`{key}` is for environments of type {' and '.join(owners)}, not {type_tag(model)}{model.ELSEWHERE} "
        f"('{where}'): remove it"
    )


def known_only(
    raw: Any, model: type[BaseModel] = Config, prefix: str = "", siblings: list[type[BaseModel]] = ()
) -> tuple[Any, list[str]]:
    """`raw` without the keys `model` does not have, and a problem for each of them with the
    nearest valid name (or, for an entry of a union, the type it belongs to)."""
    if not isinstance(raw, dict):
        return raw, []
    kept: dict = {}
    problems: list[str] = []
    for key, value in raw.items():
        where = f"{prefix}{key}"
        refused = getattr(model, "REFUSED_KEYS", {}).get(key)
        if refused:
            problems.append(f"'{where}' is not an option: {refused}; remove it")
            continue
        if key not in model.model_fields:
            other = _elsewhere(model, key, where, siblings)
            problems.append(other or f"unknown key '{where}'.{_hint(model, str(key), prefix)}")
            continue
        models = _models_in(model.model_fields[key].annotation)
        if isinstance(value, list) and models:
            pairs = [
                known_only(item, sub, f"{where}.{i}.", models) if (sub := _model_for(models, item)) else (item, [])
                for i, item in enumerate(value)
            ]
            value = [item for item, _ in pairs]
            problems += [p for _, found in pairs for p in found]
        elif (sub := _model_for(models, value)) is not None:
            value, found = known_only(value, sub, f"{where}.", models)
            problems += found
        kept[key] = value
    return kept, problems


def _hint(model: type[BaseModel], key: str, prefix: str) -> str:
    """What an unknown key most likely meant: plait's name for a key other trainers use
    (`data.train_files` is `data.path`), an option of another section (`train.temperature` is
    `rollout.temperature`), else the nearest name in its own section."""
    alias = getattr(model, "SYNONYMS", {}).get(key)
    if alias:
        return f" plait calls it '{prefix}{alias}'."
    homes = [p for p in option_paths().get(key, []) if p != f"{prefix}{key}"]
    if homes and difflib.get_close_matches(key, list(model.model_fields), n=1, cutoff=0.8) == []:
        where = "another section" if prefix else "a section"
        return f" It belongs to {where}: {' or '.join(repr(h) for h in homes[:3])}."
    trl = trl_option(key) if not homes else None
    return f" {trl}." if trl else did_you_mean(key, list(model.model_fields))


@functools.cache
def option_paths() -> dict[str, list[str]]:
    """Each option's name -> the dotted paths of the sections that have it (nested sections,
    not the entries of lists such as rewards)."""
    found: dict[str, list[str]] = {}

    def walk(model: type[BaseModel], prefix: str) -> None:
        for name, field in model.model_fields.items():
            found.setdefault(name, []).append(f"{prefix}{name}")
            models = _models_in(field.annotation)
            if len(models) == 1 and getattr(field.annotation, "__origin__", None) is not list:
                walk(models[0], f"{prefix}{name}.")

    walk(Config, "")
    return found


def unknown_keys(raw: Any, model: type[BaseModel] = Config, prefix: str = "") -> list[str]:
    """Every key in `raw` that `model` does not have, with the nearest valid name."""
    return known_only(raw, model, prefix)[1]


def apply_override(raw: dict, dotted: str) -> None:
    """Apply one `a.b.c=value` override in place; the value is parsed as YAML."""
    if "=" not in dotted:
        raise ConfigError([f"override '{dotted}' must look like section.key=value"])
    path, _, text = dotted.partition("=")
    try:
        value = yaml.safe_load(text) if text.strip() else None
    except yaml.YAMLError as err:
        what = " ".join(x for x in (getattr(err, "context", None), getattr(err, "problem", None)) if x) or str(err)
        raise ConfigError(
            [
                f"override '{dotted}': the value is read as YAML and is not valid YAML ({what}); quote it as a string "
                f"(--set '{path}=\"...\"') or fix its brackets"
            ]
        ) from None
    keys = path.strip().split(".")
    node: Any = raw
    for i, key in enumerate(keys[:-1]):
        nxt = keys[i + 1]
        if isinstance(node, list):
            node = node[int(key)]
            continue
        if key not in node or node[key] is None:
            # materialise the default so e.g. --set rewards.0.weight=2 edits the default list
            if i == 0 and key == "rewards":
                node[key] = [r.model_dump() for r in default_rewards()]
            else:
                node[key] = [] if nxt.isdigit() else {}
        node = node[key]
    last = keys[-1]
    if isinstance(node, list):
        node[int(last)] = value
    else:
        node[last] = value


def _format_validation_error(err: ValidationError) -> list[str]:
    out = []
    for e in err.errors():
        # (an entry of a union of types is located by its type too: environments.0.trl_env.factory)
        loc = ".".join(
            str(p) for p in e["loc"] if not str(p).startswith(("function-", "literal")) and p not in ENVIRONMENT_TYPES
        )
        got = e.get("input")
        shown = "" if isinstance(got, dict) else f" (got {got!r})"
        if e["type"] == "string_type" and isinstance(got, (dict, list)):  # "a: b" or "[x]" read as YAML
            kind = "a mapping" if isinstance(got, dict) else "a list"
            shown = f" (the text was read as YAML, which made it {kind}: put it in quotes)"
        out.append(f"{loc}: {e['msg']}{shown}")
    return out


class _UniqueKeyLoader(yaml.SafeLoader):
    """SafeLoader that refuses a key given twice in one mapping: YAML keeps the last one, so a
    second `train:` section would silently replace the first."""

    def construct_mapping(self, node, deep=False):
        seen: set = set()
        for key_node, _ in node.value:
            key = self.construct_object(key_node, deep=deep)
            if key in seen:
                raise yaml.constructor.ConstructorError(
                    None, None, f"'{key}' is given twice (the second would replace the first)", key_node.start_mark
                )
            seen.add(key)
        return super().construct_mapping(node, deep=deep)


def read_yaml(path: Path) -> Any:
    """The YAML file's data; a syntax error or a key given twice names the file, line and column
    (1-based)."""
    try:
        return yaml.load(path.read_text(), Loader=_UniqueKeyLoader) or {}
    except yaml.YAMLError as err:
        mark = getattr(err, "problem_mark", None)
        where = f"{path}:{mark.line + 1}:{mark.column + 1}" if mark is not None else str(path)
        what = " ".join(x for x in (getattr(err, "context", None), getattr(err, "problem", None)) if x) or str(err)
        raise ConfigError([f"{where}: not valid YAML: {what}"]) from None


def load_config(path: str | os.PathLike | None = None, overrides: list[str] | None = None) -> Config:
    """Read YAML (or nothing: the built-in defaults), apply overrides, type-check it all."""
    raw: dict = {}
    if path is not None:
        p = Path(path)
        if not p.is_file():
            raise ConfigError([f"config file '{path}' does not exist"])
        raw = read_yaml(p)
        if not isinstance(raw, dict):
            raise ConfigError([f"config file '{path}' must hold a mapping at the top level"])
    return config_from_dict(raw, overrides)


def config_from_dict(raw: dict, overrides: list[str] | None = None) -> Config:
    """A config from its (YAML-shaped) data and `--set` overrides, type-checked."""
    raw = copy.deepcopy(raw)
    for ov in overrides or []:
        apply_override(raw, ov)
    known, unknown = known_only(raw)
    try:
        cfg = Config.model_validate(known)
    except ValidationError as err:
        rest, replaced = _with_defaults_for(known, err)
        raise ConfigError(unknown + _format_validation_error(err), config=rest, replaced=replaced) from None
    if unknown:
        raise ConfigError(unknown, config=cfg)
    return cfg


def _with_defaults_for(known: dict, err: ValidationError) -> tuple[Config | None, tuple[str, ...]]:
    """The config with each single value `err` refused left at its default, and those values'
    dotted names: so the checks that come after validation can still run and be reported in the
    same pass. None where that would not be the config the user wrote but for those values (a
    whole section or list entry refused, a required value missing)."""
    raw, replaced = copy.deepcopy(known), []
    for e in err.errors():
        parent, key, node, names = None, None, raw, []
        for part in e["loc"]:  # through the data; a union's type tags in the path are not keys
            in_dict = isinstance(node, dict) and part in node
            if in_dict or (isinstance(node, list) and isinstance(part, int) and 0 <= part < len(node)):
                parent, key, node = node, part, node[part]
                names.append(str(part))
        if not isinstance(parent, dict) or isinstance(node, (dict, list)):
            return None, ()
        del parent[key]
        replaced.append(".".join(names))
    try:
        return Config.model_validate(raw), tuple(replaced)
    except ValidationError:
        return None, ()


def with_overrides(cfg: Config, overrides: list[str]) -> Config:
    """A copy of `cfg` with `--set`-style overrides applied (e.g. the ones `plait plan --auto` chose)."""
    raw = cfg.model_dump(mode="json")
    for ov in overrides:
        apply_override(raw, ov)
    try:
        return Config.model_validate(raw)
    except ValidationError as err:
        raise ConfigError(_format_validation_error(err)) from None


def describe_options(model: type[BaseModel] = Config, prefix: str = "") -> list[tuple[str, str, str]]:
    """(dotted name, default, meaning) for every option: the body of `plait train --help`."""
    rows = []
    for name, field in model.model_fields.items():
        models = _models_in(field.annotation)
        if len(models) > 1:  # a union of entry types: each one's options
            rows += [row for m in models for row in describe_options(m, f"{prefix}{name}[type={type_tag(m)}].")]
            continue
        if models and name != "rewards" and name != "lora":
            rows += describe_options(models[0], f"{prefix}{name}.")
            continue
        if field.is_required():
            rows.append((f"{prefix}{name}", "(required)", field.description or ""))
            continue
        default = field.get_default(call_default_factory=True)
        if isinstance(default, list) and default and isinstance(default[0], BaseModel):
            default = [d.model_dump(exclude_defaults=True) for d in default]
        rows.append((f"{prefix}{name}", repr(default), field.description or ""))
    return rows
