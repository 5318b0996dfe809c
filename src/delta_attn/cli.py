"""The ``delta-attn`` command."""
from __future__ import annotations

import argparse
import json
import sys
from typing import List, Optional


def _cmd_env(args) -> int:
    from . import env
    info = env.collect()
    print(json.dumps(info, indent=2, default=str) if args.json else env.render(info))
    return 0


def build_parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(prog="delta-attn", description="delta-attn: attention kernels and benchmarks")
    sub = p.add_subparsers(dest="command", required=True)
    e = sub.add_parser("env", help="versions, GPU, optional packages and usable backends")
    e.add_argument("--json", action="store_true", help="machine-readable output")
    e.set_defaults(func=_cmd_env)
    return p


def main(argv: Optional[List[str]] = None) -> int:
    args = build_parser().parse_args(argv)
    return args.func(args)


if __name__ == "__main__":
    sys.exit(main())
