"""How the pipeline's links share the GPU with its stages: NCCL thread blocks, receive lead, send timing.

A receive posted ahead of its consumer runs on its link's NCCL stream while the rank computes,
and until its peer's send arrives it holds its thread blocks, each one SM the stages lose.
This benchmark trains one pipeline (ViT-L/16, batch 256, pp=2, interleaved 1F1B with 4 chunks
and 4 micro-batches, CUDA graphs; ``--compiled`` for compiled stages) under each pair of

* ``--ctas``: the most thread blocks a link's communicator may use
  (``autopipe.runtime.p2p.LINK_MAX_CTAS``; ``default``: NCCL's own choice), and
* ``--leads``: how many computes ahead of its consumer a receive is posted
  (``autopipe.runtime.streams.RECEIVE_LEAD``), and
* ``--send-delays``: 0, each send posted right after its producer, or 1, posted as late as the
  simulated schedule allows (``autopipe.runtime.streams.DELAY_SENDS``, [Note: send timing]),

and prints samples/s, each rank's busy time and the busy spread, with the one-GPU rate
(``--baseline``, rank 0 alone, ``torch.compile`` with ``--compiled``) beside them. The first
configuration is run again last, so drift shows.

    torchrun --nproc-per-node 2 benchmarks/pipeline_links_gpu.py --ctas default,1,2,4 --leads 1,0 \\
        --baseline --out results.json
    torchrun --nproc-per-node 2 benchmarks/pipeline_links_gpu.py --smoke   # CPU, gloo, tiny
"""
from __future__ import annotations

import argparse
import os
import sys

HERE = os.path.dirname(os.path.abspath(__file__))
sys.path.insert(0, os.path.dirname(HERE))
sys.path.insert(0, HERE)

import torch.distributed as dist  # noqa: E402

from autopipe.runtime import p2p, streams  # noqa: E402
from gpu_throughput import Bench, Env, log  # noqa: E402


def ctas_value(text: str) -> int | None:
    return None if text == "default" else int(text)


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--model", default="vit_large_patch16_224")
    p.add_argument("--batch", type=int, default=256)
    p.add_argument("--microbatches", type=int, default=4)
    p.add_argument("--chunks", type=int, default=4)
    p.add_argument("--ctas", default="default,1,2,4")
    p.add_argument("--leads", default="1,0")
    p.add_argument("--send-delays", default="0")
    p.add_argument("--compiled", action="store_true", help="compiled stages (and a compiled one-GPU baseline)")
    p.add_argument("--baseline", action="store_true", help="time the whole model on rank 0 alone first")
    p.add_argument("--warmup", type=int, default=3)
    p.add_argument("--steps", type=int, default=8)
    p.add_argument("--out", default="")
    p.add_argument("--smoke", action="store_true", help="tiny model on CPU over gloo (a check of the script)")
    args = p.parse_args()
    env = Env(args.smoke)
    if args.smoke:
        args.batch, args.warmup, args.steps, args.microbatches, args.chunks = 16, 1, 2, 4, 2
    bench = Bench(env, args)
    B = args.batch
    configs = [(ctas_value(c), int(lead), bool(int(delay))) for delay in args.send_delays.split(",")
               for lead in args.leads.split(",") for c in args.ctas.split(",")]
    configs.append(configs[0])
    log(f"{env.world} ranks, {args.model}, batch {B}, {len(configs)} configurations")
    try:
        if args.baseline:
            name = "one GPU" + (" compiled" if args.compiled else "")
            bench.record(name, B, 1, lambda: bench.single(B, compiled=args.compiled and env.cuda))
        for ctas, lead, delay in configs:
            p2p.LINK_MAX_CTAS, streams.RECEIVE_LEAD, streams.DELAY_SENDS = ctas, lead, delay
            name = (f"pp=2 interleaved chunks={args.chunks} m={args.microbatches}"
                    + (" compiled" if args.compiled else "") + f" link ctas={ctas or 'default'} lead={lead}"
                    + (" sends delayed" if delay else ""))
            bench.record(name, B, 2, lambda: bench.autopipe(
                B, pp=2, tp=1, m=args.microbatches, schedule="interleaved_1f1b", chunks=args.chunks,
                graphs=env.cuda, compiled=args.compiled and env.cuda))
    finally:
        bench.save()
        log(f"\n{'configuration':<80} {'samples/s':>9} {'busy ms':>15} {'spread':>7}")
        for r in bench.results:
            busy = "/".join(str(b) for b in r.get("busy_ms", []))
            log(f"{r['config']:<80} {r.get('samples_s', r.get('error', '-'))!s:>9} {busy:>15} "
                f"{r.get('busy_spread', '-')!s:>7}")
        dist.destroy_process_group()


if __name__ == "__main__":
    main()
