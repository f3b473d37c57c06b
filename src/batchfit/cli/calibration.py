"""``batchfit calibration``: how far measured peaks came from their estimates, and what
``plan --headroom auto`` takes from them."""

from __future__ import annotations

from batchfit.cli.common import _emit_json, _warn
from batchfit.cli.options import JsonO


def calibration(as_json: JsonO = False) -> None:
    """How far measured peaks came from their estimates, by GPU and torch version.

    Records come from `monitor --plan` (on a GPU against a plan; on the CPU against an
    `estimate --device cpu --json`, RSS with the Python runtime added), the probe and the
    training callbacks with a plan; `plan --headroom auto` uses their 99th percentile for
    the plan's GPU (CPU records never count for a GPU). The runs that timed their steps are
    listed too: `plan` and `estimate` scale their time on that GPU by them.
    """
    # the records and rich's tables load when the command runs, not for `batchfit --help`
    from batchfit import calibration as cal
    from batchfit.cli.render import calibration as show

    records = cal.load(warn=_warn)
    rows = cal.summary(records)
    timed = cal.time_summary(records)
    headroom = cal.auto_headroom(records)
    if as_json:
        _emit_json(
            {
                "path": str(cal.path()),
                "records": len(records),
                "by_device": rows,
                "headroom_auto": headroom.fraction,
                "headroom_why": headroom.why,
                "step_time": timed,
            }
        )
        return
    show.calibration(cal.path(), len(records), rows, headroom)
    show.step_time(timed)
