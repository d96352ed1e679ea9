"""What bench.py and speed.py share: the flags of a subcommand and the markdown table they print.

A module of its own so that neither program imports the other (an entry point is imported by none).
"""

import argparse


def flags(args: list, prog: str, **defaults):
    """argparse for a subcommand (prog: e.g. "speed.py engine"): --name-with-dashes per keyword, typed by its
    default; False is a switch, a tuple lists the choices (the first is the default). The subcommand's
    docstring says what they do."""
    p = argparse.ArgumentParser(prog=prog)
    for name, d in defaults.items():
        flag = "--" + name.replace("_", "-")
        if d is False:
            p.add_argument(flag, action="store_true")
        elif isinstance(d, tuple):
            p.add_argument(flag, choices=d, default=d[0])
        else:
            p.add_argument(flag, type=type(d), default=d)
    return p.parse_args(args)


def md_table(header: list, rows: list) -> str:
    return "\n".join(["| " + " | ".join(header) + " |", "|" + "---|" * len(header)]
                     + ["| " + " | ".join(str(c) for c in r) + " |" for r in rows])
