"""The ``autopipe`` command: ``autopipe report MODEL --pp 4 --batch 256 --microbatches 8`` plans a
model on the meta device and prints the stage table, optionally writing the JSON and a figure.

Errors that are the user's to fix (every :class:`AutopipeError`) print one message and exit 2;
anything else is a bug and prints one line too, exit 1 (``--traceback`` shows where).
"""
from __future__ import annotations

import argparse
import os
import sys
from typing import Sequence

from .errors import AutopipeError, ConfigError
from .partition.device import PROFILES
from .partition.partitioner import BALANCE_MODES
from .partition.report import check_figure_path, plot
from .planning import plan_model
from .runtime.schedule import SCHEDULES

__all__ = ["main", "build_parser"]

_EXIT_USER_ERROR = 2  # what argparse uses for bad arguments too
_EXIT_INTERNAL_ERROR = 1

_EPILOG = """\
MODEL is timm:NAME, torchvision:NAME, hf:CLASS (default config) or package.module:factory.
examples:
  autopipe report timm:vit_huge_patch14_224 --pp 8 --batch 256 --microbatches 8 --figure vit_h.png
  autopipe report torchvision:resnet50 --pp 4 --batch 128 --microbatches 4 --balance params
"""


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
    report.add_argument("--json", metavar="PATH", help="write the plan as JSON")
    report.add_argument("--figure", metavar="PATH", help="draw the plan (.png, .svg or .pdf)")
    report.add_argument("--traceback", action="store_true", help="show the traceback of an internal error")
    return parser


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
        device=args.device,
        schedule=args.schedule,
        mem_cap=None if args.mem_cap_gib is None else args.mem_cap_gib * 2**30,
        sequence_parallel=args.sequence_parallel,
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
    except AutopipeError as exc:
        print(f"autopipe: error: {exc}", file=sys.stderr)
        return _EXIT_USER_ERROR
    except OSError as exc:  # a disk that filled up, a path that went away while planning
        print(f"autopipe: error: {exc}", file=sys.stderr)
        return _EXIT_USER_ERROR
    except Exception as exc:  # a bug, autopipe's or the model library's: one line, or --traceback
        if args.traceback:
            raise
        detail = " ".join(str(exc).split())[:300]
        print(f"autopipe: internal error: {type(exc).__name__}: {detail} (a bug; rerun with --traceback "
              "and report it with the command)", file=sys.stderr)
        return _EXIT_INTERNAL_ERROR
    return 0
