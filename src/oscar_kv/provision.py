"""One way to an artifact for a model: the one given, the one shipped for it, one calibrated for the same weights
earlier, or one calibrated now.  It sits above artifacts, calibration and the cache (it may run a calibration),
so none of them imports it."""

from __future__ import annotations

import logging
from pathlib import Path

from .artifacts import MANIFEST_FILE, ArtifactError, Rotations, load_shipped, model_fingerprint
from .cache import unprepare_model
from .calibrate import calibrate as run_calibration
from .home import artifact_cache_dir
from .models import AttentionGeometry

log = logging.getLogger(__name__)


class ArtifactMissing(ArtifactError):
    """No artifact was given, none ships for the model, none was calibrated for it before, and calibrating now
    was not allowed."""


def obtain(model_name: str, model, tokenizer=None, directory: str | Path | None = None, calibrate: bool = False,
           cache_dir: str | Path | None = None) -> "Rotations":
    """The artifact to serve ``model`` (loaded from ``model_name``, a --model value) with, checked against its
    geometry, in this order: ``directory`` if given (validated, errors raised); the one shipped in the package
    for an embedded model with these exact weights; one calibrated earlier for the same weights under
    ``cache_dir`` (default home.artifact_cache_dir(model_name)); else, if ``calibrate``, calibrate now with the
    defaults (a minute or two on a CPU) and keep it there.  Raises ArtifactMissing otherwise."""
    geometry = AttentionGeometry.of(model.config)
    if directory is not None:
        return Rotations.load(directory, geometry, model_fingerprint(model))
    shipped = load_shipped(model_name, model)
    if shipped is not None:
        log.info("using the rotation artifact shipped for %s", model_name)
        return shipped
    cached = Path(cache_dir) if cache_dir is not None else artifact_cache_dir(model_name)
    fingerprint = model_fingerprint(model)
    if (cached / MANIFEST_FILE).is_file():
        try:
            rot = Rotations.load(cached, geometry)
        except ArtifactError as exc:
            log.warning("ignoring the cached artifact in %s: %s", cached, exc)
        else:
            if rot.manifest.get("fingerprint") == fingerprint:
                log.info("using the rotations calibrated earlier in %s", cached)
                return rot
            log.warning("the artifact cached in %s was calibrated on other weights; not using it", cached)
    if not calibrate:
        raise ArtifactMissing(f"no rotation artifact for {model_name}: none was given, none ships with the package "
                              f"for it, and none was calibrated in {cached}")
    if tokenizer is None:
        raise ValueError("calibrating needs the tokenizer")
    log.info("calibrating rotations for %s (once; kept in %s) ...", model_name, cached)
    rot = run_calibration(model, tokenizer)
    unprepare_model(model)
    rot.save(cached)
    return rot
