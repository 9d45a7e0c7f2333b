"""`kvgen bench` (placeholder arguments until the benchmark lands)."""

from __future__ import annotations

import argparse


def add_arguments(p: argparse.ArgumentParser) -> None:
    pass


def main(args: argparse.Namespace) -> int:
    raise SystemExit("kvgen bench is not available yet")
