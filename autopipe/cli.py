"""The ``autopipe`` command: ``autopipe report MODEL --pp 4 --batch 256 --microbatches 8`` plans a
model on the meta device and prints the stage table, optionally writing the JSON and a figure;
``autopipe profile MODEL --batch 256 --out FILE`` times the model on this machine's GPU, and the
file prices ``autopipe report --costs FILE`` anywhere; ``autopipe pace`` reads a GPU host's pace, which
``--host-pace`` gives report and plan on another machine.

Errors that are the user's to fix (every :class:`AutopipeError`) print one message and exit 2;
anything else is a bug and prints one line too, exit 1 (``--traceback`` shows where).
"""
from __future__ import annotations

import argparse
import json
import math
import os
import sys
from typing import Any, Sequence

import torch
import torch.distributed as dist

from .errors import AutopipeError, ConfigError
from .measure import ProfileCache, RunSetup, profile_graph
from .measure.host_pace import probe_seconds
from .partition.device import EXECUTION_MODES, PROFILES, DeviceProfile, get_profile
from .partition.measured import MeasuredCosts
from .partition.partitioner import BALANCE_MODES
from .partition.report import check_figure_path, plot
from .planning import plan_model, planning_graph
from .runtime.schedule import SCHEDULES
from .search import LinkModel, measure_links, plan_layout
from .search.report import format_search, plot_search

__all__ = ["main", "build_parser"]

_EXIT_USER_ERROR = 2  # what argparse uses for bad arguments too
_EXIT_INTERNAL_ERROR = 1

_EPILOG = """\
MODEL is timm:NAME, torchvision:NAME, hf:CLASS (default config) or package.module:factory.
examples:
  autopipe report timm:vit_huge_patch14_224 --pp 8 --batch 256 --microbatches 8 --figure vit_h.png
  autopipe report torchvision:resnet50 --pp 4 --batch 128 --microbatches 4 --balance params
"""


_HOST_PACE_HELP = ("the pace of the host the stages will run on, in us, as `autopipe pace` reads it there; "
                   "eager stages are priced at it (default: the pace of the host the device table was fitted on)")


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(prog="autopipe", description="Plan pipeline parallelism for a PyTorch model.")
    sub = parser.add_subparsers(dest="command", required=True, metavar="COMMAND")
    report = sub.add_parser(
        "report",
        help="plan a model and print its stage table",
        description="Trace MODEL on the meta device, cut it into pp x chunks stages and report the plan.",
        epilog=_EPILOG,
        formatter_class=argparse.RawDescriptionHelpFormatter,
    )
    report.add_argument("model", metavar="MODEL",
                        help="the model: timm:NAME, torchvision:NAME, hf:CLASS or package.module:factory")
    report.add_argument("--pp", type=int, required=True, help="pipeline degree")
    report.add_argument("--chunks", type=int, default=1, help="model chunks per pipeline rank (default 1)")
    report.add_argument("--tp", type=int, default=1, help="tensor-parallel degree (default 1)")
    report.add_argument("--sequence-parallel", action="store_true",
                        help="with --tp: split norms and residuals across the tp ranks by sample")
    report.add_argument("--batch", type=int, required=True, help="global batch size")
    report.add_argument("--microbatches", type=int, default=1, help="micro-batches per batch (default 1)")
    report.add_argument("--balance", choices=BALANCE_MODES, default=None, help="how to balance (default cost)")
    report.add_argument("--split-points", metavar="A,B,...", help="cut before these modules instead of balancing")
    report.add_argument("--device", default="h100",
                        help=f"device profile of the cost model: {', '.join(PROFILES)} (default h100)")
    report.add_argument("--schedule", choices=SCHEDULES, default=None,
                        help="pipeline schedule (default 1f1b, interleaved_1f1b when chunks > 1)")
    report.add_argument("--image-size", type=int, default=None,
                        help="input height and width (default: the model's own, from its config or "
                             "its weights; 224 where it records none)")
    report.add_argument("--mem-cap-gib", type=float, default=None, help="memory cap per stage, GiB")
    report.add_argument("--mode", choices=EXECUTION_MODES, default=None,
                        help="how the stages will run (default: the profile's, else eager)")
    report.add_argument("--costs", metavar="PROFILE",
                        help="price the nodes by a profile made on the GPU with `autopipe profile` "
                             "(default: the analytic model of --device)")
    report.add_argument("--stage-scale", metavar="F,F,...",
                        help="per stage, how much slower it ran inside a pipeline than alone "
                             "(autopipe.measure.stage_scale); the cut balances the scaled times")
    report.add_argument("--host-pace", type=float, default=None, metavar="US", help=_HOST_PACE_HELP)
    report.add_argument("--json", metavar="PATH", help="write the plan as JSON")
    report.add_argument("--figure", metavar="PATH", help="draw the plan (.png, .svg or .pdf)")
    report.add_argument("--traceback", action="store_true", help="show the traceback of an internal error")
    _add_profile_parser(sub)
    _add_plan_parser(sub)
    pace = sub.add_parser("pace", help="read this host's pace, the one eager stages are priced at",
                          description="Probe how fast this host launches work on its GPU, as parallelize does "
                                      "before it plans eager stages; pass the reading to report and plan as "
                                      "--host-pace on a machine without the GPU.")
    pace.add_argument("--device", default="cuda", help="the GPU to probe (default cuda)")
    pace.add_argument("--traceback", action="store_true", help="show the traceback of an internal error")
    links = sub.add_parser("links", help="measure the links between this machine's devices (under torchrun)",
                           description="Time point-to-point transfers and all-reduces between the processes "
                                       "torchrun started and write the link model for `autopipe plan --links`.",
                           epilog="example:\n  torchrun --nproc-per-node 8 -m autopipe links --out links.json",
                           formatter_class=argparse.RawDescriptionHelpFormatter)
    links.add_argument("--out", metavar="PATH", required=True, help="where to write the link model (JSON)")
    links.add_argument("--traceback", action="store_true", help="show the traceback of an internal error")
    return parser


def _add_plan_parser(sub: Any) -> None:
    plan = sub.add_parser(
        "plan",
        help="choose pp, tp, dp, micro-batches, chunks, schedule and mode for a model",
        description="Weigh every layout of MODEL on --gpus devices for a global --batch, predict each one's "
                    "step time and memory per device, and rank them.",
        epilog="example:\n  autopipe plan timm:vit_large_patch16_224 --gpus 8 --device h100 --batch 256 --memory 80",
        formatter_class=argparse.RawDescriptionHelpFormatter,
    )
    plan.add_argument("model", metavar="MODEL", help="timm:NAME, torchvision:NAME, hf:CLASS or package.module:factory")
    plan.add_argument("--gpus", type=int, required=True, help="devices to run on (the world size)")
    plan.add_argument("--batch", type=int, required=True, help="global batch size")
    plan.add_argument("--device", default="h100", help=f"device profile: {', '.join(PROFILES)} (default h100)")
    plan.add_argument("--memory", type=float, default=None, metavar="GiB", help="memory budget per device")
    plan.add_argument("--profile", metavar="FILE", action="append", default=[],
                      help="a measured profile (autopipe profile); repeat for several micro-batch sizes")
    plan.add_argument("--links", metavar="FILE", help="a link model measured by `autopipe links`")
    plan.add_argument("--precision", choices=("fp32", "bf16", "fp16"), default="bf16",
                      help="mixed precision the stages run in (default bf16)")
    plan.add_argument("--image-size", type=int, default=None, help="input height and width (default: the model's)")
    plan.add_argument("--host-pace", type=float, default=None, metavar="US", help=_HOST_PACE_HELP)
    plan.add_argument("--top", type=int, default=12, help="layouts to list (default 12)")
    plan.add_argument("--json", metavar="PATH", help="write every prediction and refusal as JSON")
    plan.add_argument("--figure", metavar="PATH", help="draw the top layouts and the chosen one's timeline")
    plan.add_argument("--traceback", action="store_true", help="show the traceback of an internal error")


def _plan(args: argparse.Namespace) -> None:
    _check_writable("--json", args.json)
    _check_writable("--figure", args.figure)
    if args.figure:
        check_figure_path(args.figure)
    measured = {}
    for path in args.profile:
        m = MeasuredCosts.load(path)
        measured[m.input_shapes[0][0]] = m
    result = plan_layout(args.model, devices=args.gpus, batch=args.batch, device=_paced(args.device, args.host_pace),
                         memory=None if args.memory is None else args.memory * 2**30,
                         links=LinkModel.load(args.links) if args.links else None, measured=measured or None,
                         image_size=args.image_size, mixed_precision=None if args.precision == "fp32" else args.precision)
    print(format_search(result, top=args.top))
    if args.json:
        with open(args.json, "w") as f:
            f.write(json.dumps(result.to_dict(), indent=1))
        print(f"search written to {args.json}")
    if args.figure:
        plot_search(result, args.figure)
        print(f"figure written to {args.figure}")


def _links(args: argparse.Namespace) -> None:
    _check_writable("--out", args.out)
    if not dist.is_initialized():
        if "RANK" not in os.environ:
            raise ConfigError("autopipe links measures between processes: launch it with "
                              "`torchrun --nproc-per-node N -m autopipe links --out FILE`")
        dist.init_process_group("nccl" if torch.cuda.is_available() else "gloo")
    device = torch.device("cuda", int(os.environ.get("LOCAL_RANK", 0))) if torch.cuda.is_available() else \
        torch.device("cpu")
    if device.type == "cuda":
        torch.cuda.set_device(device)
    model = measure_links(device)
    if dist.get_rank() == 0:
        model.save(args.out)
        print(f"p2p {model.p2p_bandwidth / 1e9:.2f} GB/s + {model.p2p_latency * 1e6:.1f} us, collectives "
              f"{model.collective_bandwidth / 1e9:.2f} GB/s + {model.collective_latency * 1e6:.1f} us ({model.source}); "
              f"written to {args.out}")
    dist.destroy_process_group()


def _add_profile_parser(sub: Any) -> None:
    profile = sub.add_parser(
        "profile",
        help="time a model's graph on this machine's GPU and write the profile",
        description="Trace MODEL, time it segment by segment on the GPU in the mode and dtype it will "
                    "train in, and write the measured profile for `autopipe report --costs` (on any "
                    "machine) or parallelize(costs=PATH).",
        epilog="example:\n  autopipe profile timm:vit_large_patch16_224 --batch 256 --microbatches 8 "
               "--mode graphs --dtype bf16 --out vit_l.profile.json",
        formatter_class=argparse.RawDescriptionHelpFormatter,
    )
    profile.add_argument("model", metavar="MODEL", help="timm:NAME, torchvision:NAME, hf:CLASS or package.module:factory")
    profile.add_argument("--batch", type=int, required=True, help="global batch size")
    profile.add_argument("--microbatches", type=int, default=1, help="micro-batches per batch (default 1)")
    profile.add_argument("--tp", type=int, default=1, help="tensor-parallel degree (default 1)")
    profile.add_argument("--image-size", type=int, default=None, help="input height and width (default: the model's)")
    profile.add_argument("--mode", choices=EXECUTION_MODES, default="eager", help="how the stages will run (default eager)")
    profile.add_argument("--dtype", choices=sorted(_DTYPES), default="bf16", help="compute dtype (default bf16)")
    profile.add_argument("--recompute", action="store_true", help="stages run with activation checkpointing")
    profile.add_argument("--segments", type=int, default=None, help="segments to time (default by mode)")
    profile.add_argument("--device", default="cuda", help="device to time on (default cuda)")
    profile.add_argument("--out", metavar="PATH", required=True, help="where to write the profile (JSON)")
    profile.add_argument("--traceback", action="store_true", help="show the traceback of an internal error")


_DTYPES = {"fp32": None, "bf16": "bfloat16", "fp16": "float16"}


def _profile(args: argparse.Namespace) -> None:
    _check_writable("--out", args.out)
    dtype = _DTYPES[args.dtype]
    setup = RunSetup(args.device, args.mode, getattr(torch, dtype) if dtype else None, recompute=args.recompute)
    traced, name = planning_graph(args.model, tp=args.tp, microbatches=args.microbatches, batch=args.batch,
                                  image_size=args.image_size)
    measured = profile_graph(traced, setup, segments=args.segments, cache=ProfileCache())
    measured.save(args.out)
    print(f"{name}: {len(measured.node_seconds)} nodes timed in {len(measured.segments)} segments on "
          f"{measured.device} ({measured.mode}, {measured.dtype}): {measured.total * 1e3:.2f} ms forward+backward "
          f"per micro-batch, profiled in {measured.profile_seconds:.1f} s")
    print(f"profile written to {args.out}")


def _paced(device: str, pace_us: float | None) -> str | DeviceProfile:
    """The device profile ``device``, its host terms at ``pace_us`` (``--host-pace``) where given."""
    if pace_us is None:
        return device
    if not (math.isfinite(pace_us) and pace_us > 0):
        raise ConfigError(f"--host-pace {pace_us!r}: give the microseconds `autopipe pace` printed on the host the "
                          "stages will run on, a positive number")
    profile = get_profile(device)
    if profile.calibration is None or not profile.calibration.host_probe > 0:
        raise ConfigError(f"--host-pace: the {profile.name} device table records no host pace to scale from; leave "
                          "--host-pace out, and its eager stages are priced at the host it was fitted on")
    return profile.at_host_pace(pace_us * 1e-6)


def _pace(args: argparse.Namespace) -> None:
    device = torch.device(args.device)
    if device.type != "cuda" or not torch.cuda.is_available():
        raise ConfigError(f"--device {args.device!r}: the host's pace is read against a GPU's launches, and "
                          f"{'this machine has none' if not torch.cuda.is_available() else 'that is not one'}; "
                          "run `autopipe pace` on the GPU host the stages will run on")
    seconds = probe_seconds(device)
    print(f"host pace {seconds * 1e6:.0f} us on {torch.cuda.get_device_name(device)} "
          f"(give --host-pace {seconds * 1e6:.0f} to autopipe report and autopipe plan)")


def _stage_scale(text: str | None) -> tuple[float, ...] | None:
    if text is None:
        return None
    try:
        return tuple(float(f) for f in text.split(","))
    except ValueError:
        raise ConfigError(f"--stage-scale {text!r}: give numbers separated by commas, one per stage, "
                          "e.g. 1.08,1.22,1.25,1.19") from None


def _balance(args: argparse.Namespace) -> str | list[str]:
    if args.split_points is None:
        return args.balance or "cost"
    if args.balance is not None:
        raise ConfigError(f"give --balance {args.balance} or --split-points, not both")
    points = [p.strip() for p in args.split_points.split(",") if p.strip()]
    stages = args.pp * args.chunks
    if len(points) != stages - 1:
        raise ConfigError(
            f"--split-points names {len(points)} modules but pp {args.pp} x chunks {args.chunks} = "
            f"{stages} stages need {stages - 1}"
        )
    return points


def _check_writable(option: str, path: str | None) -> None:
    """Refuse an output path that cannot be written before planning (which takes a while)."""
    if path is None:
        return
    folder = os.path.dirname(os.path.abspath(path))
    if os.path.isdir(path):
        raise ConfigError(f"{option} {path!r} is a directory; give a file path")
    if not os.path.isdir(folder):
        raise ConfigError(f"{option} {path!r}: folder {folder!r} does not exist; create it first")
    if not os.access(folder, os.W_OK) or (os.path.exists(path) and not os.access(path, os.W_OK)):
        raise ConfigError(f"{option} {path!r} is not writable; give a path you can write to")


def _report(args: argparse.Namespace) -> None:
    _check_writable("--json", args.json)
    _check_writable("--figure", args.figure)
    if args.figure:
        check_figure_path(args.figure)
    plan = plan_model(
        args.model,
        pp=args.pp,
        chunks=args.chunks,
        tp=args.tp,
        microbatches=args.microbatches,
        batch=args.batch,
        image_size=args.image_size,
        balance=_balance(args),
        device=_paced(args.device, args.host_pace),
        schedule=args.schedule,
        mem_cap=None if args.mem_cap_gib is None else args.mem_cap_gib * 2**30,
        sequence_parallel=args.sequence_parallel,
        mode=args.mode,
        measured=MeasuredCosts.load(args.costs) if args.costs else None,
        stage_scale=_stage_scale(args.stage_scale),
    )
    print(plan)
    if args.json:
        with open(args.json, "w") as f:
            f.write(plan.to_json())
        print(f"plan written to {args.json}")
    if args.figure:
        plot(plan, args.figure)
        print(f"figure written to {args.figure}")


def main(argv: Sequence[str] | None = None) -> int:
    """Run the command line ``argv`` (default ``sys.argv[1:]``); returns the exit status."""
    try:
        args = build_parser().parse_args(argv)
    except SystemExit as exc:  # --help, or a usage error argparse already printed
        return exc.code if isinstance(exc.code, int) else _EXIT_USER_ERROR
    try:
        if args.command == "report":
            _report(args)
        elif args.command == "profile":
            _profile(args)
        elif args.command == "plan":
            _plan(args)
        elif args.command == "links":
            _links(args)
        elif args.command == "pace":
            _pace(args)
    except AutopipeError as exc:
        print(f"autopipe: error: {exc}", file=sys.stderr)
        return _EXIT_USER_ERROR
    except OSError as exc:  # a disk that filled up, a path that went away while planning
        print(f"autopipe: error: {exc}", file=sys.stderr)
        return _EXIT_USER_ERROR
    except Exception as exc:  # a bug, autopipe's or the model library's: one line, or --traceback
        if getattr(args, "traceback", False):
            raise
        detail = " ".join(str(exc).split())[:300]
        print(f"autopipe: internal error: {type(exc).__name__}: {detail} (a bug; rerun with --traceback "
              "and report it with the command)", file=sys.stderr)
        return _EXIT_INTERNAL_ERROR
    return 0
