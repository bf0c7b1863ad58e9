"""The app entry: load every experiment, build one stack each, synthesize; errors exit 2."""

from __future__ import annotations

import sys
from pathlib import Path

from stacks import alert_rules
from stacks.budget import estimate
from stacks.errors import InputError, report
from stacks.load import ExperimentFile, load_all


def build(experiments: list[ExperimentFile], outdir: str | None = None):  # -> cdktn.App
    from cdktn import App  # heavy: imported only once the input is known to be good

    from stacks.stack import TrainingStack

    app = App(outdir=outdir) if outdir else App()
    for e in experiments:
        TrainingStack(app, e.name, e.spec)
    return app


def main(target: Path | None = None) -> int:
    try:
        experiments = load_all(target)
        for e in experiments:
            for warning in (estimate(e.spec).warning(), e.spec.machine.image_note(), alert_rules.note(e.spec)):
                if warning:
                    print(f"{e.path}: {warning}", file=sys.stderr)
        # Building packs the code and the locked wheels: an unlocked requirement, a wheel that
        # cannot be fetched or a tree that cannot be packed is one line each, never a traceback.
        app = build(experiments)
    except InputError as err:
        return report(err)
    app.synth()
    return 0
