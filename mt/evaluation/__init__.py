"""Stage 6: scores and reports. ``metrics`` (sacreBLEU's BLEU, chrF, TER with signatures; what
validation and ``mt-evaluate`` call), ``evaluate`` (``mt-evaluate``: score files, or decode a
run's split and write its results), ``report`` (``report.md`` with the run's curves)."""
