"""Command line: `python -m ampfuse demo|doctor|apex-alias [options]`
(`python -m ampfuse COMMAND --help`)."""

import argparse

# The demo's defaults live here so that building the parser imports nothing of the demo's
# (digits.DEFAULT_STEPS and EMULATED_STEPS; a test keeps them equal).
_DEMO_STEPS = 600
_DEMO_EMULATED_STEPS = 120
_DEMO_OPT_LEVELS = ("O1", "O2", "O3")


def _int(text: str) -> int:
    try:
        return int(text)
    except ValueError:
        raise argparse.ArgumentTypeError(f"expected an integer, got {text!r}") from None


def _positive_int(text: str) -> int:
    value = _int(text)
    if value < 1:
        raise argparse.ArgumentTypeError(f"must be a positive integer, got {value}")
    return value


def _opt_levels(text: str) -> tuple:
    levels = [level.strip().upper() for level in text.split(",") if level.strip()]
    if not levels:
        raise argparse.ArgumentTypeError("expected a comma-separated list such as O1,O2")
    for level in levels:
        if level not in _DEMO_OPT_LEVELS:
            raise argparse.ArgumentTypeError(
                f"unknown opt level {level!r}; choose from {', '.join(_DEMO_OPT_LEVELS)} "
                "(a capital letter O; the fp32 baseline always runs)")
    return tuple(dict.fromkeys(levels))


def _overflow_step(text: str):
    if text.lower() in ("off", "none"):
        return "off"
    value = _int(text)
    if value < 0:
        raise argparse.ArgumentTypeError(f"must be a step >= 0 or 'off', got {value}")
    return value


def _add_demo_parser(commands):
    demo = commands.add_parser(
        "demo", help="train a small CNN on the digits data set in fp32, O1 and O2 and compare",
        description="Says whether this CPU or GPU computes natively in bf16/fp16, trains the "
        "same small CNN on scikit-learn's digits data set once in fp32 and once per opt level "
        "with amp and FusedAdamW (with bf16 also per FusedAdamW master_weights mode, and on the "
        "CPU an fp16 run with a dynamic loss scale), then prints a table and saves a plot.")
    demo.add_argument("--device", default=None, help="cpu or cuda (default: cuda if present)")
    demo.add_argument("--dtype", choices=("bf16", "fp16"), default=None,
                      help="low-precision type (default: bf16 on cpu, fp16 on cuda)")
    demo.add_argument("--opt-levels", type=_opt_levels, default=("O1", "O2"), metavar="LIST",
                      help="comma-separated amp opt levels to run beside fp32 (default: O1,O2)")
    demo.add_argument("--steps", type=_positive_int, default=None,
                      help=f"training steps of the fp32, O1 and O2 runs; the other runs train a "
                      f"quarter (default: {_DEMO_STEPS}, or {_DEMO_EMULATED_STEPS} where the low "
                      "precision is emulated on this hardware)")
    demo.add_argument("--out", default="demo_out", metavar="DIR",
                      help="where the plot is saved (default: ./demo_out)")
    demo.add_argument("--seed", type=int, default=0, help="model and batch-order seed")
    demo.add_argument("--ranks", type=_positive_int, default=1, metavar="N",
                      help="train with FSDP2 (fully_shard) on N CPU processes (default: 1, "
                      "no sharding)")
    demo.add_argument("--inject-overflow", type=_overflow_step, default=None, metavar="STEP",
                      help="write an inf into a gradient at STEP of the fp32, O1 and O2 runs "
                      "(shorter runs: at the same fraction), which every run must skip "
                      "(default: the middle step; 'off' to disable)")
    demo.add_argument("--watch", action="store_true",
                      help="then run a few O1 steps under ampfuse.numerics.watch and print the "
                      "dtype each layer's ops ran in, their range against fp16's, and what "
                      "would need custom_black_list in fp16")
    return demo


def _run_demo(args, demo) -> int:
    import torch

    try:
        device = torch.device(args.device or ("cuda" if torch.cuda.is_available() else "cpu"))
    except RuntimeError:
        demo.error(f"argument --device: {args.device!r} is not a device; use cpu, cuda or cuda:N")
    if device.type not in ("cpu", "cuda"):
        demo.error(f"argument --device: the demo runs on cpu or cuda, got {args.device!r}")
    if device.type == "cuda" and not torch.cuda.is_available():
        demo.error("argument --device: torch sees no CUDA device on this machine; "
                   "use --device cpu")
    if args.ranks > 1 and device.type != "cpu":
        demo.error("argument --ranks: the sharded demo runs on CPU processes (gloo); "
                   "add --device cpu")
    inject = args.inject_overflow
    if inject is None:
        inject = "middle"  # of each run, whose length the demo picks for the hardware
    elif inject == "off":
        inject = None
    elif args.steps is not None and inject >= args.steps:
        demo.error(f"argument --inject-overflow: step {inject} is past the last step "
                   f"({args.steps - 1})")
    from ampfuse.tools.demo.digits import main as demo_main

    return demo_main(steps=args.steps, device=str(device), dtype=args.dtype,
                     opt_levels=args.opt_levels, out=args.out, seed=args.seed,
                     inject_overflow=inject, ranks=args.ranks, watch=args.watch)


def main(argv=None) -> int:
    parser = argparse.ArgumentParser(prog="python -m ampfuse", description=__doc__)
    commands = parser.add_subparsers(dest="command", required=True)
    demo = _add_demo_parser(commands)
    commands.add_parser(
        "doctor", help="check that ampfuse works here (versions, kernels, GPU, every op)",
        description="Reports versions, registered kernels, the GPU and its fp16/bf16 support, "
        "runs every op once against torch, and exits non-zero with the fix if anything is broken.")
    from ampfuse.apex_compat.__main__ import add_arguments as add_apex_alias_arguments

    add_apex_alias_arguments(commands.add_parser(
        "apex-alias", help="make `import apex` give ampfuse in this environment (opt-in)",
        description="install / uninstall / status of ampfuse's apex alias in site-packages, for "
        "libraries that import apex themselves or check its package metadata"))
    args = parser.parse_args(argv)
    if args.command == "demo":
        return _run_demo(args, demo)
    if args.command == "doctor":
        from ampfuse.tools.doctor.report import run as run_doctor

        return run_doctor()
    if args.command == "apex-alias":
        from ampfuse.apex_compat.__main__ import run as run_apex_alias

        return run_apex_alias(args)
    return 2

