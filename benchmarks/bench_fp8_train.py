"""FP8 training end to end: a Llama-style decoder stack, or GPT-2 small, trained in every set-up
of fp8_setups.py side by side, bf16 O2 the baseline (issue 31's benchmarks a and b).

    PYTHONPATH=python python benchmarks/bench_fp8_train.py [--model llama|gpt] [--device cuda]
        [--layers N] [--steps N | --warmup N --repeats N] [--setups NAME ...] [--json PATH]

llama  llama_workload.py: hidden 4096, FFN 14336, 32 heads (8 key/value heads), seq 2048,
       vocab 32000, micro-batch 1, gradient accumulation 4 (8192 tokens per optimizer step); as
       many layers as fit the GPU with fp32 masters (printed with the arithmetic; --layers
       overrides). Data: walks on a fixed random graph, so the loss falls (floor ln 4).
gpt    GPT-2 small from train_workloads.py (12 layers, d_model 768, seq 1024, batch 8, random
       tokens), no accumulation; the set-ups torch amp bf16, bf16 O2 and fp8=True (the
       automatic Linear filter): FP8 must not make it slower than O2.

Every row starts from the same seed (same weights, same batches) and runs --warmup untimed and
--repeats timed optimizer steps; --steps N instead runs N steps, all timed after the first 3,
for the loss comparison at reduced depth (--layers 2 --steps 300: FP8's loss within 1% of
bf16's). A step is timed from zero_grad to the end of the optimizer step with CUDA events
(perf_counter on the CPU), median. tokens/s at the median; "vs O2" its ratio to bf16 O2's;
peak memory torch.cuda.max_memory_allocated over the row; loss: the mean training loss of the
last min(10, steps) steps; dloss%: its difference from O2's, in percent. bf16 O2 runs first
and again last (not in --steps runs): the gap between its medians (noise%) is the noise.
On the CPU the figures say only that the script runs.
"""

import argparse
import gc
import statistics
import time

import fp8_setups
import llama_workload
import torch
import torch.nn.functional as F
from _report import report
from _timing import default_device, summarize, synchronize
from ampfuse import amp
from fp8_setups import BASELINE, NotAvailable
from train_workloads import GPT_DEFAULTS, Workload

GPT_SETUPS = ("torch amp bf16", BASELINE, "ampfuse fp8=True")
STEP_DEFAULTS = {"cuda": {"warmup": 3, "repeats": 6}, "cpu": {"warmup": 1, "repeats": 2}}
LOSS_WINDOW = 10
DATA_MICRO_BATCHES = 16  # distinct micro-batches cycled through


def _loss(output, target):
    return F.cross_entropy(output.float().flatten(0, -2), target.flatten())


class Model:
    """The workload of one run: its config, a seeded model factory and its micro-batches."""

    def __init__(self, args):
        self.args = args
        if args.model == "llama":
            cfg = dict(llama_workload.LLAMA_DEFAULTS[args.device])
            for key in cfg:
                if getattr(args, key, None) is not None:
                    cfg[key] = getattr(args, key)
            total = (torch.cuda.get_device_properties(0).total_memory
                     if args.device == "cuda" else args.memory_gib * 2**30)
            fitted, self.fit = llama_workload.fit_layers(cfg, total)
            cfg["layers"] = cfg["layers"] or fitted
            self.cfg = cfg
            self.params = llama_workload.param_count(cfg)
            self.batches = llama_workload.markov_batches(cfg, DATA_MICRO_BATCHES, args.device,
                                                         args.seed + 1)
        else:
            sizes = dict(GPT_DEFAULTS[args.device])
            for key, flag in (("layers", "layers"), ("seq", "seq"), ("vocab", "vocab"),
                              ("heads", "heads"), ("d_model", "hidden"), ("batch", "micro_batch")):
                if getattr(args, flag, None) is not None:
                    sizes[key] = getattr(args, flag)
            self.workload = Workload("gpt", argparse.Namespace(**sizes, device=args.device,
                                                               seed=args.seed))
            self.cfg = dict(sizes, accum=args.accum or 1, micro_batch=sizes["batch"])
            self.fit = None
            self.batches = self.workload.batches()
            self.params = None
        self.tokens_per_step = self.cfg["micro_batch"] * self.cfg["seq"] * self.cfg["accum"]

    def make(self):
        torch.manual_seed(self.args.seed)
        if self.args.model == "gpt":
            return self.workload.model()
        with torch.device(self.args.device):
            return llama_workload.Llama(**self.cfg)


def _step_fn(setup, model, opt, autocast, cfg, batches):
    ampfuse_row = setup.startswith("ampfuse")
    accum = cfg["accum"]
    counter = iter(range(10**9))

    def step():
        opt.zero_grad(set_to_none=True)
        total = 0.0
        for _ in range(accum):
            tokens, targets = batches[next(counter) % len(batches)]
            with autocast():
                loss = _loss(model(tokens), targets) / accum
            if ampfuse_row:
                with amp.scale_loss(loss, opt) as scaled:
                    scaled.backward()
            else:
                loss.backward()
            total = total + loss.detach()
        opt.step()
        return total

    return step


def run_setup(setup, work, args):
    device = args.device
    gc.collect()
    if device == "cuda":
        torch.cuda.empty_cache()
        torch.cuda.reset_peak_memory_stats()
    row = {"model": args.model, "setup": setup, "device": device, "config": work.cfg,
           "tokens_per_step": work.tokens_per_step}
    try:
        model, opt, autocast, what, row["fp8_linears"] = fp8_setups.build(setup, work.make,
                                                                          device)
        row["what"] = what
        step = _step_fn(setup, model, opt, autocast, work.cfg, work.batches)
        warmup = min(3, args.steps) if args.steps else args.warmup
        timed = args.steps - warmup if args.steps else args.repeats
        losses, times = [], []
        for _ in range(warmup):
            losses.append(step())
        synchronize(device)
        for _ in range(timed):
            if device == "cuda":
                start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(
                    enable_timing=True)
                start.record()
                losses.append(step())
                end.record()
                times.append((start, end))
            else:
                t0 = time.perf_counter()
                losses.append(step())
                times.append(time.perf_counter() - t0)
        synchronize(device)
        if device == "cuda":
            times = [s.elapsed_time(e) / 1e3 for s, e in times]
        row["losses"] = [float(x) for x in losses]
        row["final_loss"] = statistics.fmean(row["losses"][-LOSS_WINDOW:])
        row["times_s"] = times
        row.update(summarize(times))
        row["tokens_per_s"] = work.tokens_per_step / row["median_s"]
        row["peak_mem_bytes"] = torch.cuda.max_memory_allocated() if device == "cuda" else None
    except NotAvailable as error:
        row["error"] = f"not available: {error}"
    # AttributeError: an op the recipe calls is missing from this build (one FP8 branch merged
    # without the other); the row says so and the run goes on. OOM is a RuntimeError.
    except (RuntimeError, NotImplementedError, TypeError, ValueError, AttributeError) as error:
        row["error"] = f"{type(error).__name__}: {str(error).strip().splitlines()[0][:160]}"
    finally:
        model = opt = step = None  # free this row's memory before the next
        if setup in fp8_setups.TORCHAO:
            torch._dynamo.reset()  # compiled graphs and their guards hold on to the model
    return row


def run(args):
    args = finish_args(args)
    work = Model(args)
    if work.fit and args.device == "cuda":  # on the CPU: --show-fit
        print(f"# layers: {work.cfg['layers']}"
              + (" (--layers)" if args.layers else "") + f"; fit: {work.fit}", flush=True)
    setups = args.setups or (GPT_SETUPS if args.model == "gpt" else fp8_setups.SETUPS)
    order = [BASELINE, *(s for s in setups if s != BASELINE)]
    repeat_baseline = not args.steps and len(order) > 1
    rows = {}
    for setup in order + ([BASELINE] if repeat_baseline else []):
        row = run_setup(setup, work, args)
        print(f"#   {setup}: " + (row["error"] if "error" in row else
                                  f"{row['median_s'] * 1e3:.1f} ms/step"), flush=True)
        if setup in rows:  # the baseline's second run
            first = rows[setup]
            if "median_s" in first and "median_s" in row:
                first["noise_pct"] = 100 * abs(first["median_s"] - row["median_s"]) / min(
                    first["median_s"], row["median_s"])
            continue
        rows[setup] = row
        row["params"] = work.params
    base = rows[BASELINE]
    for row in rows.values():
        if "median_s" in row and "median_s" in base:
            row["vs_o2"] = base["median_s"] / row["median_s"]
            row["dloss_pct"] = 100 * (row["final_loss"] - base["final_loss"]) / base["final_loss"]
            if row["peak_mem_bytes"] and base["peak_mem_bytes"]:
                row["mem_vs_o2"] = row["peak_mem_bytes"] / base["peak_mem_bytes"]
    return [rows[s] for s in order]


def finish_args(args):
    args = argparse.Namespace(**vars(args))
    if args.device == "cuda" and not torch.cuda.is_available():
        raise SystemExit("--device cuda: torch sees no CUDA device here")
    for key, value in STEP_DEFAULTS[args.device].items():
        if getattr(args, key) is None:
            setattr(args, key, value)
    if args.steps is not None and args.steps < 4:
        raise SystemExit("--steps must be at least 4 (3 untimed, then timed steps)")
    if args.repeats < 1:
        raise SystemExit("--repeats must be at least 1")
    unknown = set(args.setups or ()) - set(fp8_setups.SETUPS)
    if unknown:
        raise SystemExit(f"--setups: unknown {sorted(unknown)}; known: {fp8_setups.SETUPS}")
    return args


def parse_args(argv=None):
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--model", choices=["llama", "gpt"], default="llama")
    parser.add_argument("--device", choices=["cpu", "cuda"], default=default_device())
    parser.add_argument("--setups", nargs="+", metavar="NAME",
                        help=f"rows to run (default: all for llama, {GPT_SETUPS} for gpt)")
    for flag in ("layers", "hidden", "ffn", "heads", "kv-heads", "seq", "micro-batch", "accum",
                 "vocab"):
        parser.add_argument(f"--{flag}", type=int, default=None)
    parser.add_argument("--memory-gib", type=float, default=79.1,
                        help="on the CPU: the GPU memory the layer count is fitted to")
    parser.add_argument("--show-fit", action="store_true",
                        help="print the layer count that fits --memory-gib at the CUDA sizes "
                        "(any size flags applied) and exit")
    parser.add_argument("--warmup", type=int, default=None)
    parser.add_argument("--repeats", type=int, default=None)
    parser.add_argument("--steps", type=int, default=None,
                        help="run this many optimizer steps (loss comparison)")
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--json", metavar="PATH")
    return parser.parse_args(argv)


def format_rows(rows, env):
    cfg = rows[0]["config"]
    where = env.get("gpu") if rows[0]["device"] == "cuda" else f"CPU x{env['cpu_threads']}"
    lines = [(f"# fp8 train ({rows[0]['model']}): {where}; torch {env['torch']}; "
              f"{env['date']}; {env['command']}"),
             "# " + ", ".join(f"{k} {v}" for k, v in cfg.items())
             + f"; {rows[0]['tokens_per_step']} tokens/step"
             + (f"; {rows[0]['params'] / 1e9:.2f}B params" if rows[0].get("params") else "")]
    head = f"{'setup':>20} {'ms/step':>9} {'noise%':>6} {'tokens/s':>10} {'vs O2':>6} " \
           f"{'peak GiB':>8} {'mem/O2':>6} {'loss':>7} {'dloss%':>7} {'fp8 lin':>7}"
    lines.append(head)
    for r in rows:
        if "error" in r:
            lines.append(f"{r['setup']:>20} {r['error'][:100]}")
            continue
        peak = r["peak_mem_bytes"]
        lines.append(
            f"{r['setup']:>20} {r['median_s'] * 1e3:9.2f} {_f(r.get('noise_pct'), '6.1f')} "
            f"{r['tokens_per_s']:10,.0f} {_f(r.get('vs_o2'), '6.2f')} "
            f"{_f(peak and peak / 2**30, '8.1f')} {_f(r.get('mem_vs_o2'), '6.2f')} "
            f"{r['final_loss']:7.3f} {_f(r.get('dloss_pct'), '7.2f')} {r['fp8_linears']:>7}")
    lines.append("# vs O2: tokens/s over bf16 O2's (> 1: faster); loss: mean of the last "
                 f"{LOSS_WINDOW} steps; dloss%: against O2's; noise%: O2 run twice; fp8 lin: "
                 "Linears in FP8 / all")
    return "\n".join(lines)


def _f(value, spec):
    return "-".rjust(int(spec.split(".")[0])) if value is None else format(value, spec)


def show_fit(args):
    cfg = dict(llama_workload.LLAMA_DEFAULTS["cuda"])
    cfg.update({k: getattr(args, k) for k in cfg if getattr(args, k, None) is not None})
    print(llama_workload.fit_layers(cfg, args.memory_gib * 2**30)[1])


def main(argv=None):
    args = parse_args(argv)
    if args.show_fit:
        return show_fit(args)
    return report(run(args), argv, args.json, format_rows)


if __name__ == "__main__":
    main()
