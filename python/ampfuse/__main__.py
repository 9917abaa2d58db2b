"""Command line: `python -m ampfuse demo [--steps N] [--device cpu|cuda]`."""

import argparse
import sys


def main(argv=None) -> int:
    parser = argparse.ArgumentParser(prog="python -m ampfuse", description=__doc__)
    commands = parser.add_subparsers(dest="command", required=True)
    demo = commands.add_parser("demo", help="a short mixed-precision training run")
    demo.add_argument("--steps", type=int, default=300)
    demo.add_argument("--device", default=None, help="cpu or cuda (default: cuda if present)")
    demo.add_argument("--seed", type=int, default=0)
    args = parser.parse_args(argv)
    if args.command == "demo":
        from ampfuse.demo import run_demo

        return run_demo(steps=args.steps, device=args.device, seed=args.seed)
    return 2


if __name__ == "__main__":
    sys.exit(main())
