"""`python -m stacks.logs EXPERIMENT [FLAGS]` (`make logs EXPERIMENT=name`): the experiment's
sessions from Cloud Logging, that is `python -m trainer logs` with the project and the experiment
taken from the experiment file (a bad file exits 2 with its `file: field: problem` lines). FLAGS are
`trainer logs`' own (`--since 2d`, `--lines`, `--json`; `LOGS_ARGS` in make). docs/watch.md.
"""

from __future__ import annotations

import sys

from stacks.load import ExperimentError, argument, load_all


def main(argv: list[str] | None = None) -> int:
    args = sys.argv[1:] if argv is None else argv
    if not args or args[0].startswith("-"):
        print("usage: python -m stacks.logs EXPERIMENT.toml|NAME [--since 7d] [--lines] [--json]", file=sys.stderr)
        return 2
    try:
        (e, *more) = load_all(argument(args[0]))
    except ExperimentError as err:
        print("\n".join(err.lines), file=sys.stderr)
        return 2
    if more:
        print(f"logs: {args[0]} holds several experiments; name one", file=sys.stderr)
        return 2
    from trainer.cloud.logs import main as logs_main

    return logs_main(["--project", e.spec.gcp.project, "--experiment", e.name, *args[1:]])


if __name__ == "__main__":
    sys.exit(main())
