"""``python -m mt STAGE [overrides...]``: the mt-* commands without relying on console scripts.

STAGE is one of prepare, train, translate, evaluate, export, serve, score, backtranslate; the
overrides are Hydra's, as for the ``mt-*`` commands. Under torchrun:
``torchrun --nproc_per_node=8 -m mt train ...``.
"""

from __future__ import annotations

import sys

from mt import cli

STAGES = {
    stage: getattr(cli, f"{stage}_main")
    for stage in "prepare train translate evaluate export serve score backtranslate".split()
}


def main() -> None:
    if len(sys.argv) < 2 or sys.argv[1] not in STAGES:
        sys.exit(f"usage: python -m mt {{{','.join(STAGES)}}} [key=value ...]")
    stage = sys.argv.pop(1)
    sys.argv[0] = f"mt-{stage}"
    STAGES[stage]()


if __name__ == "__main__":
    main()
