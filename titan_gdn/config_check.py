"""Check a training TOML's section and key names before torchtitan parses it.

torchtitan rejects an unknown name with ``Invalid field names in <class 'types.MergedTraining'>``
deep in a traceback: no file, no section, no suggestion. This check reads the same TOML first,
against the same JobConfig class torchtitan will build (its own merged with the config's
``[job] custom_config_module``), and stops with one line per unknown name, for example::

    train_configs/debug_model.toml: [training] has no key "seq_lenn"; did you mean "seq_len"?

Only the TOML is checked: torchtitan's command-line parser reports bad overrides itself.
"""

from __future__ import annotations

import difflib
import importlib
import os
import tomllib
import types
import typing
from dataclasses import fields, is_dataclass
from typing import Any

# torchtitan's spellings (config/manager.py, ConfigManager._maybe_load_toml and
# _maybe_add_custom_config), so that this check reads the file and module torchtitan will.
CONFIG_FILE_FLAGS = ("--job.config_file", "--job.config-file")
CUSTOM_MODULE_FLAGS = ("--job.custom_config_module", "--job.custom-config-module")


def flag_value(args: list[str], flags: tuple[str, ...]) -> str | None:
    """The value of the first of `flags` in `args`, written ``--flag value`` or ``--flag=value``
    (torchtitan accepts both)."""
    for i, arg in enumerate(args):
        name, equals, value = arg.partition("=")
        if name in flags:
            if equals:
                return value
            if i + 1 < len(args):
                return args[i + 1]
    return None


def load_toml(path: str) -> dict[str, Any]:
    """The TOML at `path`; a missing or malformed file stops here with its name and the reason,
    instead of torchtitan's traceback."""
    try:
        with open(path, "rb") as file:
            return tomllib.load(file)
    except FileNotFoundError:
        where = "" if os.path.isabs(path) else f" in the working directory {os.getcwd()}"
        raise SystemExit(
            f"{path}: config file not found{where} (CONFIG_FILE or --job.config_file; the "
            "shipped configs are in the checkout's train_configs/, run from its root)"
        ) from None
    except tomllib.TOMLDecodeError as error:
        raise SystemExit(f"{path}: not valid TOML: {error}") from None


def job_config_class(args: list[str], toml_values: dict[str, Any]) -> type:
    """The JobConfig class torchtitan will parse into: its own, merged (by torchtitan's
    ConfigManager._merge_configs) with the custom config module's JobConfig when the command
    line or the TOML's [job] section names one (the command line first, as torchtitan does).
    Built at run time, so fields added to that module are picked up."""
    from torchtitan.config import ConfigManager, JobConfig

    module_path = flag_value(args, CUSTOM_MODULE_FLAGS)
    job_section = toml_values.get("job", {})
    if not module_path and isinstance(job_section, dict):
        module_path = job_section.get("custom_config_module")
    if not module_path:
        return JobConfig
    try:
        custom = importlib.import_module(module_path).JobConfig
    except (ImportError, AttributeError) as error:
        raise SystemExit(
            f"job.custom_config_module = {module_path!r} cannot be used ({error}); name an "
            'importable module that defines JobConfig, e.g. "titan_gdn.job_config"'
        ) from None
    return ConfigManager._merge_configs(JobConfig, custom)


def suggestion(name: str, valid_names: list[str], quote: str) -> str:
    """'; did you mean "x"?' for the closest valid name, or the list of valid names when none is
    close: a typo then reads as a typo, and a wrong guess shows what exists."""
    close = difflib.get_close_matches(name, valid_names, n=1)
    if close:
        return f"; did you mean {quote.format(close[0])}?"
    return f" (valid: {', '.join(quote.format(valid) for valid in sorted(valid_names))})"


def unknown_names(config_class: type, values: dict[str, Any], section: str = "") -> list[str]:
    """One message per name in `values` (the TOML table `section`; "" for the file's top level)
    that `config_class` has no field for, or whose value has the wrong type, descending into
    tables whose field is itself a dataclass, as torchtitan's ConfigManager._dict_to_dataclass
    does."""
    names = [f.name for f in fields(config_class)]
    field_types = typing.get_type_hints(config_class)
    problems = []
    for name, value in values.items():
        if name not in names:
            problems.append(unknown_name_message(name, names, section))
            continue
        expected = field_types[name]
        if is_dataclass(expected) and isinstance(value, dict):
            subsection = f"{section}.{name}" if section else name
            problems += unknown_names(expected, value, subsection)
        elif (wanted := type_mismatch(value, expected)) is not None:
            # torchtitan takes the TOML's values as they are: a quoted "false" is true.
            problems.append(f"[{section}] {name} = {value!r} should be {wanted}")
    return problems


_TYPE_NAMES = {
    bool: "true or false (unquoted)",
    int: "an integer",
    float: "a number",
    str: "a string",
}


def type_mismatch(value: Any, expected: Any) -> str | None:
    """What `value` (as TOML gives it) should be to fit the annotation `expected`, or None when
    it fits or the annotation is not a plain one (a dataclass, a dict, ...)."""
    origin, arms = typing.get_origin(expected), typing.get_args(expected)
    if origin is typing.Literal:
        return None if value in arms else "one of " + ", ".join(repr(arm) for arm in arms)
    if origin in (typing.Union, types.UnionType):
        wanted = [type_mismatch(value, arm) for arm in arms if arm is not type(None)]
        return None if None in wanted else " or ".join(wanted)
    if origin is list:
        return None if isinstance(value, list) else "a list ([...])"
    if expected is float:
        fits = isinstance(value, int | float) and not isinstance(value, bool)
    elif expected is int:
        fits = isinstance(value, int) and not isinstance(value, bool)
    elif expected in (bool, str):
        fits = isinstance(value, expected)
    else:
        return None
    return None if fits else _TYPE_NAMES[expected]


def unknown_name_message(name: str, valid_names: list[str], section: str) -> str:
    """The message for one unknown name: a section at the top level, a key inside a section."""
    if not section:
        return f"unknown section [{name}]" + suggestion(name, valid_names, "[{}]")
    return f'[{section}] has no key "{name}"' + suggestion(name, valid_names, '"{}"')


def config_file_problems(path: str, args: list[str]) -> list[str]:
    """Every unknown section or key in the TOML at `path`, each prefixed with the file name."""
    toml_values = load_toml(path)
    config_class = job_config_class(args, toml_values)
    return [f"{path}: {problem}" for problem in unknown_names(config_class, toml_values)]


def check_config_file(args: list[str]) -> None:
    """Stop (exit status 1, one line per problem, no traceback) when the config file named in
    `args` has unknown sections or keys; do nothing when `args` names no config file."""
    path = flag_value(args, CONFIG_FILE_FLAGS)
    if path is None:
        return
    problems = config_file_problems(path, args)
    if problems:
        raise SystemExit("\n".join(problems))
