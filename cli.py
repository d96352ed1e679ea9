"""One command-line style for every entry point: a dataclass of settings becomes argparse flags.

    @dataclass
    class Args:
        steps: int = 4
        resume: bool = True          # --resume / --no-resume
        no_explore: bool = False     # the switch --no-explore
        def __post_init__(self):
            cli.check(self.steps >= 0, f"--steps must be >= 0, got {self.steps}")

    args = cli.parse(Args, argv, prog="rime.py", description="...")

The rules, the same in rime.py, camg.py and bench.py:
- every field is a `--kebab-case` flag typed by its default; a list field repeats (`--policy a --policy b`);
- a bool that defaults to True is `--x` / `--no-x`; one that defaults to False is a switch `--x`
  (a field named `no_x` is the switch `--no-x`);
- the older spellings still parse for one release: `--snake_case` for `--snake-case`, and
  `--x true|false` for the bool switches (camg.py used both);
- a bad value is one line, `prog: error: ...` (exit 2), before any work starts: the settings'
  `__post_init__` raises `ConfigError` through `check()`, and `parse` turns it into that line.
  Entry points report later failures the same way with `fail()`.
"""

import argparse
import dataclasses
import inspect
import json
import math
import os
import re
import sys


class ConfigError(ValueError):
    """A setting the run cannot start with; the message names the flag and what to change."""


def check(ok, message: str) -> None:
    if not ok:
        raise ConfigError(message)


def fail(prog: str, message: str):
    """The one error style of the entry points: one line on stderr, exit status 2 (as argparse's)."""
    print(f"{prog}: error: {message}", file=sys.stderr)
    sys.exit(2)


def flag(name: str) -> str:
    return "--" + name.replace("_", "-")


def legacy_spellings(argv: list, fields: dict) -> list:
    """Rewrite the older spellings (`--snake_case`, `--switch true|false`) into the current ones."""
    out, i = [], 0
    while i < len(argv):
        arg = argv[i]
        if arg.startswith("--") and "_" in arg.split("=", 1)[0]:
            name, eq, value = arg[2:].partition("=")
            if name in fields:
                arg = flag(name) + eq + value
        name = arg[2:].split("=", 1)[0].replace("-", "_") if arg.startswith("--") else ""
        f = fields.get(name)
        if f is not None and f.type in (bool, "bool"):
            value = arg.split("=", 1)[1] if "=" in arg else (argv[i + 1] if i + 1 < len(argv) else "")
            if "=" not in arg and value and not value.startswith("-") and value.lower() not in ("true", "false", "1", "0"):
                raise ConfigError(f"{flag(name)} is a switch and takes no value (the old spelling takes "
                                  f"true or false), got {value!r}")
            if value.lower() in ("true", "false", "1", "0"):
                on = value.lower() in ("true", "1")
                i += 1 if "=" in arg else 2
                if name.startswith("no_"):            # --no-x false == the switch left off
                    out += [flag(name)] if on else []
                else:
                    out.append(flag(name) if on else "--no-" + name.replace("_", "-"))
                continue
        out.append(arg)
        i += 1
    return out


def _field_comments(cls) -> dict:
    """The trailing `# comment` of each `name: type = default` line of a dataclass: its help text."""
    try:
        source = inspect.getsource(cls)
    except (OSError, TypeError):
        return {}
    found = (re.match(r"\s+(\w+)\s*:[^=]*=[^#]*#\s*(.*)$", line) for line in source.splitlines())
    return {m.group(1): m.group(2).strip() for m in found if m}


def parser_for(cls, prog: str, description: str = "") -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(prog=prog, description=description,
                                formatter_class=argparse.RawDescriptionHelpFormatter)
    comments = _field_comments(cls)
    for f in dataclasses.fields(cls):
        default = f.default if f.default is not dataclasses.MISSING else f.default_factory()
        helptext = f.metadata.get("help", comments.get(f.name, "")).replace("%", "%%")
        if isinstance(default, bool) and default and not f.name.startswith("no_"):
            p.add_argument(flag(f.name), action=argparse.BooleanOptionalAction, default=True, help=helptext)
        elif isinstance(default, bool):
            # store_true, not BooleanOptionalAction: that one reads a flag spelled "--no-x" as False
            p.add_argument(flag(f.name), action="store_true", help=helptext)
        elif isinstance(default, list):
            p.add_argument(flag(f.name), action="append", default=None, help=helptext)
        else:       # a float field whose default is written as an int (-1) still takes 0.7
            kind = float if f.type in (float, "float") else type(default)
            p.add_argument(flag(f.name), type=kind, default=default, metavar=f.name.upper(),
                           help=f"{helptext} (default {default})".strip())
    return p


def parse(cls, argv=None, prog: str = None, description: str = ""):
    """argv -> an instance of the dataclass `cls`, or exit with one `prog: error: ...` line."""
    prog = prog or os.path.basename(sys.argv[0])
    argv = sys.argv[1:] if argv is None else list(argv)
    fields = {f.name: f for f in dataclasses.fields(cls)}
    p = parser_for(cls, prog, description)
    try:
        values = {k: v for k, v in vars(p.parse_args(legacy_spellings(argv, fields))).items() if v is not None}
        return cls(**values)
    except ConfigError as e:     # one line, no usage dump: the message says which flag and why
        p.exit(2, f"{prog}: error: {e}\n")


# ----------------------------------------------------------------------------- shared checks

def check_number(name: str, value, lo=None, hi=None, lo_open=False) -> None:
    """A finite number inside [lo, hi] ((lo, hi] with lo_open), or a ConfigError naming the flag."""
    ok = isinstance(value, (int, float)) and math.isfinite(value)
    ok = ok and (lo is None or (value > lo if lo_open else value >= lo)) and (hi is None or value <= hi)
    where = f"{'(' if lo_open else '['}{'-inf' if lo is None else lo}, {'inf' if hi is None else hi}]"
    check(ok, f"{flag(name)} must be a number in {where}, got {value!r}")


def check_model_dir(path: str, option: str = "--model") -> None:
    """An HF checkpoint directory the loaders can read: config.json (a JSON object naming its
    model_type) and weights (*.safetensors or a GGUF file). Checked before a run writes anything."""
    check(os.path.isdir(path), f"{option} {path!r}: no such directory")
    config = os.path.join(path, "config.json")
    check(os.path.isfile(config), f"{option} {path!r}: no config.json (not a Hugging Face checkpoint directory)")
    try:
        with open(config) as f:
            data = json.load(f)
    except (OSError, ValueError) as e:
        raise ConfigError(f"{option} {path!r}: config.json is not valid JSON ({e})") from None
    check(isinstance(data, dict) and "model_type" in data, f"{option} {path!r}: config.json names no model_type")
    weights = [n for n in os.listdir(path) if n.endswith((".safetensors", ".gguf", ".bin"))]
    check(weights, f"{option} {path!r}: no weights (*.safetensors) in the directory")


def json_safe(obj):
    """NaN and infinities become None (JSON null): `json.dumps` would write NaN, which is not JSON."""
    if isinstance(obj, float) and not math.isfinite(obj):
        return None
    if isinstance(obj, dict):
        return {k: json_safe(v) for k, v in obj.items()}
    if isinstance(obj, (list, tuple)):
        return [json_safe(v) for v in obj]
    if hasattr(obj, "item") and callable(obj.item) and getattr(obj, "ndim", 1) == 0:   # numpy / torch scalars
        return json_safe(obj.item())
    return obj


def dumps(obj, **kw) -> str:
    """json.dumps that writes null for NaN; other numbers (numpy, torch scalars) become floats."""
    return json.dumps(json_safe(obj), allow_nan=False, default=lambda o: json_safe(float(o)), **kw)


def health_line(row: dict, fields) -> str:
    """The one formatter for a metrics row on the terminal (rime.py's and camg.py's progress lines):
    fields = [(label, key, format spec)]; a missing or None value prints nan."""
    def cell(key, spec):
        v = row.get(key)
        return format(float("nan") if v is None else v, spec)
    return " ".join(f"{label} {cell(key, spec)}" for label, key, spec in fields)
