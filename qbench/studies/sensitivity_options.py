"""The sensitivity study's unit groupings, apart from :mod:`qbench.studies.sensitivity` so that the command line can
list them in its ``--help`` without importing torch."""

from __future__ import annotations

BY = ("layer", "block", "type")
