"""Dev check: apex's own DCGAN example (examples/dcgan/main_amp.py), unchanged but for two
lines, on ampfuse through the apex alias (CPU, bf16).

apex shipped one example of amp with several models, optimizers and losses: a DCGAN that calls
``amp.initialize([netD, netG], [optimizerD, optimizerG], opt_level=..., num_losses=3)`` and
backpropagates each of its three losses through ``amp.scale_loss(loss, optimizer,
loss_id=k)``: the discriminator's real and fake losses accumulate into one optimizerD step, the
generator's loss feeds optimizerG through a graph that also runs netD. This script reads the
file from an apex checkout you provide (nothing of apex is kept in this repository) and changes
two lines (EDITS): its hard-coded ``torch.device("cuda:0")`` becomes the CPU, and its label
tensor becomes float (as apex ships it, the example fails on torch >= 1.7 even at O0, without
amp). It runs the result at O0, O1 and O2 on torchvision's FakeData for one epoch (125
iterations of 8 images), each in a process of its own, and checks that every run finishes
with finite losses, that O1 and O2 stay near O0 on the first iteration, that the
discriminator learns (its loss falls), that amp kept one loss scaler per loss id, that O2
trained bf16 convolutions beside fp32 batch norms, and that the checkpoints the script writes
load back in fp32.

Get apex (any tag that still has examples/dcgan, e.g. 25.09) and torchvision (see README.md
beside this file), then::

    git clone --depth 1 https://github.com/NVIDIA/apex /tmp/apex-src
    PYTHONPATH=/tmp/apex-libs python tests/dev/apex_libraries/check_apex_dcgan.py /tmp/apex-src
"""

from __future__ import annotations

import argparse
import math
import re
import subprocess
import sys
import tempfile
from pathlib import Path

from _checks import Checks

# The two lines changed, each of which must appear exactly once: the device, and the label
# tensor, which torch.full makes int64 from an int fill value since torch 1.7 (apex's example
# predates that; BCEWithLogitsLoss refuses an int64 target, at O0 as much as at O1/O2).
EDITS = {
    'device = torch.device("cuda:0")': 'device = torch.device("cpu")',
    "label = torch.full((batch_size,), real_label, device=device)":
        "label = torch.full((batch_size,), real_label, device=device, dtype=torch.float)",
}
ITERATION = re.compile(
    r"^\[(\d+)/\d+\]\[(\d+)/(\d+)\] Loss_D: (\S+) Loss_G: (\S+) D\(x\): (\S+) D\(G\(z\)\): (\S+)")
ARGS = ["--dataset", "fake", "--batchSize", "8", "--ngf", "16", "--ndf", "16", "--niter", "1",
        "--workers", "0", "--manualSeed", "2809"]


def example_source(apex_dir):
    path = Path(apex_dir) / "examples" / "dcgan" / "main_amp.py"
    source = path.read_text()
    for line, replacement in EDITS.items():
        if source.count(line) != 1:
            raise SystemExit(f"{path}: expected the line {line!r} once; the example changed, so "
                             "this check needs a look")
        source = source.replace(line, replacement)
    return source


def child(apex_dir, opt_level, outf):
    """Runs the example in this process (with the alias installed), then prints amp's state."""
    from ampfuse.apex_compat import install_apex_alias

    install_apex_alias()
    import torch

    import ampfuse

    sys.argv = ["main_amp.py", *ARGS, "--opt_level", opt_level, "--outf", outf]
    names = {"__name__": "__main__"}
    exec(compile(example_source(apex_dir), "main_amp.py", "exec"), names)
    scalers = sorted(key for key in ampfuse.amp.state_dict() if key.startswith("loss_scaler"))
    print("AMP_LOSS_SCALERS " + " ".join(scalers))
    # The models as trained (their state_dict() is fp32 at O2, as apex's O2 made it).
    for net in ("netG", "netD"):
        modules = list(names[net].modules())
        convs = {str(m.weight.dtype) for m in modules
                 if isinstance(m, torch.nn.modules.conv._ConvNd)}
        norms = {str(m.weight.dtype) for m in modules if isinstance(m, torch.nn.BatchNorm2d)}
        print(f"MODEL_DTYPES {net} {','.join(sorted(convs))} {','.join(sorted(norms))}")


def run(apex_dir, opt_level, outf):
    """(iterations as (loss_d, loss_g) pairs, amp's loss scaler keys, {net: (conv dtypes, norm
    dtypes)} of the trained models, return code, stderr tail)."""
    result = subprocess.run(
        [sys.executable, __file__, apex_dir, "--child", opt_level, "--outf", outf],
        capture_output=True, text=True, timeout=1800)
    losses, scalers, dtypes = [], [], {}
    for line in result.stdout.splitlines():
        match = ITERATION.match(line)
        if match:
            losses.append((float(match.group(4)), float(match.group(5))))
        elif line.startswith("AMP_LOSS_SCALERS"):
            scalers = line.split()[1:]
        elif line.startswith("MODEL_DTYPES"):
            _, net, convs, norms = line.split()
            dtypes[net] = (convs, norms)
    return losses, scalers, dtypes, result.returncode, result.stderr[-2000:]


def main():
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("apex_dir", help="an apex checkout that has examples/dcgan/main_amp.py")
    parser.add_argument("--child", metavar="OPT_LEVEL", help=argparse.SUPPRESS)
    parser.add_argument("--outf", help=argparse.SUPPRESS)
    args = parser.parse_args()
    if args.child:
        child(args.apex_dir, args.child, args.outf)
        return 0

    import torch

    check = Checks("apex DCGAN example")
    example_source(args.apex_dir)  # fails early if the example is not where it should be
    results = {}
    with tempfile.TemporaryDirectory() as tmp:
        for opt_level in ("O0", "O1", "O2"):
            outf = f"{tmp}/{opt_level}"
            losses, scalers, dtypes, code, err = run(args.apex_dir, opt_level, outf)
            results[opt_level] = losses
            check(code == 0, f"{opt_level}: the example runs to the end (exit status {code})"
                  + ("" if code == 0 else f"\n{err}"))
            check(len(losses) == 125, f"{opt_level}: 125 iterations logged ({len(losses)})")
            check(all(math.isfinite(v) for pair in losses for v in pair),
                  f"{opt_level}: every logged loss is finite")
            if losses:
                first = sum(d for d, _ in losses[:10]) / 10
                last = sum(d for d, _ in losses[-10:]) / 10
                print(f"      {opt_level}: Loss_D {first:.3f} -> {last:.3f} (means of the first "
                      f"and last 10 iterations)")
                check(last < first, f"{opt_level}: the discriminator's loss falls")
            if opt_level != "O0":
                check(scalers == ["loss_scaler0", "loss_scaler1", "loss_scaler2"],
                      f"{opt_level}: amp kept one loss scaler per loss_id ({scalers})")
            for net in ("netG", "netD"):
                path = Path(outf) / f"{net}_epoch_0.pth"
                state = torch.load(path, weights_only=True) if path.exists() else {}
                floats = [t for t in state.values() if t.is_floating_point()]
                check(bool(floats) and all(t.dtype == torch.float32 and torch.isfinite(t).all()
                                           for t in floats),
                      f"{opt_level}: {path.name} written and loads, finite and fp32 (O2's "
                      "state_dict() gives fp32, as apex's did)")
                # O2 trains the convolutions in bf16 and keeps batch norms in fp32; O0 and O1
                # leave the model in fp32.
                want = "torch.bfloat16" if opt_level == "O2" else "torch.float32"
                check(dtypes.get(net) == (want, "torch.float32"),
                      f"{opt_level}: the trained {net}'s convolutions are {want}, its batch norms "
                      f"fp32 ({dtypes.get(net)})")
    if results["O1"] and results["O2"]:
        # Expected: on this model O1's per-op casts and O2's bf16 model do the same arithmetic
        # (bf16 convolutions on the same rounded weights, fp32 batch norm parameters, fp32
        # loss, the same bf16 gradients in fp32), so the two runs may agree exactly.
        same = sum(a == b for a, b in zip(results["O1"], results["O2"]))
        print(f"      O1 and O2 logged the same (Loss_D, Loss_G) on {same} of "
              f"{len(results['O1'])} iterations")
    for opt_level in ("O1", "O2"):
        if results["O0"] and results[opt_level]:
            d0, g0 = results["O0"][0]
            d, g = results[opt_level][0]
            close = abs(d - d0) <= 0.05 * abs(d0) and abs(g - g0) <= 0.05 * abs(g0)
            check(close, f"{opt_level}: first iteration's losses within 5% of O0's "
                  f"(D {d:.4f} vs {d0:.4f}, G {g:.4f} vs {g0:.4f}; bf16 forward)")
    return check.finish()


if __name__ == "__main__":
    sys.exit(main())
