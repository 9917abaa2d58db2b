"""Writes a copy of a CUDA source whose kernel launches the host compiler can build.

    python rewrite_launches.py IN.cu OUT.cpp

`kernel<A, B><<<grid, block, shared, stream>>>(x, y)` becomes
`::ampfuse_emu::launch(::ampfuse_emu::Config(grid, block, shared, stream),
[&](const auto&... emu_args) { kernel<A, B>(emu_args...); }, x, y)`: the call inside the
lambda deduces the kernel's remaining template arguments from the launch's arguments, as the
CUDA launch does. Each `__shared__ T name[...];` declaration gets a call after it that fills
the variable with 0xff bytes (a nan as a float) the first time a block reaches it, as a GPU
gives a block shared memory holding whatever was there: a kernel that reads shared memory its
block has not written then reads garbage here too, not the previous block's values. Everything
else is copied as it is, and a #line directive keeps compiler messages pointing at the original
file. Fails if a `<<<` is left that it did not understand.
"""
import re
import sys

# A kernel name with at most one level of nested template arguments, then the launch
# configuration (which may itself hold casts such as reinterpret_cast<cudaStream_t>(s)).
LAUNCH = re.compile(
    r"(?P<callee>\b[A-Za-z_]\w*(?:<[^;{}<>]*(?:<[^;{}<>]*>[^;{}<>]*)*>)?)\s*"
    r"<<<(?P<config>.*?)>>>\s*\((?P<close>\s*\))?",
    re.S,
)


# A shared-memory declaration on a line of its own: type, name, array extents.
SHARED = re.compile(
    r"^(?P<indent>[ \t]*)__shared__\s+"
    r"(?P<decl>[^;\n]*?\b(?P<name>\w+)\s*(?:\[[^\]\n]*\]\s*)*);",
    re.M,
)


def rewrite(text: str) -> str:
    def launch(m: re.Match) -> str:
        head = (
            f"::ampfuse_emu::launch(::ampfuse_emu::Config({m['config']}), "
            f"[&](const auto&... emu_args) {{ {m['callee']}(emu_args...); }}"
        )
        return head + (")" if m["close"] else ", ")

    def shared(m: re.Match) -> str:
        return (f"{m['indent']}__shared__ {m['decl']}; "
                f"::ampfuse_emu::fresh_shared(&{m['name']}, sizeof({m['name']}));")

    out = SHARED.sub(shared, LAUNCH.sub(launch, text))
    if "<<<" in out:
        line = out[: out.index("<<<")].count("\n") + 1
        raise SystemExit(f"rewrite_launches.py: a launch it cannot parse near line {line}")
    return out


def main() -> None:
    source, target = sys.argv[1], sys.argv[2]
    with open(source, encoding="utf-8") as f:
        text = f.read()
    with open(target, "w", encoding="utf-8") as f:
        f.write(f'#line 1 "{source}"\n')
        f.write(rewrite(text))


if __name__ == "__main__":
    main()
