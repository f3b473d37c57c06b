"""``batchfit models``: the catalog's models (their configs ship with batchfit)."""

from __future__ import annotations

from batchfit import models as catalog
from batchfit.cli.common import _emit_json
from batchfit.cli.options import JsonO


def models(as_json: JsonO = False) -> None:
    """List the catalog models (config facts ship with batchfit; no download)."""
    # rich's tables load when a command prints, not for `batchfit --help`
    from batchfit.cli.render import catalog as show

    # looked up on their module: a test may stand in for them
    infos = [catalog.resolve_model(name) for name in catalog.catalog_names()]
    if as_json:
        _emit_json({"models": [show.model_row(i) for i in infos]})
    else:
        show.models(infos)
