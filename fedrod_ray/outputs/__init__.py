"""What a run writes and where: run-directory storage on any filesystem (``storage``), every field of a
round's record (``metric_schema``), the metrics files and curves (``results``, ``plotting``), the
experiment trackers (``tracking``) and one writer per directory (``lock``).
"""
