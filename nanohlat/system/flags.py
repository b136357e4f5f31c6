"""The command lines' flag parser: a bad flag is one line, not a page of usage.

argparse answers a mistyped flag (`--zero 1.5`, `--collective-timeout abc`) by
printing the whole usage first: 34 lines for train.py, the one that matters
last. Every nanohlat command parses with `Parser` instead, which says only

    error: argument --zero: invalid int value: '1.5' (python train.py --help lists the flags)

and exits with 2, as every other refusal of bad input does. `--help` is unchanged.
"""

from __future__ import annotations

import argparse
import re
import sys


class Parser(argparse.ArgumentParser):
    """argparse.ArgumentParser with one-line errors (subcommands' parsers are Parsers too)."""

    def parse_known_args(self, args=None, namespace=None):
        self._args = list(sys.argv[1:] if args is None else args)   # (for `error`'s hint)
        return super().parse_known_args(args, namespace)

    def error(self, message: str):
        command = f"python {self.prog}" if self.prog.endswith(".py") else self.prog
        m = re.match(r"argument (-[-\w]+)\S*: expected one argument$", message)
        args = getattr(self, "_args", [])
        if m and m.group(1) in args[:-1]:   # `--lr -1e-3`: argparse takes a value like -1e-3 for a flag
            value = args[args.index(m.group(1)) + 1]
            if re.match(r"-[\d.]", value):
                message += f" (a value that starts with '-' is written {m.group(1)}={value})"
        self.exit(2, f"error: {message} ({command} --help lists the flags)\n")

