"""python -m nanohlat.figures [--out DIR] [--only NAME ...] [--list] [--check]"""

import argparse
import os
import sys
import time

from nanohlat.config import UserError
from nanohlat.figures import FIGURES, FOLDER, check, draw, json_of, paths
from nanohlat.system import cli
from nanohlat.system.files import refuse_unless_file, write_text


@cli.command
def main(argv=None) -> int:
    p = argparse.ArgumentParser(prog="python -m nanohlat.figures",
                                description="Draw tutorial.md's figures from nanohlat's own objects: "
                                            "NAME.svg and NAME.json (the numbers drawn) for each.")
    p.add_argument("--out", default=FOLDER, help="the folder to write them into (default: docs/figures)")
    p.add_argument("--only", nargs="+", metavar="NAME", help="only these figures (--list names them)")
    p.add_argument("--list", action="store_true", help="name every figure, its chapter and what it shows")
    p.add_argument("--check", action="store_true", help="write nothing: say which figure in --out is not "
                                                        "what the code draws now (exit code 1)")
    args = p.parse_args(argv)
    if args.list:
        for name, fig in FIGURES.items():
            print(f"{name:<22} chapter {fig.chapter:>2}  {fig.caption}" + ("  (trains)" if fig.trained else ""))
        return 0
    unknown = [n for n in args.only or [] if n not in FIGURES]
    if unknown:
        raise UserError(f"no figure named {', '.join(unknown)}: `python -m nanohlat.figures --list` names them")
    names = args.only or list(FIGURES)
    if os.path.lexists(args.out) and not os.path.isdir(args.out):
        raise UserError(f"--out {args.out!r} is not a folder: give a folder to write the figures into")
    if not args.check:
        for name in names:
            for path in paths(name, args.out):
                refuse_unless_file(path, "another --out")
        os.makedirs(args.out, exist_ok=True)
    stale = 0
    for name in names:
        t0 = time.perf_counter()
        data, svg_text = draw(name)
        if args.check:
            problems = check(name, args.out, (data, svg_text))
            stale += bool(problems)
            print(f"{name}: " + ("; ".join(problems) if problems else "as committed"))
            continue
        jpath, spath = paths(name, args.out)
        write_text(jpath, json_of(data))
        write_text(spath, svg_text)
        print(f"{name}: wrote {spath} and {os.path.basename(jpath)} ({time.perf_counter() - t0:.1f} s)")
    return 1 if stale else 0


if __name__ == "__main__":
    sys.argv[0] = "python -m nanohlat.figures"
    sys.exit(main())
