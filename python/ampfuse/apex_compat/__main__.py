"""`python -m ampfuse.apex_compat install|uninstall|status [--site DIR]`: the apex alias as an
installed package named apex (see ampfuse.apex_compat.metadata)."""

import argparse
import sys


def add_arguments(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("action", choices=("install", "uninstall", "status"),
                        help="install: make `import apex` and apex's package metadata resolve to "
                        "ampfuse in this environment; uninstall: remove that again; status: say "
                        "which apex this environment has")
    parser.add_argument("--site", default=None, metavar="DIR",
                        help="the site-packages directory to change (default: this Python's)")


def run(args) -> int:
    from ampfuse.apex_compat import ApexAliasError, metadata

    try:
        if args.action == "install":
            where = metadata.install(args.site)
            print(f"installed ampfuse's apex alias: {where}")
            print("`import apex` in this environment now gives ampfuse; undo with "
                  "`python -m ampfuse.apex_compat uninstall` (or `pip uninstall apex`).")
        elif args.action == "uninstall":
            if metadata.uninstall(args.site):
                print("removed ampfuse's apex alias")
            else:
                print(f"ampfuse's apex alias was not installed in "
                      f"{args.site or metadata.default_site()}; nothing removed")
        else:
            print(metadata.status(args.site))
    except ApexAliasError as error:
        print(f"error: {error}", file=sys.stderr)
        return 1
    except PermissionError as error:
        print(f"error: cannot write {error.filename}: {error.strerror}. Run it with the "
              "environment's own python, or pass --site DIR for a directory you can write.",
              file=sys.stderr)
        return 1
    return 0


def main(argv=None) -> int:
    parser = argparse.ArgumentParser(prog="python -m ampfuse.apex_compat", description=__doc__)
    add_arguments(parser)
    return run(parser.parse_args(argv))


if __name__ == "__main__":
    sys.exit(main())
